"""Partition plans: which subnetwork owns which slice of the model in a round."""
from .loft import LoftPlan, loft_plan  # noqa: E402,F401
from .resist import ResistPlan, resist_plan  # noqa: E402,F401
from ._subnetworks import Subnetwork, SubnetworkPlan  # noqa: E402,F401
from .plan import SlicePlan, TensorSlices  # noqa: F401
