"""The round engine's contract: where a round's time goes, the warning for partitions that cannot
pay off, the rules methods follow (no raw config, no ist_kernels.distributed, no other method), and
an import graph of the package without circles."""
import ast
import os
import subprocess
import sys
import time
import warnings

import pytest
import torch

from ist_kernels.train import cli
from ist_kernels.train.phases import Phase, Phases
from ist_kernels.train.rounds import PartitionPayoffWarning, payoff
from ist_kernels.train.timing import PARTS, TRAIN_PARTS, Clock

from train_helpers import TINY_MLP, outputs

PKG = os.path.join(os.path.dirname(__file__), "..", "ist_kernels")
TINY_CNN = ["--dataset", "digits", "--batch-size", "8", "--local-steps", "2", "--no-progress", "--no-plots",
            "--threads", "1", "--device", "cpu"]


# ------------------------------------------------------------------------------------------ phases

class _Eng:  # a round engine that records what it was asked
    def __init__(self, name, log):
        self.name, self.log = name, log

    def begin(self, r, phase=None):
        self.log.append((self.name, "begin", r, phase))
        return []

    def end(self, r, losses):
        self.log.append((self.name, "end", r))
        return r


class _Ctx:
    rounds = 6

    def __init__(self):
        self.clock = Clock()


def test_phases_start_each_engine_once_at_its_first_round_and_tag_its_rounds():
    log, started = [], []

    def start(name):
        def make(r):
            started.append((name, r))
            return _Eng(name, log)
        return make

    ph = Phases(_Ctx(), [Phase(2, start("a")), Phase(0, start("skipped")), Phase(None, start("b"))])
    assert [ph.index(r) for r in range(6)] == [0, 0, 2, 2, 2, 2]
    for r in range(6):
        ph.begin(r)
        assert ph.end(r, []) == r
    assert started == [("a", 0), ("b", 2)]  # the empty phase never starts; its index stays for the tags
    assert [e for e in log if e[1] == "begin"] == [("a", "begin", 0, 0), ("a", "begin", 1, 0)] + \
        [("b", "begin", r, 2) for r in range(2, 6)]
    with pytest.raises(RuntimeError, match="round 3 was not begun"):
        ph.end(3, [])
    with pytest.raises(ValueError, match="round 6 is past"):
        ph.index(6)
    one = Phases(_Ctx(), [Phase(None, start("c"))])  # one phase: no tag
    one.begin(0)
    assert log[-1] == ("c", "begin", 0, None)
    resumed = Phases(_Ctx(), [Phase(2, start("a2")), Phase(None, start("b2"))])
    eng = _Eng("restored", log)
    resumed.resume(4, eng)  # a checkpoint's engine: the transition does not run again
    resumed.begin(4)
    assert log[-1] == ("restored", "begin", 4, 1) and ("b2", 4) not in started and resumed.current is eng


# ------------------------------------------------------------------------------------------ clock

def test_clock_parts_do_not_overlap():
    c = Clock()
    with c("local"):
        time.sleep(0.02)
        with c("comm"):
            time.sleep(0.03)
        c.add("pack", 0.01)  # measured elsewhere inside the local block: local gives it up
    parts = c.take()
    assert set(parts) == set(PARTS)
    assert 0.03 <= parts["comm"] < 0.045
    assert 0.005 <= parts["local"] < 0.02  # 0.02 slept, less the 0.01 charged to pack
    assert parts["pack"] == 0.01
    assert sum(c.take().values()) == 0.0  # take resets
    with pytest.raises(ValueError, match="unknown part"):
        with c("lunch"):
            pass


def test_clock_add_inside_the_same_part_is_not_counted_twice():
    c = Clock()
    with c("plan"):
        time.sleep(0.01)
        c.add("plan", 5.0)  # the open block already covers it
    assert c.take()["plan"] < 1.0


# ---------------------------------------------------------------------------- time in the metrics

def _check_times(hist, summary):
    trained = [r for r in hist if r["round"] > 0]
    for rec in hist:
        t = rec["time"]
        assert set(t) == set(PARTS) | {"other", "round"}
        assert all(t[k] >= -1e-3 for k in PARTS), t
        # the parts add up to the round's wall time: what none measured is within 5% (or 10 ms: scheduling)
        assert abs(t["other"]) <= max(0.05 * t["round"], 0.01), t
    assert all(r["time"]["local"] > 0 for r in trained)
    tot = summary["time_by_part"]
    assert set(tot) == set(PARTS) | {"other"}
    for k in PARTS:
        assert tot[k] == pytest.approx(sum(r["time"][k] for r in hist))
    assert abs(tot["other"]) <= max(0.05 * sum(r["time"]["round"] for r in hist), 0.01 * len(hist))
    assert summary["setup_time"] > 0
    return trained


