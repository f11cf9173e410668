"""tools/gpu_step_costs.py's verdicts (issue 38): local SGD's step against its FLOPs at the measured
peak, each subnetwork method's step against its FLOP ratio times local SGD's step; rows that did
not run are listed, never passed."""
import importlib.util
import os

_PATH = os.path.join(os.path.dirname(__file__), "..", "tools", "gpu_step_costs.py")
_spec = importlib.util.spec_from_file_location("gpu_step_costs", _PATH)
gsc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gsc)


def _row(method, ms, step, full, mode="eager", batch=16, model="gpt1024"):
    r = {"model": model, "batch": batch, "mode": mode, "method": method, "flops": {"step": step, "full": full}}
    if ms is not None:
        r["ms_per_step"] = ms
    return r


def test_checks_hold_each_row_to_its_bound():
    peak = 500e12  # FLOP/s
    full = 5e12  # a local SGD step: 10 ms at the peak
    rows = [_row("localsgd", 14.9, full, full), _row("ist-ffn", 8.5, 0.5 * full, full),
            _row("ist-heads", 12.0, 0.75 * full, full), _row("resist", None, 0.4 * full, full),
            _row("localsgd", 15.1, full, full, mode="compile"), _row("ist-ffn", 8.0, 0.5 * full, full, model="llama")]
    gsc.checks(rows, peak)
    lsgd, ffn, heads, resist, lsgd_c, orphan = rows
    assert abs(lsgd["flop_ms"] - 10.0) < 1e-9 and lsgd["check"] == "PASS"  # 14.9 <= 1.5 x 10
    assert lsgd_c["check"] == "MISS"  # 15.1 > 15
    assert abs(ffn["bound"] - 0.575) < 1e-12 and abs(ffn["measured_ratio"] - 8.5 / 14.9) < 1e-12
    assert ffn["check"] == "PASS"  # 0.5705 <= 1.15 x 0.5
    slow = [_row("localsgd", 14.9, full, full), _row("ist-ffn", 8.6, 0.5 * full, full)]
    gsc.checks(slow, peak)
    assert slow[1]["check"] == "MISS"  # 0.5772 > 0.575: the edge is held
    assert heads["check"] == "PASS"  # 0.805 <= 0.8625
    assert resist["check"] == "not reached" and orphan["check"] == "no local SGD run"


def test_render_lists_every_row_with_its_verdict():
    full = 5e12
    rows = [_row("localsgd", 14.0, full, full), _row("ist-ffn", None, 0.5 * full, full)]
    rows[1]["error"] = "the budget was spent"
    gsc.checks(rows, 500e12)
    doc = {"device": "NVIDIA H200", "command": "python tools/gpu_step_costs.py --out x.md", "wall_s": 1.0,
           "torch": "2.11", "workers": 4, "local_steps": 10, "rounds": 3, "precision": "bf16", "context": 512,
           "peak": {"flops_per_s": 500e12, "n": 8192, "dtype": "bfloat16"}, "rows": rows}
    md = gsc.render(doc)
    assert "| gpt1024 | 16 | eager | localsgd | 14.00 | 5000.0 | 1 (FLOP time 10.00 ms) | 1.400 | 1.500 | PASS | - |" \
        in md
    assert "not reached (the budget was spent)" in md and "1 of 2 rows PASS" in md and "500.0 TFLOP/s" in md
