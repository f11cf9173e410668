"""One ist-train process with a fault point (the fault tests start it as a script).

``python fault_worker.py SPEC ist-train-args...`` runs ``ist_kernels.train.cli.main(args)`` in this
process and exits with its status. SPEC (``-`` for none) names one point at which this process
stops itself (SIGSTOP), frozen exactly there, for the test to SIGKILL it or to leave it stalled:

- ``step:R:I``: before local step I of round R (1-based rounds, as metrics.jsonl counts them);
- ``write-rank:R``: while writing this rank's round-R checkpoint: the temporary file holds half of it;
- ``wrote-rank:R``: this rank's round-R file is in place, before the barrier;
- ``write-latest:R`` / ``wrote-latest:R``: the same for latest.json of round R (rank 0 writes it);
- ``cleanup:R``: after round R's checkpoint, before this rank removes its older files.

The rank is ``RANK`` (torchrun's environment; 0 without it). The points wrap the trainer's own
functions in this process only; nothing in the package knows about them. With ``FAULT_SYNC_DIR``
set, the ranks wait for each other after their imports, so that a short ``--timeout-s`` bounds the
collectives, not the start-up skew of a busy machine.
"""
import os
import signal
import sys


def _stop():
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGSTOP)


def install(spec: str) -> None:
    from ist_kernels.train import checkpoint, runner

    kind, *nums = spec.split(":")
    R = int(nums[0])
    rank = int(os.environ.get("RANK", "0"))
    mine = f"round-{R:06d}-rank-{rank}.pt"
    last = {"name": None}  # the last checkpoint file this process wrote (latest.json follows its round)

    if kind == "step":
        I = int(nums[1])
        batch = runner.RunContext.batch

        def stop_at_step(self, worker, r, i):
            if (r + 1, i) == (R, I):
                _stop()
            return batch(self, worker, r, i)

        runner.RunContext.batch = stop_at_step
        return

    atomic_write = checkpoint._atomic_write

    def targeted(name):
        if kind.endswith("-rank"):
            return name == mine
        return name == checkpoint.LATEST and last["name"] == mine

    def write_with_fault(path, write):
        name = os.path.basename(path)
        if kind.startswith("write-") and targeted(name):
            def half(f):  # a crash in the middle of the write: half the bytes in the temporary file
                write(f)
                f.flush()
                f.truncate(f.tell() // 2)
                f.flush()
                _stop()
            atomic_write(path, half)
        else:
            atomic_write(path, write)
        if kind.startswith("wrote-") and targeted(name):
            _stop()
        if name.endswith(".pt"):
            last["name"] = name

    checkpoint._atomic_write = write_with_fault
    if kind == "cleanup":
        import types

        real_os = checkpoint.os

        def unlink(path):
            if last["name"] == mine:
                last["name"] = None
                _stop()
            real_os.unlink(path)

        names = {k: getattr(real_os, k) for k in dir(real_os) if not k.startswith("__")}
        checkpoint.os = types.SimpleNamespace(**dict(names, unlink=unlink))  # this module's os only


def _wait_for_peers(folder: str) -> None:
    import time

    open(os.path.join(folder, os.environ["RANK"]), "w").close()
    end = time.monotonic() + 120
    while len(os.listdir(folder)) < int(os.environ["WORLD_SIZE"]) and time.monotonic() < end:
        time.sleep(0.01)


if __name__ == "__main__":
    if sys.argv[1] != "-":
        install(sys.argv[1])
    from ist_kernels.train import cli

    if os.environ.get("FAULT_SYNC_DIR"):
        _wait_for_peers(os.environ["FAULT_SYNC_DIR"])
    sys.exit(cli.main(sys.argv[2:]))