@pytest.mark.parametrize("launch", [["--simulate", "2"], ["--workers", "2"]])
def test_every_round_says_where_its_time_goes(tmp_path, launch):
    cli.main([*TINY_CNN, "--model", "preact_resnet18", "--width", "4", "--method", "loft", "--rounds", "4",
              "--eval-interval", "2", "--out-dir", str(tmp_path), *launch])
    summary, _, hist = outputs(tmp_path)
    trained = _check_times(hist, summary)
    assert all(r["time"]["eval"] > 0 for r in hist if "accuracy" in r)
    pre = [r for r in trained if r["phase"] == 0]
    assert all(r["time"]["unpack"] > 0 for r in pre) and sum(r["time"]["plan"] for r in pre) > 0
    if "--workers" in launch:
        assert all(r["time"]["comm"] > 0 for r in trained)  # real collectives
        # where comm went: LOFT's pre-training exchanges slices and averages the shared tensors;
        # the named collectives sum to comm
        names = set().union(*(r["collectives"] for r in pre))
        assert {"all_to_all_single (partitioned slices)", "all_reduce (shared tensors)"} <= names, names
        for r in trained:
            assert sum(r["collectives"].values()) == pytest.approx(r["time"]["comm"], abs=1e-5)
    else:
        assert all(r["collectives"] == {} for r in trained)
    # the phases' mean round time, from round 2 on, of the training parts
    want = sum(sum(r["time"][k] for k in TRAIN_PARTS) for r in pre if r["round"] >= 2)
    assert summary["round_time_by_phase"]["pretrain"] == pytest.approx(
        want / sum(1 for r in pre if r["round"] >= 2))
    with open(tmp_path / "summary.md") as f:
        assert "time by part (s)" in f.read()


def test_time_of_a_subnetwork_mlp_run(tmp_path):
    cli.main([*TINY_MLP, "--method", "masked", "--simulate", "2", "--rounds", "3", "--out-dir", str(tmp_path)])
    summary, _, hist = outputs(tmp_path)
    trained = _check_times(hist, summary)
    assert all(r["time"]["pack"] > 0 and r["time"]["unpack"] > 0 for r in trained)


# ------------------------------------------------------------------------- partitions that cannot pay off

def test_payoff_model():
    # nothing partitioned: local SGD's bytes; everything partitioned, S = 2: a quarter of them
    assert payoff({"shared_state_bytes": 10, "partitioned_state_bytes": 0}, 2) == (0.0, 1.0)
    frac, ratio = payoff({"shared_state_bytes": 0, "partitioned_state_bytes": 8}, 2)
    assert frac == 1.0 and ratio == pytest.approx(0.25)
    assert payoff({"shared_state_bytes": 3, "partitioned_state_bytes": 1}, 1) == (0.0, 1.0)


def test_resist_on_resnet18_warns_that_it_cannot_pay_off(tmp_path):
    args = [*TINY_CNN, "--model", "preact_resnet18", "--width", "4", "--method", "resist", "--simulate", "4",
            "--rounds", "2", "--eval-interval", "0"]
    with pytest.warns(PartitionPayoffWarning, match=r"holds \d+\.\d% of the model's state.*S=4.*cannot pay off"):
        assert cli.main([*args, "--out-dir", str(tmp_path / "a")]) == 0


