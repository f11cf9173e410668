"""Partition plans: which subnetwork owns which slice of the model in a round."""
from .plan import SlicePlan, TensorSlices  # noqa: F401
