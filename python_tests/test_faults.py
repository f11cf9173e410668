"""Trainer fault injection (issue 10): ranks killed or stalled at chosen points, checkpoint writes
included; every checkpoint file corrupted in turn; crafted pickles; two runs on one folder; bad
configurations. Each fault must end the run with one line naming the rank, collective, file or
folder (status 1; 2 for bad configuration), and --resume afterwards must be exact.

Multi-process runs are started the way torchrun starts them (RANK, WORLD_SIZE, MASTER_ADDR, ... in
the environment, one ``fault_worker.py`` process per rank) so that each rank can freeze itself at a
fault point (SIGSTOP) and the test then SIGKILLs it, or leaves it stalled; the ``--workers 2``
launcher is killed from outside at a random round. Tiny MLP on digits, one thread per process, so
runs are bit-identical to the simulated reference.
"""
import collections
import functools
import io
import json
import os
import pickle
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
import torch

from ist_kernels.train import checkpoint, cli
from ist_kernels.train.output import LOCK_FILE

from conftest import free_port
from train_helpers import TINY_MLP, assert_equal_states, outputs, run as _run, untimed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "python_tests", "fault_worker.py")
LOCALSGD = [*TINY_MLP, "--method", "localsgd", "--checkpoint-interval", "1", "--device", "cpu"]  # gloo, also on a GPU machine
run = functools.partial(_run, base=LOCALSGD)
DEADLINE_S = 120  # no single launch of these tiny runs takes this long; a hang fails the test


def _env(**extra):
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, **extra)


def _state(pid):
    """The process's state letter (T: stopped), None once it has exited and been reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


def _error_line(err):
    """The single 'ist-train: error:' line of ``err``; fails on tracebacks or several lines."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err, err
    errors = [ln for ln in lines if ln.startswith("ist-train: error: ")]
    assert len(errors) == 1 and len(lines) == 1, err
    return errors[0]


def _cli(capsys, *args):
    """cli.main in this process: (status, stderr)."""
    capsys.readouterr()
    rc = cli.main([str(a) for a in args])
    return rc, capsys.readouterr().err


# ---------------------------------------------------------------- ranks killed and stalled (torchrun style)

