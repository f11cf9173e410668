"""What a new user trips on (issue 26 item 6): tools/setup.sh rebuilds the extension only when
something it is built from changed (tools/needs_build.py), the trainer prints a table that fits a
terminal (the full one in summary.md), and the plots show the metric against training seconds and
megabytes."""
import importlib.metadata
import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from ist_kernels.train import cli
from ist_kernels.train.output import plot_figures, summary_table, terminal_table, train_seconds
from ist_kernels.train.timing import TRAIN_PARTS

from train_helpers import TINY_MLP

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NEEDS_BUILD = os.path.join(ROOT, "tools", "needs_build.py")


# ---------------------------------------------------------------- rebuild only when needed

def _needs_build(*args):
    """(rebuild?, what it printed) from tools/needs_build.py."""
    p = subprocess.run([sys.executable, NEEDS_BUILD, *map(str, args)], capture_output=True, text=True, timeout=120)
    assert p.returncode in (0, 3), p.stdout + p.stderr
    return p.returncode == 3, p.stdout.strip()


@pytest.fixture
def tree(tmp_path):
    """A copy of what the build reads: csrc/, setup.py, pyproject.toml."""
    shutil.copytree(os.path.join(ROOT, "csrc"), tmp_path / "csrc")
    for f in ("setup.py", "pyproject.toml"):
        shutil.copy(os.path.join(ROOT, f), tmp_path / f)
    return tmp_path


def test_needs_build_decides_from_the_inputs(tree):
    stamp = tree / ".build_stamp"
    check = ("--root", tree, "--no-import-check")
    needed, why = _needs_build(*check)
    assert needed and "no record of a previous build" in why, why
    assert _needs_build(*check, "--write") == (False, "")  # what setup.sh does after a successful build
    assert stamp.is_file()
    for _ in range(2):  # the second setup.sh in a row builds nothing, nor does the third
        assert _needs_build(*check) == (False, "ist_kernels._C: up to date")

    # a checkout's new mtimes alone are no change; an edited source is
    src = sorted((tree / "csrc").rglob("*.cpp"))[0]
    os.utime(src, (1, 1))
    assert not _needs_build(*check)[0]
    original = src.read_bytes()
    src.write_bytes(original + b"\n// edited\n")
    needed, why = _needs_build(*check)
    assert needed and src.relative_to(tree).as_posix() in why, why
    src.write_bytes(original)
    assert not _needs_build(*check)[0]

    # a new source file, setup.py or pyproject.toml changed
    (tree / "csrc" / "cpu" / "new_kernel.cpp").write_text("// new\n")
    needed, why = _needs_build(*check)
    assert needed and "csrc/cpu/new_kernel.cpp" in why, why
    (tree / "csrc" / "cpu" / "new_kernel.cpp").unlink()
    for f in ("setup.py", "pyproject.toml"):
        text = (tree / f).read_text()
        (tree / f).write_text(text + "\n# edited\n")
        needed, why = _needs_build(*check)
        assert needed and f in why, why
        (tree / f).write_text(text)
    assert not _needs_build(*check)[0]

    # another torch installed since the last build; a stamp that is not one
    recorded = json.loads(stamp.read_text())
    stamp.write_text(json.dumps({**recorded, "torch": "2.0.0+cu118"}))
    needed, why = _needs_build(*check)
    assert needed and "torch" in why, why
    stamp.write_text("not json")
    assert _needs_build(*check)[0]


def test_needs_build_checks_that_the_extension_imports(tree, tmp_path):
    """With the import check (what setup.sh runs): a tree that is not this Python's editable install
    of ist_kernels, or whose ``_C`` does not import, is rebuilt whatever its stamp says."""
    _needs_build("--root", tree, "--write")
    needed, why = _needs_build("--root", tree)
    assert needed and "not an editable install" in why, why


def _editable_install_of_root():
    try:
        url = json.loads(importlib.metadata.distribution("ist_kernels").read_text("direct_url.json") or "{}")
    except importlib.metadata.PackageNotFoundError:
        return False
    return bool(url.get("dir_info", {}).get("editable")) and url.get("url", "").rstrip("/") == "file://" + \
        os.path.realpath(ROOT)


