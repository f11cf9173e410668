"""The table "claim → our measurement → holds / does not hold" for papers 000-004, generated from
the experiments' JSON files (not an experiment itself).

    python -m ist_kernels.experiments.claims [--results results] [--doc [docs/experiments.md]]

Reads grelu.json, loft.json, masked.json, pruning.json and speed.json from ``--results`` and the byte counts
of ``bench/bench_bytes.py`` from ``--bytes`` (a missing file gives a row "not run"); paper 003's Table 4
row is the cost model's prediction (paper003.json from ``--results``, else computed in seconds); writes
``claims.md`` there and prints it; with ``--doc`` the table also replaces what lies between the
lines ``<!-- claims:start -->`` and ``<!-- claims:end -->`` of that file (``docs/experiments.md``
when no file is given). ``--readme FILE`` is the former name of ``--doc FILE``.
"""
import argparse
import json
import math
import os
import sys
from typing import Dict, List, Optional, Sequence, Tuple

from . import harness as C
from .harness import link as L
from .paper003 import table4_prediction

START, END = "<!-- claims:start -->", "<!-- claims:end -->"
DOC = os.path.join("docs", "experiments.md")  # the page that holds the claims table


def _load(folder: str, name: str) -> Optional[Dict]:
    path = os.path.join(folder, f"{name}.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def _seeds(doc: Dict) -> str:
    return f"{len(doc['seeds'])} seeds"


def _verdict(hits: int, total: int) -> str:
    if total == 0:
        return "not measured"
    if hits == total:
        return "holds"
    if hits >= 0.75 * total:
        return "mostly holds"
    return "does not hold" if hits <= 0.25 * total else "mixed"


def _pm(s: Dict, spec: str = ".3g") -> str:
    return C.fmt(s, spec)


def rows_loft(doc: Optional[Dict]) -> List[List[str]]:
    claim1 = ("000 §3.3/§6: LOFT preserves the winning ticket: its pruned-filter set is the dense pre-training's "
              "(our reading; the paper compares fine-tuned accuracy)")
    claim2 = "000 Fig. 1/4: filter rankings settle early; LOFT's reaches its final one faster than dense pre-training"
    if doc is None:
        return [[claim1, "not run", "—"], [claim2, "not run", "—"]]
    rows = []
    for d, s in doc["summary"].items():
        layers = s["layers"]
        last = {k: v["loft_vs_dense"][-1] for k, v in layers.items()}
        ratio = [last[k]["mean"] / s["chance"][k] for k in layers if last[k]["mean"] is not None]
        close = sum(r < 0.5 for r in ratio)
        meas = (f"{d}: LOFT-vs-dense distance at the last round / chance = "
                + ", ".join(f"{r:.2f}" for r in ratio) + f" over {len(ratio)} layers (< 0.5 in {close}); "
                f"accuracy LOFT {_pm(s['accuracy']['loft'], '.3f')} vs dense {_pm(s['accuracy']['localsgd'], '.3f')}"
                f" after pre-training ({_seeds(doc)})")
        rows.append([claim1, meas, _verdict(close, len(ratio))])
        st = {m: [v["settles"][m]["mean"] for v in layers.values()] for m in ("loft", "localsgd")}
        faster = sum(a is not None and b is not None and a <= b for a, b in zip(st["loft"], st["localsgd"]))
        fmt = lambda xs: ", ".join("—" if x is None else f"{x:.3g}" for x in xs)  # noqa: E731
        meas = (f"{d}: round from which the ranking stays within a tenth of chance of its final one, per layer: "
                f"LOFT {fmt(st['loft'])}, dense {fmt(st['localsgd'])} of {int(s['rounds'][-1])} rounds; LOFT no "
                f"later in {faster}/{len(st['loft'])} layers ({_seeds(doc)})")
        rows.append([claim2, meas, _verdict(faster, len(st["loft"]))])
    return rows


def rows_masked(doc: Optional[Dict]) -> List[List[str]]:
    claims = [("bernoulli_more_S_lower", "001 Fig. 2b: Bernoulli masks, more subnetworks S → lower error"),
              ("bernoulli_larger_xi_lower", "001 Fig. 2b: Bernoulli masks, larger ξ → lower error"),
              ("categorical_more_tau_higher", "001 Fig. 2c: categorical masks, more local steps τ → higher error"),
              ("categorical_more_S_higher", "001 Fig. 2c: categorical masks, more subnetworks S → higher error")]
    if doc is None:
        return [[c, "not run", "—"] for _, c in claims]
    fr = doc["floor_reached"]
    opts = doc["options"]
    rows = []
    for key, claim in claims:
        t = doc["trends"][key]
        meas = (f"{t['hits']}/{t['pairs']} adjacent cells move that way ({t['significant']} by > 2 SE); error floor "
                f"reached in {fr['runs']}/{fr['of']} runs; m={opts['width']}, K={opts['rounds']}, {doc['data']} data "
                f"({_seeds(doc)})")
        if key == "categorical_more_tau_higher":
            cat = doc["categorical"]
            big, S = len(cat["S"]) - 1, cat["S"][-1]
            floors = ", ".join(f"τ={t_}: {_pm(s)}" for t_, s in zip(cat["tau"], cat["floor"][big]))
            local = [doc["decomposition"][f"S={S},tau={t_}"]["local"]["mean"] for t_ in cat["tau"]]
            loc = ", ".join("—" if v is None else f"{v:.3g}" for v in local)
            meas += (f". S={S} floors {floors}; why: the subnetworks' loss after their τ local steps "
                     f"falls with τ ({loc}) and the aggregate is their mean (Appendix F), so more local steps lower "
                     "the floor")
        bm = doc.get("bernoulli_model")
        if key == "bernoulli_larger_xi_lower" and bm and bm["pairs"]:
            peaks = ", ".join("—" if x is None else f"{x:g}" for x in bm["peak_xi"])
            meas += (f". Why: the floor is highest at ξ = {peaks} for S = "
                     f"{', '.join(str(S) for S in doc['bernoulli']['S'])}: sampling noise E‖û − u‖² falls with ξ "
                     "while the aggregate's step c = θ(1 − ρ) grows with it, and a one-round noise model, floor = "
                     f"c·E‖û − u‖²/(S(2 − c)) with nothing fitted, predicts measured/predicted = "
                     f"{_pm(bm['ratio'], '.2f')} and the direction in {bm['agree']}/{bm['pairs']} pairs at their floor")
        rows.append([claim, meas, _verdict(t["hits"], t["pairs"])])
    return rows


def rows_pruning(doc: Optional[Dict]) -> List[List[str]]:
    claim = "002 Fig. 2a/2b: mild random pruning keeps (or improves) the dense test error; over-pruning from p ≈ 0.5"
    if doc is None:
        return [[claim, "not run", "—"]]
    summ = {(r["init_std"], r["sigma_n"], r["p"]): r for r in doc["summary"]}
    rows = []
    for t in doc["threshold"]:
        i, s = t["init_std"], t["sigma_n"]
        dense, half = summ[(i, s, 0.0)]["test_error"], summ.get((i, s, 0.5), {}).get("test_error")
        at = "no over-pruning in the grid" if t["p"] is None else f"over-pruning from p = {t['p']:g}"
        opts = doc["options"]
        edge = 1 - math.log(opts["d"]) / opts["width"]
        meas = (f"σ_0={i:g}, σ_n={s:g}: test error dense {_pm(dense)}, p=0.5 {_pm(half) if half else '—'}, best at "
                f"p = {t['best_p']:g}; {at} ({_seeds(doc)}). Why later than 0.5: the signal lives in one "
                f"coordinate, which m(1 − p) = {opts['width'] * 0.01:g} filters per class still see at p = 0.99; "
                f"Theorem 3.1's range ends near p = 1 − log(d)/m = {edge:.2f}")
        mild_ok = half is not None and half["mean"] is not None and dense["mean"] is not None and \
            half["mean"] <= dense["mean"] + doc["options"]["margin"]
        verdict = ("holds" if t["p"] is not None and 0.5 < t["p"] <= 0.7 else
                   "mild pruning holds; threshold differs" if mild_ok else "does not hold")
        rows.append([claim, meas, verdict])
    return rows


def rows_grelu(doc: Optional[Dict]) -> List[List[str]]:
    c1 = "004 §6 / Table 2: GReLU trains to a lower loss than ReLU at the same learning rate"
    c2 = "004 §4.4: cached gates make a GReLU iteration ~2x shorter than its ReLU network's"
    if doc is None:
        return [[c1, "not run", "—"], [c2, "not run", "—"]]
    rows = []
    for cl in doc["claim"]:
        f = doc["final"][str(cl["lr"])] if str(cl["lr"]) in doc["final"] else list(doc["final"].values())[0]
        st = cl["steps_to_target"]
        meas = (f"lr {cl['lr']:.3g}: steps to {cl['target']:g} x the initial loss GReLU {_pm(st['GReLU'])} vs ReLU "
                f"{_pm(st['ReLU'])}; final loss GReLU {_pm(f['GReLU'])} vs ReLU {_pm(f['ReLU'])}; GReLU lower on "
                f"{cl['grelu_lower']}/{cl['both_finite']} seeds where both stayed finite "
                f"({cl['seeds'] - cl['both_finite']} with a diverged run; {_seeds(doc)})")
        rows.append([c1, meas, _verdict(cl["grelu_lower"], cl["seeds"])])
    t = doc["timing"]
    r_relu = t["grelu_cached"]["median_s"] / t["relu"]["median_s"]
    r_rec = t["grelu_cached"]["median_s"] / t["grelu_recomputed"]["median_s"]
    meas = (f"median time per iteration, cached GReLU / ReLU = {r_relu:.2f}, cached / recomputed gates = {r_rec:.2f} "
            f"(CPU, {doc['environment']['torch_threads']} thread(s); dense GEMMs with the gates applied after them "
            "skip no FLOPs)")
    rows.append([c2, meas, "holds" if r_relu <= 0.6 else "does not hold on CPU"])
    return rows


def rows_speed(doc: Optional[Dict], md: str = "results/speed.md") -> List[List[str]]:
    """Paper 003 Table 4 (ResIST's wall-clock speed-up) and paper 000 (LOFT's pre-training time),
    from the speed experiment's emulated-link runs: time to local SGD's target accuracy."""
    c003 = ("003 Table 4 (time): ResIST trains 3.58-3.81x faster than local SGD to the same accuracy "
            "(4 and 8 V100s, CIFAR-10/100, preact ResNet-101)")
    c000 = ("000 Table 1 (time): LOFT pre-training costs less than local SGD's (0.72 of its communication at "
            "S=2, 0.58 at S=4), measured here as time to local SGD's accuracy")
    if doc is None:
        return [[c003, "not run", "—"], [c000, "not run", "—"]]
    out = []
    for method, claim in (("resist", c003), ("loft", c000)):
        summ = [e for e in doc.get("summary", []) if e["method"] == method and e["workload"] == "cnn"
                and e["compress"] == "none"]
        out.append(_speed_row_seeds(doc, summ, claim, md) if summ else _speed_row_runs(doc, method, claim, md))
    return out


def _speed_verdict(hits: int, cells: int) -> str:
    return ("holds (speed-up >= 1.25x, smaller than the paper's)" if hits == cells
            else "mixed" if hits else "does not hold here")


def _speed_row_seeds(doc: Dict, summ: List[Dict], claim: str, md: str) -> List[str]:
    """The claim's row from the seeds' summary: per S, over the slowest link, the time to target (the link
    run's own seconds through the seeds' mean rounds, ``speed.seed_summary``), against local SGD's."""
    emulated = [e for e in summ if e["link"] != "loopback"]
    use = emulated or summ
    slow = min(use, key=lambda e: L.parse_rate(e["link"]) if e["link"] != "loopback" else float("inf"))["link"]
    cells = sorted((e for e in use if e["link"] == slow), key=lambda e: e["workers"])
    base = {e["workers"]: e for e in doc["summary"] if e["method"] == "localsgd" and e["workload"] == "cnn"
            and e["compress"] == "none" and e["link"] == slow}
    parts, hits = [], 0
    for e in cells:
        ratio, b = e["vs_localsgd"], base.get(e["workers"])
        if ratio is None:
            parts.append(f"S={e['workers']}: target not reached by every seed")
            continue
        hits += ratio <= 0.8
        parts.append(f"S={e['workers']}: {1 / ratio:.3f}x ({e['mean_rounds_to_target']:.3g} rounds"
                     + (f" vs {b['mean_rounds_to_target']:.3g}" if b and b["mean_rounds_to_target"] else "") + ")")
    where = (f"{L.parse_rate(slow) / 1e6:g} Mbit/s emulated link (tc tbf, network namespaces)" if emulated
             else "loopback (no emulated link on the machine that ran it)")
    model = next((r["model"] for r in doc["runs"] if r.get("workload") == "cnn"), "cnn")
    seeds = sorted({sd for e in cells for sd in e["seeds"]})
    meas = (f"speed-up in time to local SGD's target accuracy (digits, {model}, real processes over a {where}; "
            f"the link run's own seconds through the seeds' mean rounds to target, {len(seeds)} seed(s)): "
            + ", ".join(parts) + f"; {md}")
    return [claim, meas, _speed_verdict(hits, len(cells))]


def _speed_row_runs(doc: Dict, method: str, claim: str, md: str) -> List[str]:
    """The claim's row from the runs themselves (a speed.json without the seeds' summary)."""
    runs = [r for r in doc["runs"] if r["method"] == method and r.get("compress", "none") == "none"
            and r.get("workload", r.get("config", "cnn")) == "cnn"]  # the papers' claims are the CNN's
    em = [r for r in runs if r["emulated"]]
    use = em or runs
    if not use:
        return [claim, "not run", "—"]
    low = min((r["bandwidth_bps"] or float("inf")) for r in use)
    cells = [r for r in use if (r["bandwidth_bps"] or float("inf")) == low]
    parts = []
    hits = 0
    for r in sorted(cells, key=lambda r: (r["workers"], r["seed"])):
        ratio = r.get("time_vs_localsgd")
        if ratio is not None:
            hits += ratio <= 0.8
            parts.append(f"S={r['workers']}: {1 / ratio:.2f}x" if ratio else f"S={r['workers']}: —")
        else:
            parts.append(f"S={r['workers']}: target not reached")
    where = (f"{low / 1e6:g} Mbit/s emulated link (tc tbf, network namespaces)" if em
             else "loopback (no emulated link on the machine that ran it)")
    model = cells[0]["model"]
    scale = [r for r in doc.get("scale", []) if r["method"] == method and r["workers"] in (4, 8)
             and r["bandwidth_bps"] == 1e9 and r.get("speedup_vs_localsgd")
             and r.get("compress", "none") == "none"]
    model_note = ("; the cost model per round at 1 Gbit/s: " + ", ".join(
        f"S={r['workers']} {r['speedup_vs_localsgd']:.2f}x ({r['model']})" for r in scale)) if scale else ""
    meas = (f"speed-up in time to local SGD's target accuracy (digits, {model}, real processes over a {where}): "
            + ", ".join(parts) + f" ({len(doc['seeds'])} seed(s)){model_note}; {md}")
    return [claim, meas, _speed_verdict(hits, len(cells))]


#: the language model's bar (issue 27): the best subnetwork method's time to local SGD's target over the
#: slowest link, as a fraction of local SGD's
LM_BAR = 0.6


#: the language models of ``speed``: their model in words, newest (the main one) first, and where
#: their last run is kept
LM_WORKLOADS = (("lm12", "gpt_tiny, 12 blocks of width 64, on pycode", "speed_lm12"),
                ("lm", "gpt_tiny on pycode", ""))


def _speed_lm(folder: str) -> Tuple[Optional[Dict], str, str, str]:
    """(speed doc, workload, model in words, markdown path) of the main language model whose last run
    has a summary (lm12's in ``<folder>/speed_lm12/``, else speed.json's lm)."""
    for workload, model, sub in LM_WORKLOADS:
        doc = _load(os.path.join(folder, sub) if sub else folder, "speed")
        if doc is not None and any(e["workload"] == workload for e in doc.get("summary", [])):
            return doc, workload, model, f"results/{sub + '/' if sub else ''}speed.md"
    return None, "lm", LM_WORKLOADS[-1][1], "results/speed.md"


def rows_speed_lm(doc: Optional[Dict], workload: str = "lm", model: str = "gpt_tiny on pycode",
                  md: str = "results/speed.md") -> List[List[str]]:
    """Time to local SGD's bits per byte on the speed experiment's language model ``workload`` (its
    ``summary``: the seeds' rounds to target x each link's measured round time), over its slowest
    link, at its largest S: the best subnetwork method against local SGD."""
    claim = ("Subnetwork methods on a transformer (IST of FFN units / heads, papers 001-002; ResIST layers, paper 003; "
             "arXiv 2507.09029): reach local SGD's quality in less wall-clock time over a slow link")
    rows = [e for e in (doc or {}).get("summary", []) if e["workload"] == workload and e["compress"] == "none"]
    if not rows:
        return [[claim, "not run", "—"]]
    S = max(e["workers"] for e in rows)
    rows = [e for e in rows if e["workers"] == S]
    emulated = [e for e in rows if e["link"] != "loopback"]
    slow = min(emulated, key=lambda e: L.parse_rate(e["link"]))["link"] if emulated else "loopback"
    here = {e["method"]: e for e in rows if e["link"] == slow}
    base = here.get("localsgd")
    subs = {m: e for m, e in here.items() if m not in ("localsgd", "ddp", "diloco")}
    if base is None or not subs:
        return [[claim, "not run", "—"]]
    loop = [r for r in doc["runs"] if r["workload"] == workload and r["workers"] == S and r["link"] == "loopback"
            and r["compress"] == "none"]
    finals = [r["final_metric"] for r in loop if r["method"] == "localsgd"]
    others = {}
    for r in loop:
        if r["method"] != "localsgd":
            others.setdefault(r["method"], []).append(r["final_metric"])
    b = (doc.get("baselines") or {}).get("bigram_bits")

    def ratio(e):
        return "not reached" if e["vs_localsgd"] is None else f"{e['vs_localsgd']:.2f}x"

    reached = {m: e for m, e in subs.items() if e["vs_localsgd"] is not None}
    best = min(reached, key=lambda m: reached[m]["vs_localsgd"]) if reached else None
    seeds = sorted({sd for e in rows for sd in e["seeds"]})
    meas = (f"time to local SGD's final test bits per byte + the margin, over {slow}, S={S}, each method at its tuned lr "
            f"({model}, AdamW; {len(seeds)} seed(s)): local SGD "
            + ("not reached" if base["time_to_target_s"] is None else f"{base['time_to_target_s']:.0f} s")
            + "; " + ", ".join(f"{m} {ratio(e)}" for m, e in sorted(subs.items()))
            + (f"; local SGD's final {sum(finals) / len(finals):.3f} bits per byte" if finals else "")
            + (f" (a byte given the previous one: {b:.3f})" if b else "")
            + ("; the others' final: " + ", ".join(f"{m} {sum(v) / len(v):.3f}" for m, v in sorted(others.items()))
               if others else "") + f"; {md}")
    verdict = ("not reached by any subnetwork method" if best is None
               else f"holds ({best} {reached[best]['vs_localsgd']:.2f}x <= {LM_BAR:g}x)"
               if reached[best]["vs_localsgd"] <= LM_BAR
               else f"faster, not {LM_BAR:g}x ({best} {reached[best]['vs_localsgd']:.2f}x)"
               if reached[best]["vs_localsgd"] < 1 else "does not hold here")
    return [[claim, meas, verdict]]


def rows_paper003(doc: Optional[Dict]) -> List[List[str]]:
    """Paper 003 Table 4 against the cost model's prediction from FLOPs and bytes (paper003.json when
    the results folder has it, else computed: it takes seconds and trains nothing)."""
    claim = ("003 Table 4 (cost model): ResIST's 3.58-3.81x over local SGD follows from its shallower "
             "sub-ResNets and fewer bytes (4 and 8 V100s, CIFAR, preact ResNet-101)")
    if doc is None:
        try:
            doc = table4_prediction()
        except Exception as e:  # the table still renders
            return [[claim, f"not computed ({type(e).__name__}: {e})", "—"]]
    rows = doc["rows"]
    s = doc["setting"]

    def bw(v):
        return "none" if v is None else (f"{v / 1e9:.3g} Gbit/s" if v >= 1e9 else f"{v / 1e6:.3g} Mbit/s")

    pred = "; ".join(
        f"S={r['workers']} (ℓ={r['local_steps']}): {r['links']['nvlink']['speedup']:.2f}x over NVLink, "
        f"{r['links']['network']['speedup']:.2f}x over the instance's {r['links']['network']['bandwidth_bps'] / 1e9:g} "
        f"Gbit/s, paper {min(r['paper_speedup'].values()):.2f}-{max(r['paper_speedup'].values()):.2f}x" for r in rows)
    ratio = ", ".join(f"{r['flops_ratio']:.3f}" for r in rows)
    star = ", ".join(bw(r["implied_bandwidth_bps"]["star"]) for r in rows)
    paper_way = ", ".join(f"{bw(r['implied_bandwidth_bps']['reduce_broadcast'])} / "
                          f"{bw(r['implied_bandwidth_bps']['ring'])}" for r in rows)
    t4 = [r for r in rows if r["table4"].get("C10")]
    gap = "; ".join(
        f"Table 4 at S={r['workers']}: ResIST {r['table4']['C10']['resist_s']:.0f} s vs the model's compute "
        f"{r['table4']['C10']['model_compute_resist_s']:.0f} s, local SGD {r['table4']['C10']['localsgd_s']:.0f} s vs "
        f"{r['table4']['C10']['model_compute_localsgd_s']:.0f} s" for r in t4)
    meas = (f"predicted per round from the FLOPs (deepest sub-ResNet / full model {ratio}) and bytes at "
            f"{s['efficiency']:.0%} of a V100's {s['peak_tflops']:g} TFLOP/s: {pred}. The bandwidth at which the model "
            f"gives the paper's figure, local SGD averaging as the paper did (reduce + broadcast) / by ring all-reduce: "
            f"{paper_way} (none: no bandwidth does); through a parameter server's star: {star}. {gap}: the rest "
            "of the paper's speed-up is local SGD's time beyond compute and bytes "
            "(python -m ist_kernels.experiments paper003; docs/experiments.md)")
    lo = min(r["links"]["nvlink"]["speedup"] for r in rows)
    hi = max(r["links"]["network"]["speedup"] for r in rows)
    paper_lo = min(min(r["paper_speedup"].values()) for r in rows if r["paper_speedup"])
    verdict = ("holds" if lo >= 0.9 * paper_lo else
               f"not explained by FLOPs and bytes (model {lo:.2f}-{hi:.2f}x)")
    return [[claim, meas, verdict]]


def rows_transformer(doc: Optional[Dict]) -> List[List[str]]:
    """DiLoCo against synchronous training, and a transformer's subnetworks against local SGD and
    DiLoCo, from the transformer experiment (its largest S)."""
    cdil = ("DiLoCo (arXiv 2311.08105): H inner AdamW steps between outer Nesterov steps match synchronous "
            "training's quality while communicating H times less (500x at H=500)")
    csub = ("Subnetwork data parallelism (arXiv 2507.09029): a transformer trained as neuron- or block-level "
            "subnetworks matches its baselines at less cost per device")
    if doc is None or not doc.get("runs"):
        return [[cdil, "not run", "—"], [csub, "not run", "—"]]
    S = max(r["workers"] for r in doc["runs"])
    link = "loopback" if any(r["link"] == "loopback" for r in doc["runs"]) else doc["runs"][0]["link"]
    cmp = {c["at"]: c for c in doc["comparisons"] if c["workers"] == S and c["link"] == link}
    runs = [r for r in doc["runs"] if r["workers"] == S and r["link"] == link]
    w = doc["workload"]
    where = (f"{w['model']} on pycode, S={S}, {w['rounds']} rounds of {w['local_steps']} steps, "
             f"{len(doc['seeds'])} seed(s), {link}")

    def mean(v, key):
        xs = [r[key] for r in runs if r["variant"] == v]
        return sum(xs) / len(xs) if xs else None

    out = []
    end = cmp.get("end of the rounds", {}).get("bits_per_byte", {})
    if "diloco" in end and "ddp" in end and end["diloco"]["mean"] is not None and end["ddp"]["mean"] is not None:
        d, s = end["diloco"], end["ddp"]
        ratio = mean("ddp", "bytes_per_round") / mean("diloco", "bytes_per_round")
        meas = (f"final test bits per byte, DiLoCo (H={w['local_steps']}) {C.fmt(d, '.3f')} vs DDP "
                f"{C.fmt(s, '.3f')} after the same steps; DDP sends {ratio:.1f}x DiLoCo's bytes ({where}); "
                "results/transformer.md")
        verdict = ("holds at H=" + str(w["local_steps"]) if d["mean"] <= s["mean"] + max(s["std"] or 0.0, 0.01)
                   else "does not hold here")
        out.append([cdil, meas, verdict])
    else:
        out.append([cdil, "not run", "—"])
    subs = ("ist-ffn", "heads", "resist-layers")
    eb = cmp.get("equal bytes", {}).get("bits_per_byte", {})
    if all(v in eb and v in end for v in subs + ("localsgd",)):
        best = min(subs, key=lambda v: eb[v]["mean"])
        rest = [v for v in ("localsgd", "diloco") if v in eb]
        meas = ("test bits per byte at equal bytes (the smallest total any variant sent): "
                + ", ".join(f"{v} {C.fmt(eb[v], '.3f')}" for v in subs + tuple(rest))
                + "; at the end of the rounds: " + ", ".join(f"{v} {C.fmt(end[v], '.3f')}" for v in subs + tuple(rest))
                + "; bytes per round / local SGD's: " + ", ".join(
                    f"{v} {mean(v, 'bytes_per_round') / mean('localsgd', 'bytes_per_round'):.2f}" for v in subs)
                + f" ({where}); results/transformer.md")
        at_bytes = all(eb[best]["mean"] <= eb[v]["mean"] for v in rest)
        at_end = min(end[v]["mean"] for v in subs) <= end["localsgd"]["mean"] + max(end["localsgd"]["std"] or 0.0, 0.01)
        verdict = ("holds (best at equal bytes, matches local SGD after the same steps)" if at_bytes and at_end
                   else "mixed" if at_bytes or at_end else "does not hold here")
        out.append([csub, meas, verdict])
    else:
        out.append([csub, "not run", "—"])
    return out


# within this much of a paper's communication ratio counts as reproducing it
RATIO_TOL = 0.03


def rows_bytes(doc: Optional[Dict], method: str, model: str, claim: str) -> List[List[str]]:
    """Paper 000/003 Table 1: the method's bytes per round over local SGD's, from bench_bytes.py's rows."""
    rows = [r for r in (doc or {}).get("rows", []) if r["method"] == method and r["model"] == model]
    if not rows:
        return [[claim, "not run", "—"]]
    paper = [r for r in rows if r["paper_ratio"] is not None]
    close = sum(abs(r["ps_bytes_ratio"] - r["paper_ratio"]) <= RATIO_TOL for r in paper)
    meas = ("parameter-server bytes / local SGD's (the papers' convention), ours vs paper: "
            + ", ".join(f"S={r['S']} {r['ps_bytes_ratio']:.3f} vs {r['paper_ratio']:.3f}" for r in paper)
            + f"; this library's wire bytes (all-to-all + ring all-reduce) / local SGD's ring all-reduce: "
            f"{min(r['bytes_ratio'] for r in rows):.3f}-{max(r['bytes_ratio'] for r in rows):.3f} "
            f"for S={rows[0]['S']}..{rows[-1]['S']}; largest rank state / full model state "
            f"{min(r['rank_state_ratio'] for r in rows):.3f}-{max(r['rank_state_ratio'] for r in rows):.3f} "
            f"({model}, counted from the plans, {doc['rounds']} rounds averaged; bench/results/bytes.md)")
    below = all(r["bytes_ratio"] < 1 and r["ps_bytes_ratio"] < 1 for r in rows)
    return [[claim, meas, _verdict(close, len(paper)) if below else "does not hold"]]


#: where the digits workloads' last speed run is kept while speed.json holds only other workloads
SPEED_DIGITS = "speed_digits"


def _speed_with_cnn(folder: str) -> Tuple[Optional[Dict], str]:
    """(speed.json, its markdown's path) when it has the CNN workload's runs, else those of
    ``<folder>/speed_digits/`` (the digits workloads' last run, kept there while speed.json holds
    the language model's alone)."""
    doc = _load(folder, "speed")
    if doc is not None and any(r.get("workload", r.get("config", "cnn")) == "cnn" for r in doc.get("runs", [])):
        return doc, "results/speed.md"
    digits = _load(os.path.join(folder, SPEED_DIGITS), "speed")
    return (digits, f"results/{SPEED_DIGITS}/speed.md") if digits else (doc, "—")


def table(folder: str, bytes_path: Optional[str] = None) -> str:
    counts = None
    if bytes_path and os.path.isfile(bytes_path):
        with open(bytes_path) as f:
            counts = json.load(f)
    rows = (rows_loft(_load(folder, "loft"))
            + rows_bytes(counts, "LOFT", "preact_resnet18",
                         "000 Table 1: LOFT pre-training sends less than local SGD (0.72 of it at S=2, 0.58 at S=4)")
            + rows_masked(_load(folder, "masked"))
            + rows_pruning(_load(folder, "pruning"))
            + rows_bytes(counts, "ResIST", "preact_resnet101_basic",
                         "003 Table 1: a ResIST round sends less than local SGD's (0.686 of it at S=2, 0.543 at S=4, "
                         "0.487 at S=8); accuracy (Tables 2-9) is not reproduced here")
            + rows_grelu(_load(folder, "grelu"))
            + rows_speed(*_speed_with_cnn(folder))
            + rows_speed_lm(*_speed_lm(folder))
            + rows_paper003(_load(folder, "paper003"))
            + rows_transformer(_load(folder, "transformer")))
    lines = ["| paper: claim | our measurement (mean ± std over seeds) | verdict |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


def update_doc(path: str, text: str) -> None:
    """Replace what lies between the START and END lines of the markdown file ``path`` with ``text``."""
    with open(path) as f:
        src = f.read()
    if START not in src or END not in src or src.index(START) > src.index(END):
        raise ValueError(f"{path}: expected the lines {START} and {END} around the claims table")
    head, rest = src.split(START, 1)
    _, tail = rest.split(END, 1)
    with open(path, "w") as f:
        f.write(f"{head}{START}\n{text}\n{END}{tail}")


update_readme = update_doc  # the former name


def main(argv: Sequence[str] = ()) -> int:
    p = argparse.ArgumentParser(prog="python -m ist_kernels.experiments.claims", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default="results",
                   help="folder of the experiments' JSON files (default %(default)s)")
    p.add_argument("--bytes", default=os.path.join("bench", "results", "bytes.json"),
                   help="bench/bench_bytes.py's JSON, for papers 000 and 003's communication (default %(default)s)")
    p.add_argument("--doc", "--readme", dest="doc", nargs="?", const=DOC, default=None, metavar="FILE",
                   help="also replace the claims table (between its marker lines) in FILE "
                        "(default with no FILE: %(const)s; --readme is the former name)")
    args = p.parse_args(list(argv))
    if not os.path.isdir(args.results):
        p.error(f"--results {args.results!r} is not a folder")
    text = table(args.results, args.bytes)
    with open(os.path.join(args.results, "claims.md"), "w") as f:
        f.write("# The papers' claims and our measurements\n\n"
                "Generated by `python -m ist_kernels.experiments.claims` from the JSON files in this folder.\n\n"
                + text + "\n")
    if args.doc:
        update_doc(args.doc, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
