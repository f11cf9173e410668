"""Partition plans: which subnetwork owns which slice of the model in a round."""
from .neurons import bernoulli_masks, categorical_assignment, categorical_partition, random_subsets  # noqa: F401
from .neurons import indices_to_masks, masks_to_indices, owner_counts, round_generator, round_seed  # noqa: F401
from .plan import SlicePlan, TensorSlices  # noqa: F401
