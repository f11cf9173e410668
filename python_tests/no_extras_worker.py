"""Run by test_packaging.py in a fresh interpreter: a meta-path hook makes the trainer's and the
experiments' dependencies, the [hf] extra's transformers (and Triton, absent from a CPU-only
install) unimportable, as in a fresh `pip install ist_kernels` with no extras; then ``import
ist_kernels`` and its library subpackages, run every op (forward and backward) against the float64
references, and check that none of the blocked modules was imported; ``import ist_kernels.train`` /
``ist_kernels.experiments`` must fail with one line naming the extra to install, and the ist-train
entry point must print that line and exit 2. Prints ``ok <number of ops checked>``."""
import importlib
import importlib.abc
import os
import pkgutil
import sys

BLOCKED = ("matplotlib", "sklearn", "tqdm", "yaml", "numpy", "triton", "transformers", "tokenizers", "safetensors",
           "huggingface_hub")
# ist-train and the experiments need the extras
OPTIONAL = ("ist_kernels.train", "ist_kernels.experiments")
# the optional Triton backend: each op family's _triton module and the shared ops/_triton_common.py
TRITON_MODULES = "_triton"


class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: not installed without extras)", name=name)
        return None


sys.meta_path.insert(0, Block())
os.environ.pop("TRITON_INTERPRET", None)
for name in BLOCKED:  # the hook itself works
    try:
        importlib.import_module(name)
    except ImportError:
        pass
    else:
        raise SystemExit(f"the hook did not block {name}")

import torch  # noqa: E402

import ist_kernels  # noqa: E402

for m in pkgutil.walk_packages(ist_kernels.__path__, "ist_kernels."):
    if not m.name.startswith(OPTIONAL) and not m.name.rpartition(".")[2].startswith(TRITON_MODULES):
        importlib.import_module(m.name)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reference as ref  # noqa: E402

ops = torch.ops.ist_kernels
g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
checked = set()


def close(a, b, what):
    torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-5, msg=what)
    checked.add(what.split(" ")[0])


def randn(*shape, grad=False):
    return torch.randn(*shape, generator=g).requires_grad_(grad)


# gates
mask = torch.rand(3, 37, generator=g) > 0.5
words = ops.pack_gates(mask)
assert torch.equal(words, ref.pack_gates(mask)) and torch.equal(ops.unpack_gates(words, 37), mask)
checked |= {"pack_gates", "unpack_gates"}

# GReLU layers, forward and backward (autograd and the backward op)
x, w, b = randn(5, 19, grad=True), randn(37, 19, grad=True), randn(37, grad=True)
out, gates = ops.relu_gates(x, w, b)
r_out, r_gates = ref.relu_gates(x.detach(), w.detach(), b.detach())
close(out, r_out, "relu_gates")
assert torch.equal(gates, r_gates)
y = ops.gated_linear(x, w, b, gates)
close(y, ref.gated_linear(x.detach(), w.detach(), b.detach(), gates), "gated_linear")
go = randn(5, 37)
y.backward(go)
for got, want in zip((x.grad, w.grad, b.grad), ref.gated_linear_backward(go, x.detach(), w.detach(), gates)):
    close(got, want, "gated_linear autograd")
for got, want in zip(ops.gated_linear_backward(go, x.detach(), w.detach(), gates, [True, True, True]),
                     ref.gated_linear_backward(go, x.detach(), w.detach(), gates)):
    close(got, want, "gated_linear_backward")

# subnetwork linear layer
rows, cols = torch.tensor([4, 0, 9, 2]), torch.tensor([1, 7, 3])
x, w, b = randn(6, 3, grad=True), randn(11, 8, grad=True), randn(11, grad=True)
y = ops.subnet_linear(x, w, b, rows, cols)
close(y, ref.subnet_linear(x.detach(), w.detach(), b.detach(), rows, cols), "subnet_linear")
go = randn(6, 4)
y.backward(go)
want = ref.subnet_linear_backward(go, x.detach(), w.detach(), rows, cols)
for got, exp in zip((x.grad, w.grad, b.grad), want):
    close(got, exp, "subnet_linear autograd")
for got, exp in zip(ops.subnet_linear_backward(go, x.detach(), w.detach(), rows, cols, [True, True, True]), want):
    close(got, exp, "subnet_linear_backward")

