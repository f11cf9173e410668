"""Turn a pytest-benchmark JSON file into a side-by-side markdown table.

    python -m pytest bench -q --benchmark-json=bench/results/raw.json
    python bench/report.py bench/results/raw.json --out bench/results/<device>.md

Per problem (benchmark group): each provider's median time, achieved TFLOP/s and GB/s, the
fraction of the machine's measured peak (matmul FLOP/s for the dtype, or copy bandwidth for
memory-bound problems) and ``ours / provider`` speed ratio (> 1: ours is faster).
"""
import argparse
import json
import sys
from collections import defaultdict


def rows_of(data):
    groups = defaultdict(list)
    for b in data["benchmarks"]:
        info = b.get("extra_info", {})
        seconds = info.get("median_s", b["stats"]["median"])  # CUDA-event median where measured
        groups[b.get("group") or b["name"]].append((info, seconds))
    return groups


def load(paths):
    """The benchmarks of several pytest-benchmark JSON files, as one file's dict."""
    data = {"benchmarks": []}
    for path in paths:
        with open(path) as f:
            data["benchmarks"] += json.load(f)["benchmarks"]
    return data


def fraction_of_peak(info, seconds):
    peaks = info.get("peaks") or {}
    flops, nbytes = info.get("flops", 0), info.get("bytes", 0)
    if flops and peaks.get(f"matmul_{info.get('dtype')}"):
        return flops / seconds / peaks[f"matmul_{info.get('dtype')}"], "matmul"
    if nbytes and peaks.get("copy_bytes"):
        return nbytes / seconds / peaks["copy_bytes"], "copy"
    return None, ""


def render(data) -> str:
    out = []
    device = None
    for group, entries in rows_of(data).items():
        ours = [s for info, s in entries if info.get("provider", "").startswith("ist_kernels")]
        out.append(f"\n### {group}\n")
        out.append("| provider | median ms | TFLOP/s | GB/s | % of peak | ours faster by |")
        out.append("|---|---:|---:|---:|---:|---:|")
        for info, s in entries:
            device = info.get("device", device)
            tf = info.get("flops", 0) / s / 1e12 if info.get("flops") else None
            gb = info.get("bytes", 0) / s / 1e9 if info.get("bytes") else None
            frac, kind = fraction_of_peak(info, s)
            ratio = s / ours[0] if ours else None
            out.append(
                f"| {info.get('provider', '?')} | {s * 1e3:.3f} | {'' if tf is None else f'{tf:.2f}'} | "
                f"{'' if gb is None else f'{gb:.1f}'} | {'' if frac is None else f'{100 * frac:.0f}% {kind}'} | "
                f"{'' if ratio is None else f'{ratio:.2f}x'} |")
    head = [f"# Benchmarks on {device}", ""]
    peaks = next((b.get("extra_info", {}).get("peaks") for b in data["benchmarks"] if b.get("extra_info", {}).get("peaks")), None)
    if peaks:
        head.append("Measured peaks: " + ", ".join(
            f"{k} {v / 1e12:.1f} TFLOP/s" if k.startswith("matmul") else f"{k} {v / 1e9:.0f} GB/s" for k, v in peaks.items()))
    return "\n".join(head + out) + "\n"


def main(argv=None, make=render, doc=__doc__):
    """Command line shared with bench/goals.py: JSON files in, markdown ``make(data)`` out."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("json", nargs="+", help="pytest-benchmark JSON files (merged)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    text = make(load(args.json))
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
