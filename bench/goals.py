"""Pass/miss per performance goal of issue 12, read from a pytest-benchmark JSON of ``bench/``.

    python bench/goals.py gpu_results/bench_raw.json [--out goals.md]

Each goal compares our provider with a baseline in the same benchmark group (same problem, same
run): ``baseline time / our time`` for the GEMM-shaped ops (>= 1: ours is as fast), and the
fraction of the measured device copy bandwidth for the memory-bound slice ops. The worst problem
decides the goal; every problem's ratio is listed.
"""
import report
from report import rows_of

# (goal, group prefix, our provider, baseline provider or "copy peak", threshold)
GOALS = [
    ("gated_linear fwd >= 0.95x torch linear", "gated_linear fwd ", "ist_kernels gated_linear", "torch linear", 0.95),
    ("relu_gates >= 0.95x torch linear", "relu_gates ", "ist_kernels relu_gates", "torch linear", 0.95),
    ("gated_linear fwd+bwd >= 0.95x unmasked torch linear fwd+bwd", "gated_linear fwd+bwd ",
     "ist_kernels gated_linear", "torch linear", 0.95),
    ("subnet_linear >= 0.9x pre-gathered dense GEMMs", "subnet_linear ", "ist_kernels.subnet_linear",
     "pre-gathered matmul", 0.9),
    ("slice gather >= 70% of device copy bandwidth", "slice gather ", "ist_kernels", "copy peak", 0.70),
    ("slice scatter >= 70% of device copy bandwidth", "slice scatter ", "ist_kernels", "copy peak", 0.70),
]


def evaluate(data):
    groups = rows_of(data)
    lines = ["| goal | worst | result | per problem |", "|---|---:|---|---|"]
    for goal, prefix, ours, base, threshold in GOALS:
        ratios = []
        for group, entries in groups.items():
            if not group.startswith(prefix) or (prefix == "gated_linear fwd " and "fwd+bwd" in group):
                continue
            by = {info.get("provider"): (info, s) for info, s in entries}
            if ours not in by:
                continue
            info, t = by[ours]
            if base == "copy peak":
                peak = (info.get("peaks") or {}).get("copy_bytes")
                if not peak or not info.get("bytes"):
                    continue
                ratios.append((group[len(prefix):], info["bytes"] / t / peak))
            elif base in by:
                ratios.append((group[len(prefix):], by[base][1] / t))
        if not ratios:
            lines.append(f"| {goal} | | not measured | |")
            continue
        worst = min(r for _, r in ratios)
        detail = "; ".join(f"{name}: {r:.2f}" for name, r in ratios)
        lines.append(f"| {goal} | {worst:.2f} | {'PASS' if worst >= threshold else 'MISS'} | {detail} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    report.main(argv, make=evaluate, doc=__doc__)


if __name__ == "__main__":
    main()
