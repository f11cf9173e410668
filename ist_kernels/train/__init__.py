"""The thin trainer: ist-train."""