def test_setup_twice_in_a_row_does_not_rebuild(tmp_path):
    """This repository as installed: right after a build (the stamp written as setup.sh writes it),
    the decision setup.sh takes, import check included, is "up to date"; setup.sh asks it before
    building and records the stamp after building."""
    with open(os.path.join(ROOT, "tools", "setup.sh")) as f:
        setup = f.read()
    ask = setup.index('"$PY" tools/needs_build.py; then')
    build = setup.index("pip install -q --no-build-isolation --no-deps -e .")
    record = setup.index('"$PY" tools/needs_build.py --write')
    assert ask < build < record, setup
    assert '"${IST_REBUILD:-0}" = "1"' in setup  # rebuilding every time is opt-in
    if not _editable_install_of_root():
        pytest.skip("ist_kernels is not an editable install of this tree (tools/setup.sh makes one)")
    if os.path.isfile(os.path.join(ROOT, ".build_stamp")):  # setup.sh ran here (always, in CI)
        needed, why = _needs_build()
        assert not needed, f"the next tools/setup.sh would rebuild: {why}"
        return
    assert not os.environ.get("CI"), "tools/setup.sh left no .build_stamp"
    stamp = tmp_path / "stamp"  # as setup.sh would have written it after its build
    _needs_build("--stamp", stamp, "--write")
    assert _needs_build("--stamp", stamp) == (False, "ist_kernels._C: up to date")


# ---------------------------------------------------------------- the terminal table

def _summary(method, acc, train_time, bytes_per_round, phases, compress="none", **extra):
    return {"method": method, "model": "preact_resnet34", "dataset": "digits", "workers": 2, "mode": "distributed",
            "compress": compress, "rounds": 20, "accuracy": acc, "test_loss": 0.0394, "train_time": train_time,
            "total_bytes": 20 * bytes_per_round + 24.6e6, "bytes_per_round": bytes_per_round,
            "total_ps_bytes": 20 * 2.6e6, "ps_bytes_per_round": 52.5e6, "rank_state_bytes": 26.2e6,
            "full_state_bytes": 42.6e6, "params": 3.28e6, "param_bytes": 13.1e6, "params_full": 5.33e6,
            "bytes_by_phase": {"pretrain": 172e6, "finetune": 271e6, "gather": 24.6e6},
            "time_by_part": {"local": 8.68, "plan": 0.20, "pack": 0.13, "comm": 1.30, "unpack": 0.08, "eval": 1.31,
                             "metrics": 0.14, "checkpoint": 0.57, "other": 0.01},
            "round_time_by_phase": phases, **extra}


def test_terminal_table_fits_120_columns():
    """The demo's comparison (LOFT, compressed LOFT, local SGD; two phases each): every line of what
    the terminal gets fits 120 columns, with the columns a person reads; summary.md's table is over
    three times as wide."""
    runs = [_summary("loft", 0.9861, 10.4, 22.2e6, {"pretrain": 0.533, "finetune": 0.494}),
            _summary("loft", 0.9833, 11.9, 5.6e6, {"pretrain": 0.561, "finetune": 0.512}, compress="int8"),
            _summary("localsgd", 0.9833, 17.6, 34.5e6, {"pretrain": 0.790, "finetune": 0.972})]
    table = terminal_table(runs)
    lines = table.splitlines()
    assert max(map(len, lines)) <= 120, "\n" + table
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head == ["method", "accuracy", "train time (s)", "s / round", "MB / round", "bytes / local SGD",
                    "time / local SGD"]
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:5]]
    assert rows[0] == ["loft", "98.61%", "10.4", "0.533 / 0.494", "22.2", "0.643", "0.59"]
    assert rows[1][0] == "loft (int8)" and rows[1][4] == "5.6"
    assert rows[2][-2:] == ["1.000", "1.00"]
    assert lines[5] == "s / round by phase: pretrain / finetune"
    assert max(map(len, summary_table(runs).splitlines())) > 3 * 120
    # a language model: bits per byte instead of accuracy; one run, no ratios
    lm = terminal_table([_summary("ist", 0.41, 3.0, 1.5e5, {"all": 0.1}, bits_per_byte=2.345)])
    assert lm.splitlines()[0].split("|")[2].strip() == "bits / byte" and "| 2.345 " in lm and "0.15" in lm, lm
    assert "local SGD" not in lm and len(lm.splitlines()) == 3


