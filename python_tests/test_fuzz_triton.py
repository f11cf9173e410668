"""tools/fuzz_triton.py, a few examples (issue 19 item 7): random shapes, layouts, gate words and
index lists (strided views with out-of-range junk, mistakes) through the Triton launchers, each in
a child process whose death is reported. The long run: ``python tools/fuzz_triton.py --examples 2000``."""
import os
import subprocess
import sys

from conftest import requires_triton

TOOL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "fuzz_triton.py")


@requires_triton
def test_fuzz_triton_a_few_examples():
    n = 12
    seed = int.from_bytes(os.urandom(3), "little")
    proc = subprocess.run([sys.executable, TOOL, "--examples", str(n), "--seed", str(seed), "--batch", str(n)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"{n}/{n} examples behaved" in proc.stdout


def test_a_crash_is_pinned_to_its_example(monkeypatch):
    """A child that dies is noticed, and the example it was running is named."""
    sys.path.insert(0, os.path.dirname(TOOL))
    import fuzz_triton

    calls = []

    def run(seeds, timeout):  # the child "dies" on seed 3 (without finishing it)
        calls.append(list(seeds))
        done = {}
        for s in seeds:
            if s == 3:
                return done, -11, "Segmentation fault"
            done[s] = ""
        return done, 0, ""

    monkeypatch.setattr(fuzz_triton, "_run", run)
    results = fuzz_triton.fuzz(6, 0, 10, 60)
    assert sorted(results) == list(range(6))
    assert "exit status -11" in results[3] and all(results[s] == "" for s in (0, 1, 2, 4, 5))
    assert calls == [list(range(6)), [3], [4, 5]]
