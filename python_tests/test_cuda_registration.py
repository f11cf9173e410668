"""How the CUDA backends are registered (issue 11 item 4; ist_kernels/ops/_cuda.py): the Triton
kernels are traced into torch.compile graphs through wrap_triton (checked here on fake CUDA tensors,
and on a GPU in the Inductor output), and without Triton an ATen composition is the CUDA kernel,
chosen at import with one warning where a CUDA device exists."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ist_kernels.ops.grelu import _aten as aten_grelu

import reference as ref
from conftest import requires_cuda, requires_triton

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRELU_OPS = ("relu_gates", "gated_linear", "gated_linear_backward")
CUDA_OPS = GRELU_OPS + ("subnet_linear", "subnet_linear_backward")
TRACEABLE = hasattr(torch.library, "wrap_triton")


def run_python(code, env_drop=()):
    """``code`` in a fresh interpreter with this checkout first on the path; returns the result."""
    env = {k: v for k, v in os.environ.items() if k not in env_drop}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=240)


# ------------------------------------------------------------------------------- without Triton
HIDE_TRITON = """
    import importlib.abc, sys
    class HideTriton(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ImportError(f"No module named {name!r} (hidden by the test)")
    sys.meta_path.insert(0, HideTriton())
"""


@pytest.mark.parametrize("devices", [1, 0])
def test_import_without_triton_registers_the_aten_composition_for_cuda(devices):
    """One warning where a CUDA device exists (torch.cuda.device_count patched: this machine may have
    none, or one), none where there is none: a CPU-only install never takes the CUDA path."""
    res = run_python(HIDE_TRITON + f"""
    import torch
    torch.cuda.device_count = lambda: {devices}
    import ist_kernels
    import ist_kernels.ops.grelu, ist_kernels.functional  # imported again: no second warning
    assert "triton" not in sys.modules
    from ist_kernels.ops import _cuda
    assert not _cuda.HAS_TRITON
    for op in {CUDA_OPS!r}:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"ist_kernels::{{op}}", "CUDA"), op
    print("ok")
    """)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"
    warnings = [line for line in res.stderr.splitlines() if "triton is not installed" in line]
    assert len(warnings) == devices, res.stderr
    assert all(op in line for op in GRELU_OPS for line in warnings)


@requires_triton
def test_import_with_triton_is_silent():
    res = run_python("import ist_kernels, torch; print(ist_kernels.ops._cuda.HAS_TRITON)")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "True" and "triton is not installed" not in res.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_aten_composition_matches_reference(dtype, gen):
    """The no-Triton CUDA backend is torch ops only, so its math is checked here on CPU tensors."""
    x = torch.randn(3, 2, 37, generator=gen, dtype=dtype)
    w, b = torch.randn(45, 37, generator=gen, dtype=dtype), torch.randn(45, generator=gen, dtype=dtype)
    x[0, 0, 3] = float("nan")  # relu propagates NaN, a NaN gate is off, masking multiplies
    out, gates = aten_grelu.relu_gates(x, w, b)
    want_out, want_gates = ref.relu_gates(x, w, b)
    torch.testing.assert_close(out, want_out.to(dtype), equal_nan=True)
    assert torch.equal(gates, want_gates)
    y = aten_grelu.gated_linear(x, w, None, gates)
    torch.testing.assert_close(y, ref.gated_linear(x, w, None, gates).to(dtype), equal_nan=True)
    g = torch.randn(3, 2, 45, generator=gen, dtype=dtype)
    got = aten_grelu.gated_linear_backward(g, x.nan_to_num(), w, gates, [True, True, True])
    for t, want in zip(got, ref.gated_linear_backward(g, x.nan_to_num(), w, gates)):
        torch.testing.assert_close(t, want.to(dtype))
    dx, dw, db = aten_grelu.gated_linear_backward(g, x, w, gates, [False, True, False])
    assert dx.numel() == 0 and db.numel() == 0 and dw.shape == w.shape
    with pytest.raises(ValueError, match="gates"):
        aten_grelu.gated_linear(x, w, b, gates[..., :1])


# ---------------------------------------------------------------- traced by torch.compile (wrap_triton)
@requires_triton
@pytest.mark.skipif(not TRACEABLE, reason="torch < 2.6 has no wrap_triton: the Triton ops stay opaque")
def test_triton_ops_decompose_into_kernels_when_traced():
    """AOTAutograd (what torch.compile runs before Inductor) traces an op on CUDA tensors through its
    launcher: the graphs hold triton_kernel_wrapper_functional nodes naming our kernels instead of
    the op. Done on fake CUDA tensors (no GPU needed) with real Triton JIT kernels, so in a process
    without TRITON_INTERPRET."""
    res = run_python("""
    import torch, ist_kernels
    from functorch.compile import aot_function
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from torch._subclasses.fake_tensor import FakeTensorMode

    class Captured(Exception):
        pass

    def kernels(gm):
        names = []
        for n in gm.graph.nodes:
            if "triton_kernel_wrapper" in str(n.target):
                k = kernel_side_table.get_kernel(n.kwargs["kernel_idx"])
                names.append(getattr(k, "fn", k).__name__)
            elif "ist_kernels" in str(n.target):
                names.append(str(n.target))
        return names

    graphs = []
    def compiler(gm, _):
        graphs.append(kernels(gm))
        raise Captured

    # Fake CUDA tensors cannot carry autograd metadata without CUDA, so the backward op is traced
    # directly (torch.compile's backward graph calls it the same way).
    with FakeTensorMode():
        x, w, c = (torch.empty(64, 96, device="cuda"), torch.empty(128, 96, device="cuda"),
                   torch.empty(128, 96, device="cuda"))
        g = torch.empty(64, 128, device="cuda")

    def net(x, w, c, g):
        _, gates = torch.ops.ist_kernels.relu_gates(x, c, None)
        y = torch.ops.ist_kernels.gated_linear(x, w, None, gates)
        return y, *torch.ops.ist_kernels.gated_linear_backward(g, x, w, gates, [True, True, True])

    try:
        aot_function(net, fw_compiler=compiler)(x, w, c, g)
    except Captured:
        pass
    print(graphs[0])
    """, env_drop=("TRITON_INTERPRET",))
    assert res.returncode == 0, res.stderr[-3000:]
    names = eval(res.stdout.strip().splitlines()[-1])
    # relu_gates and gated_linear: the fused GEMM twice (the pointer kernel: traced, no TMA); the
    # backward: its gate pass (the GEMMs are aten.mm nodes)
    assert names == ["_linear_gates_fwd", "_linear_gates_fwd", "_gate_grad"], names


def test_cpu_ops_stay_single_ops_under_compile(gen):
    """The FunctionalTensorMode rule leaves CPU tensors to the C++ kernel (one op in the graph)."""
    from torch._inductor.utils import run_and_get_code

    x, w = torch.randn(8, 5, generator=gen), torch.randn(40, 5, generator=gen)
    out, code = run_and_get_code(torch.compile(lambda x, w: torch.ops.ist_kernels.relu_gates(x, w, None)[0] * 2,
                                               fullgraph=True), x, w)
    torch.testing.assert_close(out, (ref.relu_gates(x, w)[0] * 2).float())
    assert "ist_kernels.relu_gates" in "\n".join(code)


@requires_cuda
@requires_triton
@pytest.mark.skipif(not TRACEABLE, reason="torch < 2.6 has no wrap_triton")
def test_compiled_module_shows_triton_kernel_in_inductor_output(gen):
    from torch._inductor.utils import run_and_get_code

    from ist_kernels.nn import GatedLinear

    layer = GatedLinear(96, 128).cuda()
    x = torch.randn(64, 96, device="cuda")
    gates = ref.pack_gates(torch.rand(64, 128, generator=gen) > 0.5).cuda()
    out, code = run_and_get_code(torch.compile(lambda x: torch.relu(layer(x, gates)), fullgraph=True), x)
    torch.testing.assert_close(out.double(), torch.relu(ref.gated_linear(x, layer.weight.detach(),
                                                                          layer.bias.detach(), gates)),
                               rtol=1e-4, atol=1e-4)
    source = "\n".join(code)
    assert "_linear_gates_fwd" in source, source[:2000]
    assert "ist_kernels.gated_linear" not in source
