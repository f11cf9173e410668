import os
import socket
import time
from typing import Tuple

import pytest
import torch
import torch.multiprocessing as mp

# Triton kernels run on CPU tensors under the interpreter when there is no GPU. This must be set
# before any Triton kernel is defined, i.e. before ist_kernels is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# On a GPU the tests pin one tile config per kernel (ist_kernels.ops._triton_common.AUTOTUNE).
os.environ.setdefault("IST_KERNELS_AUTOTUNE", "0")

import ist_kernels  # noqa: E402,F401

try:  # property tests (test_properties.py); the profile is picked by HYPOTHESIS_PROFILE (default "ci")
    from hypothesis import HealthCheck, settings

    # "ci": 200 examples per property, fresh random ones each run (derandomize=False), no deadline
    # (the Triton interpreter is slow), a failure printed with its reproduction blob.
    settings.register_profile("ci", max_examples=200, deadline=None, derandomize=False, print_blob=True,
                              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    settings.register_profile("dev", settings.get_profile("ci"), max_examples=25)  # a quick look
    settings.register_profile("long", settings.get_profile("ci"), max_examples=2000)  # a hunt
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
except ImportError:  # pragma: no cover (test_properties.py skips)
    pass

HAS_CUDA = torch.cuda.is_available()
_skip_without_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


def requires_cuda(obj):
    """Mark a GPU-only test: it carries the ``gpu`` marker (``pytest -m gpu`` selects it, also on a
    machine without a GPU, where it is collected and skipped) and skips without CUDA."""
    return pytest.mark.gpu(_skip_without_cuda(obj))


#: the CUDA entry of a ``device`` parametrization: marked ``gpu``, skipped without CUDA
CUDA_PARAM = pytest.param("cuda", marks=[pytest.mark.gpu, _skip_without_cuda])

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False
requires_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")

#: the exception types bad input may raise (ist_kernels/ops/_checks.py: TypeError for a dtype,
#: IndexError for an index out of range, ValueError for the rest); test_bad_inputs.py checks which.
BAD_INPUT = (ValueError, TypeError, IndexError)

# Devices every op is tested on: the CPU always, CUDA where present.
DEVICES = ["cpu", CUDA_PARAM]


@pytest.fixture
def gen(request):
    """A fresh, seeded generator per test: fresh random inputs, reproducible failures. The seed is
    printed (pytest shows it with a failure); ``IST_TEST_SEED=<seed>`` replays it."""
    seed = os.environ.get("IST_TEST_SEED")
    seed = int(seed) if seed else int.from_bytes(os.urandom(4), "little")
    print(f"{request.node.nodeid}: gen seeded {seed} (replay: IST_TEST_SEED={seed})")
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def global_rngs():
    """For a test that seeds the global generators (random, numpy, torch's CPU one): puts back their
    states afterwards, so that the tests after it do not all draw one fixed stream."""
    import random

    import numpy as np

    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    yield
    random.setstate(states[0])
    np.random.set_state(states[1])
    torch.set_rng_state(states[2])

# ---- multi-process failure tests: ranks that must stop with an error (never hang)
def free_port() -> int:
    """A TCP port free now on 127.0.0.1, for a test's env:// rendezvous (as torchrun's MASTER_PORT)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn_ranks_until(fn, args, nprocs: int, seconds: float) -> None:
    """Run ``fn(rank, *args)`` on ``nprocs`` spawned processes, wait at most ``seconds`` for all of
    them, and kill any still running (a hang fails the test's later checks, not the session)."""
    ctx = mp.spawn(fn, args=args, nprocs=nprocs, join=False)
    deadline = time.monotonic() + seconds
    for p in ctx.processes:
        p.join(max(deadline - time.monotonic(), 0.1))
    for p in ctx.processes:
        if p.is_alive():
            p.kill()


def write_rank_error(folder: str, rank: int, took: float, msg: str) -> None:
    """What a rank's error says and how long it took to come (read back by :func:`rank_error`)."""
    with open(os.path.join(folder, f"err{rank}.txt"), "w") as f:
        f.write(f"{took}\n{msg}")


def rank_error(folder, rank: int, missing: str) -> Tuple[float, str]:
    """(seconds, message) of ``rank``'s error; fails with ``missing`` when the rank wrote none."""
    path = os.path.join(folder, f"err{rank}.txt")
    assert os.path.exists(path), missing
    with open(path) as f:
        took, msg = f.read().split("\n", 1)
    return float(took), msg
