"""Partition plans: which subnetwork owns which slice of the model in a round."""
from .aggregate import aggregate_slices_  # noqa: F401
from .loft import LoftPlan, loft_plan  # noqa: E402,F401
from .neurons import (  # noqa: F401
    bernoulli_masks,
    categorical_assignment,
    categorical_partition,
    indices_to_masks,
    masks_to_indices,
    owner_counts,
    random_subsets,
    round_generator,
    round_seed,
)
from .plan import RoundPlan, SlicePlan, TensorSlices, positions  # noqa: F401
from .resist import ResistPlan, resist_plan  # noqa: E402,F401
from .structure import FFN, Attention, Structure, find_structure  # noqa: F401
from .subnetworks import Subnetwork, SubnetworkPlan  # noqa: E402,F401
from .transformer import (  # noqa: F401
    PARTITIONS,
    TransformerISTPlan,
    TransformerResistPlan,
    check_ist,
    check_resist,
    input_scale,
    is_transformer,
    residual_scale,
    set_input_scale,
    set_residual_scale,
    transformer_ist_plan,
    transformer_resist_plan,
)
