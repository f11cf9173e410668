"""Partition plans: which subnetwork owns which slice of the model in a round."""
from .loft import LoftPlan, loft_plan  # noqa: E402,F401
from .resist import ResistPlan, resist_plan  # noqa: E402,F401
from ._subnetworks import Subnetwork, SubnetworkPlan  # noqa: E402,F401
from .neurons import bernoulli_masks, categorical_assignment, categorical_partition, random_subsets  # noqa: F401
from .neurons import indices_to_masks, masks_to_indices, owner_counts, round_generator, round_seed  # noqa: F401
from .plan import SlicePlan, TensorSlices, positions  # noqa: F401
from .aggregate import aggregate_slices_  # noqa: F401