def _start_ranks(out, specs, *args):
    port = free_port()
    argv = [*LOCALSGD, "--out-dir", str(out), *map(str, args)]
    sync = tempfile.mkdtemp(dir=os.path.dirname(out))
    return [subprocess.Popen([sys.executable, WORKER, spec, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=_env(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), FAULT_SYNC_DIR=sync,
                                                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
            for r, spec in enumerate(specs)]


def _wait_stopped(procs):
    """Index of the rank that froze itself at its fault point."""
    end = time.monotonic() + DEADLINE_S
    while time.monotonic() < end:
        for r, p in enumerate(procs):
            if _state(p.pid) == "T":
                return r
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.01)
    raise AssertionError("no rank reached its fault point")


def _finish(p, timeout=DEADLINE_S):
    try:
        _, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        _, err = p.communicate()
        raise AssertionError(f"rank did not end within {timeout} s: {err}")
    return p.returncode, err


def _fault(out, victim, spec, *args, kill=True):
    """One launch of 2 ranks; rank ``victim`` freezes at ``spec`` and is SIGKILLed (or left stalled
    while its peer times out). Returns the peer's (status, error line, seconds from the kill or the
    stall to the peer's end)."""
    specs = ["-", "-"]
    specs[victim] = spec
    procs = _start_ranks(out, specs, *args)
    try:
        assert _wait_stopped(procs) == victim
        t0 = time.monotonic()
        if kill:
            procs[victim].send_signal(signal.SIGKILL)
        rc, err = _finish(procs[1 - victim])
        took = time.monotonic() - t0
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    return rc, _error_line(err), took


# (victim rank, its fault point, what the peer's message names, latest checkpoint round after it);
# a checkpoint every round. "{step}" is a seeded random step of round 2.
CHAIN = [
    (1, "step:2:{step}", "all_reduce (local SGD, full model) (round 2)", 1),
    (0, "write-rank:3", "barrier (checkpoint round 3: every rank's file written) (round 3)", 2),
    (0, "write-latest:4", "barrier (checkpoint round 4: latest.json updated) (round 4)", 3),
    (0, "wrote-latest:5", "barrier (checkpoint round 5: latest.json updated) (round 5)", 5),
    (1, "cleanup:6", "all_reduce (local SGD, full model) (round 7)", 6),
]
ROUNDS = 8
STALL_TIMEOUT_S = 6


def test_killed_and_stalled_ranks_then_exact_resume(tmp_path, capsys):
    """A chain of launches on one folder, each ended by one fault, then a clean --resume: the final
    model and metrics equal an uninterrupted run bit for bit."""
    out = tmp_path / "run"
    ckpt = out / "checkpoints"
    step = random.Random(10).randrange(2)  # --local-steps 2
    for i, (victim, spec, names, latest) in enumerate(CHAIN):
        resume = ["--resume"] if i else []
        rc, line, took = _fault(out, victim, spec.format(step=step), "--rounds", ROUNDS, "--timeout-s", 60, *resume)
        assert rc == 1 and line.startswith(f"ist-train: error: rank {1 - victim}: {names} on rank {1 - victim} of 2 "
                                           f"failed"), (spec, line)
        assert took < 30, (spec, took)  # a dead peer is noticed at once, not at the 60 s timeout
        assert checkpoint.latest_round(str(ckpt)) == latest, spec

    # rank 1's file of the latest round is truncated: rank 1 names it, rank 0 names the collective
    # in which it misses rank 1; both end with status 1
    victim_file = ckpt / "round-000006-rank-1.pt"
    good = victim_file.read_bytes()
    victim_file.write_bytes(good[: len(good) // 2])
    procs = _start_ranks(out, ["-", "-"], "--rounds", ROUNDS, "--resume")
    (rc0, err0), (rc1, err1) = _finish(procs[0]), _finish(procs[1])
    assert rc1 == 1 and str(victim_file) in _error_line(err1), err1
    assert "cannot be read as a checkpoint: it is truncated or corrupt" in err1, err1
    assert rc0 == 1 and _error_line(err0).startswith("ist-train: error: rank 0: all_reduce"), err0
    victim_file.write_bytes(good)

    # rank 1 stalls (stopped, alive): rank 0 gives up at the timeout, naming the collective
    rc, line, took = _fault(out, 1, "step:7:0", "--rounds", ROUNDS, "--timeout-s", STALL_TIMEOUT_S, "--resume",
                            kill=False)
    assert rc == 1 and line.startswith("ist-train: error: rank 0: all_reduce (local SGD, full model) (round 7) "
                                       "on rank 0 of 2 ") and "timed out" in line, line
    # it waited the whole timeout, by its own clock from issuing the all_reduce (printed to 0.1 s):
    # the test's clock starts when it sees rank 1 stopped, which a busy machine can delay past the
    # moment rank 0 entered the all_reduce (the ranks do not meet between the rendezvous and round 7)
    assert float(re.search(r" after ([0-9.]+) s \(timeout ", line).group(1)) >= STALL_TIMEOUT_S - 0.05, line
    assert took < STALL_TIMEOUT_S + 10, took  # and then ended
    assert checkpoint.latest_round(str(ckpt)) == 6

    procs = _start_ranks(out, ["-", "-"], "--rounds", ROUNDS, "--resume")
    assert [_finish(p)[0] for p in procs] == [0, 0]
    _, model, hist = outputs(out)
    _, ref_model, ref_hist = run(tmp_path / "reference", "--simulate", 2, "--rounds", ROUNDS)
    assert_equal_states(ref_model, model)
    assert untimed(hist) == untimed(ref_hist)
    # the crashes' leftovers (older rounds, half-written temporary files) are gone
    assert sorted(os.listdir(ckpt)) == ["latest.json", "round-000008-rank-0.pt", "round-000008-rank-1.pt"]


def test_spawned_worker_killed_then_exact_resume(tmp_path, capsys):
    """--workers 2: a worker SIGKILLed from outside at a random round (mid-round or mid-checkpoint,
    as it falls); the launcher names it and ends with status 1; --resume continues exactly."""
    rng = random.Random(11)
    kill_after, victim = rng.randrange(2, 5), rng.randrange(2)
    out = tmp_path / "run"
    args = [*LOCALSGD, "--out-dir", out, "--workers", 2, "--rounds", 10 ** 6]
    p = subprocess.Popen([sys.executable, "-m", "ist_kernels.train", *map(str, args)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=_env())
    try:
        metrics, end = out / "metrics.jsonl", time.monotonic() + DEADLINE_S
        while not (metrics.exists() and len(metrics.read_text().splitlines()) > kill_after):
            assert p.poll() is None and time.monotonic() < end, p.communicate()
            time.sleep(0.01)
        with open(f"/proc/{p.pid}/task/{p.pid}/children") as f:
            kids = [int(c) for c in f.read().split()]
        workers = sorted(k for k in kids if b"spawn_main" in open(f"/proc/{k}/cmdline", "rb").read())
        assert len(workers) == 2, kids
        os.kill(workers[victim], signal.SIGKILL)
        t0 = time.monotonic()
        rc, err = _finish(p)
        took = time.monotonic() - t0
    finally:
        p.kill()
        p.communicate()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 1 and all(ln.startswith("ist-train: error: ") for ln in lines), err  # no traceback, no warnings
    assert f"worker process {victim} (rank {victim}, pid {workers[victim]}) was killed by SIGKILL" in lines[-1], err
    assert took < 30, took
    latest = checkpoint.latest_round(str(out / "checkpoints"))
    assert latest >= kill_after - 1
    stop = latest + 2
    _, model, hist = run(out, "--workers", 2, "--rounds", 10 ** 6, "--resume", "--stop-after", stop)
    _, ref_model, ref_hist = run(tmp_path / "reference", "--simulate", 2, "--rounds", 10 ** 6, "--stop-after", stop)
    assert_equal_states(ref_model, model)
    assert untimed(hist) == untimed(ref_hist) and hist[-1]["round"] == stop


# ---------------------------------------------------------------- corrupt checkpoint files

class _Payload:
    """Unpickling it would run a shell command that creates ``marker``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _torch_bytes(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _corruptions(good, marker, name):
    """kind of damage -> the damaged bytes of checkpoint file ``name`` (``good``: its bytes)."""
    third = len(good) // 3
    out = {"truncated": good[: len(good) // 2], "empty": b"", "random bytes": np.random.default_rng(5).bytes(len(good)),
           "one flipped byte": good[:third] + bytes([good[third] ^ 0xFF]) + good[third + 1:]}
    if name == "latest.json":
        out.update({"not JSON": b'{"round": 2,', "wrong JSON": b"[1, 2]",
                    "wrong fields": json.dumps({"round": "two", "world_size": 1}).encode()})
        return out
    path = os.path.join(os.path.dirname(marker), "good.pt")
    with open(path, "wb") as f:
        f.write(good)
    payload = checkpoint.read_sealed(path)
    sealed = lambda p: _torch_bytes(checkpoint.seal(p))  # noqa: E731  well-formed files, wrong contents
    out.update({"JSON": b'{"round": 2}', "a flipped byte in the tensor data": _flip_tensor_byte(good),
                "crafted pickle": _torch_bytes({"method": _Payload(marker)}),
                "crafted raw pickle": pickle.dumps(_Payload(marker), protocol=2),
                "crafted pickle, sealed": sealed({"method": _Payload(marker)}),
                "unsealed payload (older format)": _torch_bytes(payload),
                "not a checkpoint": sealed({"weights": torch.ones(3)}),
                "another round's file": sealed(dict(payload, round=payload["round"] + 1)),
                "state of another model": sealed(dict(payload, method={"models": {}, "optimizers": {}}))})
    return out


def _flip_tensor_byte(good):
    """One byte of the sealed payload flipped: a zip that torch.load reads without complaint."""
    i = len(good) // 2
    bad = good[:i] + bytes([good[i] ^ 0x01]) + good[i + 1:]
    torch.load(io.BytesIO(bad), weights_only=True)  # the zip layer does not notice
    return bad


CORRUPT_RUN = ["--simulate", 2, "--rounds", 3]


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory):
    """A run stopped after round 2 (its checkpoint folder: latest.json, round-000002-rank-0.pt)."""
    out = tmp_path_factory.mktemp("corrupt") / "base"
    run(out, *CORRUPT_RUN, "--stop-after", 2)
    return out


FILES = ["latest.json", "round-000002-rank-0.pt"]


def test_each_checkpoint_file_corrupted_in_turn(checkpointed, tmp_path, capsys):
    marker = tmp_path / "payload-ran"
    found = []
    for name in FILES:
        good = (checkpointed / "checkpoints" / name).read_bytes()
        for kind, bad in _corruptions(good, marker, name).items():
            out = tmp_path / f"{name}-{kind.replace(' ', '-')}"
            shutil.copytree(checkpointed, out)
            path = out / "checkpoints" / name
            path.write_bytes(bad)
            rc, err = _cli(capsys, *LOCALSGD, "--out-dir", out, *CORRUPT_RUN, "--resume")
            line = _error_line(err)
            assert rc == 1 and repr(str(path)) in line, (name, kind, err)
            found.append((name, kind, line))
            print("FOUND", name, kind, "->", line, file=sys.__stderr__)
    assert not marker.exists()  # no crafted pickle ran
    assert len(found) == 7 + 13
    kinds = {k: ln for n, k, ln in found}
    for crafted in ("crafted pickle", "crafted raw pickle", "crafted pickle, sealed"):
        assert "refused to unpickle" in kinds[crafted] and "posix.system" in kinds[crafted], kinds[crafted]
    assert "do not match the SHA-256" in kinds["a flipped byte in the tensor data"]
    assert "expected round 2 of rank 0" in kinds["another round's file"]
    assert "does not fit this run" in kinds["state of another model"]
    # the untouched checkpoint still resumes
    shutil.copytree(checkpointed, tmp_path / "intact")
    summary, _, _ = run(tmp_path / "intact", *CORRUPT_RUN, "--resume")
    assert summary["finished"]


def test_missing_rank_file_named(checkpointed, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(checkpointed, out)
    os.remove(out / "checkpoints" / "round-000002-rank-0.pt")
    rc, err = _cli(capsys, *LOCALSGD, "--out-dir", out, *CORRUPT_RUN, "--resume")
    assert rc == 1 and "round-000002-rank-0.pt' is missing" in _error_line(err), err


def test_rng_states_round_trip_through_weights_only_load(tmp_path, global_rngs):
    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    np.random.standard_normal()  # a cached gaussian in numpy's state
    random.gauss(0, 1)
    path = tmp_path / "rng.pt"
    torch.save(checkpoint.rng_state(), path)
    draw = lambda: (random.random(), random.gauss(0, 1), np.random.standard_normal(3).tolist(),  # noqa: E731
                    torch.rand(3).tolist())
    first = draw()
    checkpoint.set_rng_state(torch.load(path, weights_only=True))
    assert draw() == first


@pytest.mark.parametrize("method", ["ddp", "grelu"])  # the other methods: test_train_mlp / test_train_cnn
def test_resume_exact_for_methods_not_resumed_elsewhere(method, tmp_path):
    args = ["--method", method, "--simulate", 2, "--rounds", 3]
    _, full_model, full_hist = run(tmp_path / "full", *args)
    run(tmp_path / "run", *args, "--stop-after", 1)
    _, model, hist = run(tmp_path / "run", *args, "--resume")
    assert_equal_states(full_model, model)
    assert untimed(hist) == untimed(full_hist)


# ---------------------------------------------------------------- crafted CIFAR batches

def _cifar_folder(folder, names, label_key, n=2):
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        d = {b"batch_label": b"x", label_key: [1] * n, b"data": np.zeros((n, 3072), np.uint8)}
        (folder / name).write_bytes(pickle.dumps(d, protocol=2))


CIFAR10 = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]


def test_crafted_cifar_batch_refused(tmp_path, capsys):
    folder = tmp_path / "c10"
    _cifar_folder(folder, CIFAR10, b"labels")
    marker = tmp_path / "payload-ran"
    (folder / "data_batch_2").write_bytes(pickle.dumps({b"labels": [1], b"data": _Payload(marker)}))
    rc, err = _cli(capsys, *LOCALSGD, "--out-dir", tmp_path / "out", "--simulate", 2, "--rounds", 1,
                   "--dataset", "cifar10", "--data-path", folder, "--batch-size", 1)
    line = _error_line(err)
    assert rc == 2 and repr(str(folder / "data_batch_2")) in line and "posix.system" in line, err
    assert not marker.exists()


def test_cifar_reader_accepts_the_format_only(tmp_path):
    from ist_kernels.train.config import ConfigError
    from ist_kernels.train.datasets import read_cifar_pickle

    data = np.arange(2 * 3072, dtype=np.int64).astype(np.uint8).reshape(2, 3072)
    d = {b"batch_label": b"b", b"labels": [3, 4], b"data": data, b"filenames": [b"a.png", b"b.png"]}
    path = tmp_path / "data_batch_1"
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        blob = pickle.dumps(d, protocol=protocol)
        variants = [blob]
        if protocol == 2:  # as numpy 1.x (and the published files) name the reconstructor
            variants.append(blob.replace(b"numpy._core.multiarray", b"numpy.core.multiarray"))
        for b in variants:
            path.write_bytes(b)
            got = read_cifar_pickle(str(path))
            assert np.array_equal(got[b"data"], data) and got[b"labels"] == [3, 4]
    for bad in (pickle.dumps({b"data": np.array([1, "x"], dtype=object)}, protocol=2),
                pickle.dumps(d, protocol=2)[:100], pickle.dumps(collections.OrderedDict(a=1)), b""):
        path.write_bytes(bad)
        with pytest.raises(ConfigError, match="data_batch_1"):
            read_cifar_pickle(str(path))
    # a file of the standard file's size must have the published md5
    std = tmp_path / "test"
    with open(std, "wb") as f:
        f.truncate(31049707)
    with pytest.raises(ConfigError, match="md5 .* not the published f0ef6b0ae62326f3e7ffdfab6717acfc"):
        read_cifar_pickle(str(std))


# ---------------------------------------------------------------- two runs, one folder

def test_two_runs_on_one_folder(tmp_path, capsys):
    out = tmp_path / "run"
    args = [*LOCALSGD, "--out-dir", out, "--simulate", 2, "--rounds", 3]
    first = subprocess.Popen([sys.executable, WORKER, "step:2:0", *map(str, args)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=_env())
    try:
        assert _wait_stopped([first]) == 0  # frozen in round 2, the folder locked, round 1 checkpointed
        for extra in ([], ["--resume"], ["--overwrite"]):
            rc, err = _cli(capsys, *args, *extra)
            line = _error_line(err)
            assert rc == 1 and f"{str(out)!r} is in use by another ist-train run (pid {first.pid} on host " \
                f"{socket.gethostname()}" in line, line
    finally:
        first.kill()
        first.communicate()
    rc, err = _cli(capsys, *args)
    assert rc == 2 and "'out_dir'" in err and f"{str(out)!r} is not empty" in _error_line(err)
    rc, err = _cli(capsys, *args, "--resume", "--overwrite")
    assert rc == 2 and "'overwrite'" in _error_line(err)
    # --resume continues the killed run exactly
    _, model, hist = run(out, "--simulate", 2, "--rounds", 3, "--resume")
    _, ref_model, ref_hist = run(tmp_path / "reference", "--simulate", 2, "--rounds", 3)
    assert_equal_states(ref_model, model)
    assert untimed(hist) == untimed(ref_hist)
    # --overwrite starts afresh: the earlier outputs go, other files stay
    (out / "notes.txt").write_text("mine")
    summary, _, hist = run(out, "--simulate", 2, "--rounds", 1, "--overwrite")
    assert summary["rounds"] == 1 and [r["round"] for r in hist] == [0, 1]
    assert sorted(os.listdir(out)) == sorted([LOCK_FILE, "checkpoints", "metrics.jsonl", "model.pt", "notes.txt",
                                              "summary.json", "summary.md"])
    assert sorted(os.listdir(out / "checkpoints")) == ["latest.json", "round-000001-rank-0.pt"]


# ---------------------------------------------------------------- bad configuration

BAD = [(["--timeout-s", "inf"], "'timeout_s'"), (["--timeout-s", "nan"], "'timeout_s'"),
       (["--timeout-s", "0"], "'timeout_s'"), (["--timeout-s", "-1"], "'timeout_s'"),
       (["--timeout-s", "1e9"], "'timeout_s'"), (["--timeout-s", "soon"], "'timeout_s'"),
       (["--resume", "--overwrite"], "'overwrite'")]


@pytest.mark.parametrize("args,option", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_configuration_status_2(tmp_path, capsys, args, option):
    rc, err = _cli(capsys, *LOCALSGD, "--out-dir", tmp_path / "out", "--simulate", 2, *args)
    assert rc == 2 and option in _error_line(err)
    assert not (tmp_path / "out").exists()