# multi-tensor slices
srcs = [randn(7, 5, grad=True), randn(4, 9, grad=True)]
ids, idx, dims = [0, 1, 0], [torch.tensor([6, 1]), torch.tensor([8, 0, 3]), torch.tensor([2])], [0, 1]
flat = ops.slice_gather(srcs, ids, idx, dims)
close(flat, ref.slice_gather([s.detach() for s in srcs], ids, idx, dims), "slice_gather")
flat.sum().backward()
assert srcs[0].grad is not None and srcs[1].grad is not None
segs = ops.slice_gather_segments(srcs, ids, idx, dims)
for got, want in zip(segs, ref.slice_gather([s.detach() for s in srcs], ids, idx, dims).split([10, 12, 5])):
    close(got.reshape(-1), want, "slice_gather_segments")
assert [list(v.shape) for v in segs] == [[2, 5], [4, 3], [1, 5]]
buf = torch.empty(flat.numel())
ops.slice_gather_into_(buf, [s.detach() for s in srcs], ids, idx, dims)
close(buf, flat.detach(), "slice_gather_into_")
for reduce in ("copy", "sum", "mean"):
    targets = [randn(7, 5), randn(4, 9)]
    updates = [randn(2, 5), randn(4, 3), randn(1, 5)]
    want = ref.slice_scatter(targets, ids, updates, idx, dims, reduce)
    ops.slice_scatter_(targets, ids, updates, idx, dims, reduce)
    for t, exp in zip(targets, want):
        close(t, exp, "slice_scatter_ " + reduce)

# the same slices through a plan (slice_plan, slice_plan_gather_, slice_plan_scatter_)
from ist_kernels.functional import slice_plan  # noqa: E402

srcs = [s.detach() for s in srcs]
plan = slice_plan(srcs, ids, idx, dims)
checked.add("slice_plan")
for got, want in zip(plan.gather(srcs), ref.slice_gather(srcs, ids, idx, dims).split([10, 12, 5])):
    close(got.reshape(-1), want, "slice_plan_gather_")
for reduce in ("copy", "sum", "mean"):
    targets = [randn(7, 5), randn(4, 9)]
    updates = [randn(2, 5), randn(4, 3), randn(1, 5)]
    want = ref.slice_scatter(targets, ids, updates, idx, dims, reduce)
    plan.scatter_(targets, updates, reduce)
    for t, exp in zip(targets, want):
        close(t, exp, "slice_plan_scatter_ " + reduce)

# the trainer and the experiments need their extras: one line says which (ist_kernels/_extras.py)
NEEDS = {"ist_kernels.train": "ist_kernels.train needs numpy: pip install 'ist_kernels[train]'",
         "ist_kernels.experiments": "ist_kernels.experiments needs numpy, tqdm: pip install 'ist_kernels[experiments]'"}
for name, line in NEEDS.items():
    try:
        importlib.import_module(name)
    except ImportError as e:
        if str(e) != line or e.name != name:
            raise SystemExit(f"import {name}: {e!r}, expected {line!r}")
    else:
        raise SystemExit(f"import {name} worked without its extra")
    if any(m == name or m.startswith(name + ".") for m in sys.modules):
        raise SystemExit(f"{name} left modules imported: {sorted(m for m in sys.modules if m.startswith(name))}")
import contextlib  # noqa: E402
import io  # noqa: E402

from ist_kernels._console import ist_train  # noqa: E402

err = io.StringIO()
try:
    with contextlib.redirect_stderr(err):
        ist_train(["--list-methods"])
except SystemExit as e:
    want = "ist-train needs numpy, scikit-learn, tqdm, pyyaml, matplotlib: pip install 'ist_kernels[train]'\n"
    if e.code != 2 or err.getvalue() != want:
        raise SystemExit(f"ist-train without its extra: status {e.code}, stderr {err.getvalue()!r}") from None
else:
    raise SystemExit("ist-train ran without its extra")

schemas = {n.split("::")[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
           if n.startswith("ist_kernels::")}  # every op of the library (csrc/ops.cpp)
missing = schemas - checked
leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
if missing or leaked:
    raise SystemExit(f"ops not run: {sorted(missing)}; blocked modules imported: {leaked}")
print("ok", len(schemas))