def test_the_trainer_prints_the_short_table_and_writes_the_full_one(tmp_path, capsys):
    """A 2-round comparison through ist-train: the printed table fits 120 columns, summary.md holds
    the full table; the plots have three panels."""
    argv = [*TINY_MLP, "--method", "ist", "--simulate", "2", "--rounds", "2", "--baseline", "--plots",
            "--device", "cpu", "--out-dir", str(tmp_path)]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    table = [ln for ln in printed.splitlines() if ln.startswith("|")]
    assert len(table) == 4 and "| ist " in printed and "| localsgd " in printed, printed
    assert max(len(ln) for ln in table) <= 120, printed
    assert "bytes / local SGD" in table[0] and "summary.md (the full table)" in printed
    full = (tmp_path / "summary.md").read_text()
    assert "time by part (s)" in full and "ps bytes / round" in full and "rank state" in full
    import matplotlib.image

    for f in ("accuracy.png", "loss.png"):
        height, width = matplotlib.image.imread(tmp_path / f).shape[:2]
        assert width > 3 * height, (f, width, height)  # three panels side by side


# ---------------------------------------------------------------- the plots

def _history(per_round_local, eval_every=2, lm=False):
    hist = [{"round": 0, "total_bytes": 0, "train_time": 0.0, "train_loss": None, "accuracy": 0.1, "test_loss": 2.3,
             "time": {**dict.fromkeys(TRAIN_PARTS, 0.0), "eval": 0.5, "metrics": 0.0, "checkpoint": 0.0}}]
    for r in range(1, 5):
        t = {"local": per_round_local, "plan": 0.01, "pack": 0.02, "comm": 0.03, "unpack": 0.04,
             "eval": 7.0, "metrics": 5.0, "checkpoint": 3.0, "other": 1.0}  # only the first five count
        rec = {"round": r, "total_bytes": r * 2_000_000, "train_time": 0.0, "train_loss": 1.0 / r, "time": t}
        if r % eval_every == 0:
            rec.update(accuracy=0.1 + 0.2 * r, test_loss=1.0 / r)
            if lm:
                rec["bits_per_byte"] = rec["test_loss"] / math.log(2)
        hist.append(rec)
    return hist


def test_plots_have_a_training_seconds_panel_and_megabytes():
    import matplotlib.pyplot as plt

    runs = {"ist S=2": _history(0.5), "localsgd S=2": _history(0.9)}
    assert train_seconds(runs["ist S=2"]) == pytest.approx([0.0, 0.6, 1.2, 1.8, 2.4])
    figures = plot_figures(runs)
    try:
        assert [name for name, _ in figures] == ["accuracy.png", "loss.png"]
        for name, fig in figures:
            axes = fig.get_axes()
            assert [ax.get_xlabel() for ax in axes] == [
                "round", "MB sent (all workers)", "training time (s): local, plan, pack, comm, unpack"], name
        acc = figures[0][1].get_axes()
        # accuracy at rounds 0, 2, 4: x in MB (0, 4, 8) and in training seconds (eval, metrics,
        # checkpoint and other left out)
        by_label = {ln.get_label(): ln for ln in acc[1].get_lines()}
        assert list(by_label["ist S=2"].get_xdata()) == pytest.approx([0, 4, 8])
        seconds = {ln.get_label(): list(ln.get_xdata()) for ln in acc[2].get_lines()}
        assert seconds["ist S=2"] == pytest.approx([0.0, 1.2, 2.4])
        assert seconds["localsgd S=2"] == pytest.approx([0.0, 2.0, 4.0])
        assert list(by_label["ist S=2"].get_ydata()) == pytest.approx([0.1, 0.5, 0.9])
    finally:
        for _, fig in figures:
            plt.close(fig)
    # language models: the losses in bits per byte
    figures = plot_figures({"ist S=2": _history(0.5, lm=True)})
    try:
        loss = dict(figures)["loss.png"].get_axes()[2]
        assert loss.get_ylabel() == "bits per byte"
        test = next(ln for ln in loss.get_lines() if ln.get_label() == "ist S=2")
        assert list(test.get_ydata()) == pytest.approx([2.3 / math.log(2), 0.5 / math.log(2), 0.25 / math.log(2)])
    finally:
        for _, fig in figures:
            plt.close(fig)