def test_loft_on_resnet34_does_not_warn(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", PartitionPayoffWarning)
        assert cli.main([*TINY_CNN, "--model", "preact_resnet34", "--width", "4", "--method", "loft",
                         "--simulate", "2", "--rounds", "1", "--eval-interval", "0",
                         "--out-dir", str(tmp_path)]) == 0


# ------------------------------------------------------------------------------- the method contract

def _imports(tree, module):
    """(absolute module name, names) of every import in ``tree`` of ``module`` (dotted)."""
    pkg = module.rsplit(".", 1)[0] if not module.endswith("__init__") else module
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[:len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            out.append((name, [a.name for a in node.names]))
    return out


def test_methods_follow_the_contract():
    from ist_kernels.train.methods import METHODS

    folder = os.path.join(PKG, "train", "methods")
    method_modules = {f"ist_kernels.train.methods.{m}" for m in METHODS.values()}
    files = sorted(f for f in os.listdir(folder) if f.endswith(".py") and f != "__init__.py")
    assert {f"ist_kernels.train.methods.{f[:-3]}" for f in files} >= method_modules
    for f in files:
        module = f"ist_kernels.train.methods.{f[:-3]}"
        with open(os.path.join(folder, f)) as fh:
            tree = ast.parse(fh.read())
        for name, names in _imports(tree, module):
            assert not name.startswith("ist_kernels.distributed"), f"{f} imports {name}"
            assert name not in ("ist_kernels.train.config", "ist_kernels.train.runner"), f"{f} imports {name}"
            others = {name} | {f"{name}.{n}" for n in names}
            assert not (others & (method_modules - {module})), f"{f} imports another method: {others}"
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                assert node.attr not in ("cfg", "_cfg"), f"{f}:{node.lineno} reads the raw config"
            if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Attribute):
                assert node.target.attr not in ("gather_bytes", "sent", "gathered"), \
                    f"{f}:{node.lineno} changes a shared counter"


def test_hyper_parameters_are_read_only():
    from ist_kernels.train.config import HyperParams, TrainConfig

    hp = HyperParams(TrainConfig(options={"xi": 0.5}, lr_milestones=[1, 2]))
    assert hp.lr_milestones == (1, 2) and hp.options["xi"] == 0.5 and hp.num_workers == 2
    with pytest.raises(AttributeError, match="read-only"):
        hp.lr = 1.0
    with pytest.raises(TypeError):
        hp.options["xi"] = 1.0
    with pytest.raises(AttributeError, match="no hyper-parameter 'nope'"):
        hp.nope  # noqa: B018


# ------------------------------------------------------------------------------------ import graph

def _graph():
    """module -> [(imported package module, inside a function)] over every .py of ist_kernels."""
    mods = {}
    for root, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                rel = os.path.relpath(path, os.path.join(PKG, ".."))[:-3].replace(os.sep, ".")
                mods[rel[:-9] if rel.endswith(".__init__") else rel] = path
    graph = {}
    for mod, path in mods.items():
        with open(path) as fh:
            tree = ast.parse(fh.read())
        inner = {id(n) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                 for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))}
        edges = []
        is_pkg = path.endswith("__init__.py")
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = mod.split(".")[:len(mod.split(".")) - node.level + (1 if is_pkg else 0)]
                    name = ".".join(base + ([node.module] if node.module else []))
                else:
                    name = node.module
                targets = [f"{name}.{a.name}" if f"{name}.{a.name}" in mods else name for a in node.names]
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != mod and t.startswith("ist_kernels"):
                    edges.append((t, id(node) in inner))
        graph[mod] = edges
    return graph


def test_no_import_circles_and_few_function_level_imports():
    graph = _graph()
    top = {m: {t for t, _ in edges} for m, edges in graph.items()}
    # a package's __init__ importing its own submodules is how packages work, not a circle
    state, stack, circles = {}, [], []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in top.get(m, ()):
            if t.startswith(m + "."):
                continue
            if state.get(t) == 1:
                circles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(top):
        if m not in state:
            visit(m)
    assert not circles, circles
    inside = sorted((m, t) for m, edges in graph.items() for t, fn in edges if fn)
    assert len(inside) <= 10, inside


def test_engine_keeps_the_compact_module_between_rounds(tmp_path):
    """Decentralized LOFT over 2 processes equals the simulated run although the rank refills one
    compact module (and clears one optimizer) every round instead of building new ones."""
    base = [*TINY_CNN, "--model", "preact_resnet18", "--width", "4", "--method", "loft", "--rounds", "3",
            "--eval-interval", "0", "--option", "pretrain_fraction=1", "--shared", "exact"]
    cli.main([*base, "--simulate", "2", "--out-dir", str(tmp_path / "sim")])
    cli.main([*base, "--workers", "2", "--out-dir", str(tmp_path / "dist")])
    _, sim, sim_hist = outputs(tmp_path / "sim")
    _, dist, dist_hist = outputs(tmp_path / "dist")
    for k in sim:
        assert torch.equal(sim[k], dist[k]), k
    assert [r["bytes_sent"] for r in sim_hist] == [r["bytes_sent"] for r in dist_hist]


# --------------------------------------------------------------------------- the busiest worker and DDP

def _busiest(tmp_path, method, launch, *extra):
    out = tmp_path / f"{method}{launch[0]}"
    assert cli.main([*TINY_MLP, "--method", method, *launch, "--rounds", "3", "--eval-interval", "0",
                     "--out-dir", str(out), *extra]) == 0
    return [r for r in outputs(out)[2] if r["round"] > 0]


