"""ist-train's launcher and command line (issue 11 item 6): ``--workers S`` through torch's elastic
launcher, restarts (torchrun's and ``--max-restarts``) that continue from the latest checkpoint by
themselves, and a --help grouped by topic with defaults and choices.

The restart runs crash on purpose (IST_TEST_FAIL_AT_ROUND: the last rank of attempt n exits before
round k_n + 1): attempt 0 before any checkpoint (the restart starts again at round 0, replacing its
outputs), attempt 1 after one (the restart resumes there). Their final model and metrics must equal
an uninterrupted run's bit for bit (tiny MLP on digits, one thread per process, gloo)."""
import dataclasses
import functools
import os
import re
import subprocess
import sys

import pytest

from ist_kernels.train import cli
from ist_kernels.train.config import CHOICES, GROUPS, ConfigError, TrainConfig
from ist_kernels.train.runs import after_restart

from train_helpers import TINY_MLP, assert_equal_states, outputs, run as _run, untimed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCALSGD = [*TINY_MLP, "--method", "localsgd", "--device", "cpu", "--rounds", "4", "--checkpoint-interval", "2"]
run = functools.partial(_run, base=LOCALSGD)
CRASHES = "1,3"  # attempt 0 dies before round 2 (no checkpoint yet), attempt 1 before round 4 (checkpoint at 2)
DEADLINE_S = 300


def _env(**extra):
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, **extra)


def _launch(cmd, out):
    p = subprocess.run([*cmd, *LOCALSGD, "--out-dir", str(out)], capture_output=True, text=True,
                       env=_env(IST_TEST_FAIL_AT_ROUND=CRASHES), timeout=DEADLINE_S)
    return p.returncode, p.stderr


def _check_restarts(rc, err, out, tmp_path):
    assert rc == 0, err
    restarts = [ln for ln in err.splitlines() if ln.startswith("ist-train: restart")]
    assert restarts == ["ist-train: restart 1: continuing from localsgd: round 0 (no checkpoint)",
                        "ist-train: restart 2: continuing from localsgd: round 2"], err
    summary, model, hist = outputs(out)
    ref_summary, ref_model, ref_hist = run(tmp_path / "reference", "--simulate", 2)
    assert summary["finished"] and summary["rounds"] == 4
    assert_equal_states(ref_model, model)
    assert untimed(hist) == untimed(ref_hist)


def test_workers_max_restarts_resume(tmp_path):
    """ist-train --workers 2 --max-restarts 2: the elastic agent restarts the workers twice."""
    out = tmp_path / "run"
    rc, err = _launch([sys.executable, "-m", "ist_kernels.train", "--workers", "2", "--max-restarts", "2"], out)
    _check_restarts(rc, err, out, tmp_path)


def test_torchrun_max_restarts_resume(tmp_path):
    """torchrun --max-restarts 2: rank 0 recognises the folder its job claimed and resumes (or
    starts again) without --resume; the other rank takes its decision."""
    out = tmp_path / "run"
    rc, err = _launch([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                       "--max-restarts", "2", "-m", "ist_kernels.train"], out)
    _check_restarts(rc, err, out, tmp_path)


def test_restart_never_takes_a_folder_its_job_did_not_claim(tmp_path, monkeypatch):
    """A restarted rank 0 whose job never claimed the folder (its first attempt stopped at the
    folder check) neither resumes nor replaces what is there."""
    out = tmp_path / "run"
    run(out, "--workers", 1)  # an earlier, finished run with a checkpoint
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    runs = after_restart([TrainConfig(out_dir=str(out))], str(out))
    assert not runs[0].resume and not runs[0].overwrite
    with pytest.raises(ConfigError, match="is not empty"):
        cli._validate_and_run([*LOCALSGD, "--out-dir", str(out)])


@pytest.mark.parametrize("args, message", [
    (["--max-restarts", "-1"], "must be >= 0"),
    (["--max-restarts", "1", "--simulate", "2"], "no worker processes"),
    (["--max-restarts", "1", "--workers", "1"], "no worker processes"),
])
def test_max_restarts_validated(tmp_path, capsys, args, message):
    rc = cli.main([*LOCALSGD, "--out-dir", str(tmp_path / "x"), *args])
    err = capsys.readouterr().err
    assert rc == 2 and "invalid option 'max_restarts'" in err and message in err, err


def _help_sections(text):
    """{section title: [flags]} of argparse's --help output."""
    sections, current = {}, None
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            current = sections.setdefault(line[:-1], [])
        elif current is not None:
            current += re.findall(r"^\s{2}(--[a-z-]+)", line)
    return sections


def test_help_groups_defaults_and_choices(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    sections = _help_sections(text)
    fields = [f.name for f in dataclasses.fields(TrainConfig)]
    grouped = [n for names in GROUPS.values() for n in names]
    assert sorted(grouped) == sorted(fields)  # every option in exactly one group
    for title in ("data", "model", "method", "training", "distributed", "output"):
        assert title in sections, sorted(sections)
    for title, names in GROUPS.items():
        flags = ["--option" if n == "options" else "--" + n.replace("_", "-") for n in names]
        assert sections[title] == flags, (title, sections[title])
    flat = " ".join(text.split())  # argparse wraps the help text
    assert "--lr LR base learning rate (default: 0.05 for sgd, 0.001 for adamw and for diloco)" in flat
    assert "(default: localsgd)" in flat and "(default: decentralized)" in flat and "(default: on)" in flat
    for name, choices in CHOICES.items():
        assert f"--{name.replace('_', '-')} {{{','.join(choices)}}}" in flat, name
    assert re.search(r"--method \{[a-z,]*localsgd[a-z,]*\}", flat) and re.search(r"--dataset \{[a-z_0-9,]*digits", flat)
