"""Small-scale reproductions of the papers' experiments; run ``python -m ist_kernels.experiments NAME``."""