def test_busiest_worker_bytes_both_ways_and_in_both_launch_modes(tmp_path):
    # masked: random masks give unequal slices, so a worker may receive more than it sends; its
    # link carries max(sent, received) of each collective. Every byte sent is received, so the
    # busiest link carries at least the mean, and never more than all bytes.
    sim = _busiest(tmp_path, "masked", ["--simulate", "3"])
    dist = _busiest(tmp_path, "masked", ["--workers", "3"])
    for r in sim:
        assert r["bytes_sent"] / 3 <= r["max_worker_bytes_sent"] <= r["max_worker_link_bytes"] <= r["bytes_sent"]
    keys = ("bytes_sent", "max_worker_bytes_sent", "max_worker_link_bytes")
    assert [[r[k] for k in keys] for r in sim] == [[r[k] for k in keys] for r in dist]
    # local SGD's ring all-reduce loads every link alike, in both directions
    for r in _busiest(tmp_path, "localsgd", ["--simulate", "3"]):
        assert r["max_worker_link_bytes"] == r["max_worker_bytes_sent"] == r["bytes_sent"] // 3


def test_ddp_charges_the_gradient_all_reduces_its_backward_pass_did_not_hide(tmp_path):
    out = tmp_path / "ddp"
    assert cli.main([*TINY_MLP, "--method", "ddp", "--workers", "2", "--rounds", "3", "--eval-interval", "0",
                     "--out-dir", str(out)]) == 0
    summary, _, hist = outputs(out)
    trained = _check_times(hist, summary)
    for r in trained:
        assert set(r["collectives"]) == {"all_reduce (gradient buckets)"}, r["collectives"]
        assert r["collectives"]["all_reduce (gradient buckets)"] == pytest.approx(r["time"]["comm"], abs=1e-5)
        assert 0 < r["time"]["comm"] < r["time"]["round"]


@pytest.mark.parametrize("method", ["ist", "ddp", "localsgd"])
def test_peer_wait_is_the_time_rank_0_waited_for_a_slower_rank(tmp_path, monkeypatch, method):
    # rank 1 starts every round 0.3 s late: rank 0 enters its first collective (DDP: its first
    # step's gradient all-reduce) that much earlier and waits for it, inside its comm time
    monkeypatch.setenv("IST_TEST_DELAY_RANK", "1:0.3")
    delayed = _busiest(tmp_path, method, ["--workers", "2"])
    for r in delayed:
        assert 0.25 <= r["peer_wait_s"] <= r["time"]["comm"] + 1e-3, (r["peer_wait_s"], r["time"])
    # the delay on rank 0 instead: rank 0 is the last to arrive, the others wait, it does not
    monkeypatch.setenv("IST_TEST_DELAY_RANK", "0:0.3")
    for r in _busiest(tmp_path / "rank0", method, ["--workers", "2"]):
        assert 0 <= r["peer_wait_s"] < 0.25, r["peer_wait_s"]
    # simulated workers never wait for each other: no such field
    monkeypatch.delenv("IST_TEST_DELAY_RANK")
    assert all("peer_wait_s" not in r for r in _busiest(tmp_path / "sim", method, ["--simulate", "2"]))


def test_rank0_wait_is_each_collectives_late_entry_at_most_its_own_time_there():
    import torch

    from ist_kernels.train.runner import rank0_wait

    entered = torch.tensor([[10.0, 20.0, 30.0, 40.0],   # rank 0
                            [10.5, 20.2, 29.0, 40.0],   # rank 1
                            [10.2, 20.3, 29.5, 39.0]], dtype=torch.float64)
    # waits 0.5, 0.3 (capped at 0.01: done before the late rank came), 0 (rank 0 was last), 0
    assert rank0_wait(entered, torch.tensor([0.6, 0.01, 0.2, 0.0], dtype=torch.float64)) == pytest.approx(0.51)
    assert rank0_wait(entered, torch.tensor([1.0, 1.0, 1.0, 1.0], dtype=torch.float64)) == pytest.approx(0.8)
    assert rank0_wait(torch.zeros(2, 0, dtype=torch.float64), torch.zeros(0, dtype=torch.float64)) == 0.0


def test_machine_id_is_exact_in_a_float64_and_the_same_for_every_process_here():
    from ist_kernels.train import runner

    mid = runner._machine_id()
    assert 0 <= mid < 2 ** 48 and float(mid) == mid
    out = subprocess.run([sys.executable, "-c", "from ist_kernels.train import runner; print(runner._machine_id())"],
                         capture_output=True, text=True, check=True)
    assert int(out.stdout) == mid
