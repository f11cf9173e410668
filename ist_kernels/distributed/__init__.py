"""Distributed aggregation of subnetworks over torch.distributed (NCCL for CUDA, gloo for CPU).

One subnetwork per rank. Between rounds :class:`Exchange` gives every rank its next subnetwork in
two collectives (one all_to_all_single for the partitioned slices, one all_reduce for the shared
tensors), owner-averaged exactly as the simulated single-process path; :func:`gather_full_model`
assembles the model on one rank in one collective; :func:`average_model_` is the local-SGD
baseline; :func:`plan_bytes`, :func:`gather_bytes` and :func:`ps_bytes` count, from the plans
alone, what they move (and what the papers' parameter-server convention counts; every byte
formula, the ring all-reduce's 2 (S - 1) / S included, is :mod:`.ledger`'s). Process groups
come from :func:`init_process_group` (created once, one timeout), and a collective that fails or
stalls raises :class:`CollectiveError` naming itself and the round. ``compress`` ("bf16", "int8";
:mod:`.compress`) encodes what the exchange and the averages send, routing-independently, so that a
simulated run can encode the same values.
"""
from .exchange import (  # noqa: F401
    CommStats,
    Exchange,
    average_model_,
    gather_bytes,
    gather_full_model,
    plan_bytes,
    plan_fingerprint,
)
from .group import (  # noqa: F401
    CollectiveError,
    collective_timeout,
    default_backend,
    destroy_process_group,
    init_process_group,
)
from .ledger import ps_bytes  # noqa: F401
