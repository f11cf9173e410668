"""bench/bench_overhead.py runs every op on its tiny tensors and writes the documented rows
(timings are reported by the benchmark, never asserted here)."""
import json
import os
import subprocess
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "bench_overhead.py")


def test_rows(tmp_path):
    out = tmp_path / "overhead.json"
    proc = subprocess.run([sys.executable, BENCH, "--device", "cpu", "--calls", "3", "--repeats", "1", "--json",
                           str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    ops = {r["op"] for r in rows}
    for name in ("pack_gates", "unpack_gates", "relu_gates", "gated_linear", "gated_linear fwd+bwd", "subnet_linear",
                 "subnet_linear fwd+bwd", "owner_average_"):
        assert name in ops
    assert any(o.startswith("gather_slices") for o in ops) and any(o.startswith("scatter_slices_") for o in ops)
    for r in rows:
        assert {"op", "device", "ours_us", "torch_us", "ratio"} <= set(r) and r["device"] == "cpu"
        assert r["ours_us"] > 0 and r["torch_us"] > 0
        assert abs(r["ratio"] - r["ours_us"] / r["torch_us"]) <= 0.02 * r["ratio"] + 0.01
    assert "| gated_linear | cpu |" in proc.stdout
