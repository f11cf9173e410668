"""Fuzz the Triton entry points (issue 19, item 7): random shapes, dtypes, memory layouts, gate
words and index lists -- strided views with out-of-range junk between the entries, columns of 2-D
tensors, views at an offset, empty lists, and mistakes (out of range, negative, int32, 2-D,
repeated) -- through the Triton launchers ``ist_kernels.ops.subnet._triton`` and
``ist_kernels.ops.grelu._triton``, each result against the float64 references of
python_tests/reference.py.

    python tools/fuzz_triton.py --examples 2000            # CPU: TRITON_INTERPRET=1 is set for you
    python tools/fuzz_triton.py --examples 50 --seed 7     # replays: example i draws from seed + i

Examples run in child processes, ``--batch`` per child; a child that dies (a segfault, an abort)
or hangs is noticed by its exit status, and the first example it left unfinished is run again
alone, so the crash is pinned to one example (printed with its seed). Exit status 0 when every
example behaved: a valid call matched the reference within its rounding-error bound, a bad one
raised the documented exception type naming the argument, and no input tensor was changed.
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRIES = ("subnet_linear", "subnet_linear_backward", "relu_gates", "gated_linear", "gated_linear_backward")


# ------------------------------------------------------------------------------------ the child
def _child_setup():
    sys.path[:0] = [ROOT, os.path.join(ROOT, "python_tests")]
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before ist_kernels defines its kernels
    import ist_kernels  # noqa: F401


def _draw(seed):
    """One example: (entry name, args, expected exception type or None, argument a mistake names)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def pick(options, weights=None):
        w = torch.tensor(weights if weights else [1.0] * len(options), dtype=torch.float64)
        return options[int(torch.multinomial(w, 1, generator=g))]

    def randint(lo, hi):  # inclusive
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    def layout(x):
        """x (contiguous) re-laid out, same values: offset, every-other-element, transposed copy."""
        kind = pick(["contiguous", "offset", "strided", "transposed"])
        if kind == "offset":
            buf = torch.empty(x.numel() + 3, dtype=x.dtype, device=x.device)
            v = buf[3:].view(x.shape)
            v.copy_(x)
            return v
        if kind == "strided" and x.dim() >= 1:
            buf = torch.empty(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype, device=x.device)
            v = buf[..., ::2]
            v.copy_(x)
            return v
        if kind == "transposed" and x.dim() == 2:
            return x.t().contiguous().t()
        return x

    def index_list(values, size, name):
        """values (unique, in range) as a random layout; or, sometimes, a mistake."""
        kind = pick(["contiguous", "strided", "column", "offset", "mistake"], [2, 3, 2, 2, 1])
        t = torch.tensor(values, dtype=torch.int64)
        if kind == "strided":
            buf = torch.full((2 * len(values) + 1,), pick([2**40, -2**40, size, 0]), dtype=torch.int64)
            buf[1::2] = t
            t = buf[1::2]
        elif kind == "column":
            buf = torch.full((len(values), 3), pick([2**40, 0]), dtype=torch.int64)
            buf[:, 1] = t
            t = buf[:, 1]
        elif kind == "offset":
            buf = torch.full((len(values) + 9,), 2**40, dtype=torch.int64)
            buf[4:4 + len(values)] = t
            t = buf[4:4 + len(values)]
        if kind != "mistake":
            return t.to(device), None
        mistake = pick(["range", "negative", "int32", "2-D", "repeat"])
        if mistake in ("range", "negative", "repeat") and not values:
            values = [0]
        bad = list(values)
        if mistake == "range":
            bad[randint(0, len(bad) - 1)] = size + randint(0, 2**40)
        elif mistake == "negative":
            bad[randint(0, len(bad) - 1)] = -randint(1, 2**40)
        elif mistake == "repeat":
            bad.append(bad[randint(0, len(bad) - 1)])
        t = torch.tensor(bad, dtype=torch.int64)
        if mistake == "int32":
            t = t.to(torch.int32)
        elif mistake == "2-D":
            t = t[None]
        kind_of = {"range": IndexError, "negative": IndexError, "int32": TypeError, "2-D": ValueError,
                   "repeat": ValueError}[mistake]
        return t.to(device), (kind_of, name, len(bad))

    def randn(*shape, dtype):
        return layout(torch.randn(*shape, generator=g, dtype=torch.float64).to(device, dtype))

    entry = pick(list(ENTRIES))
    dtype = pick([torch.float32, torch.float16, torch.float64], [3, 2, 1])
    lead = pick([(), (randint(0, 9),), (randint(0, 4), randint(1, 5))], [1, 4, 2])
    N, K = randint(0, 40), randint(0, 40)
    if entry.startswith("subnet"):
        mistakes = []
        rows = cols = None
        nr, nc = N, K
        if randint(0, 3):
            nr = randint(0, N)
            rows, m = index_list(torch.randperm(N, generator=g)[:nr].tolist(), N, "rows")
            mistakes.append(m)
            nr = rows.shape[-1]
        if randint(0, 3):
            nc = randint(0, K)
            cols, m = index_list(torch.randperm(K, generator=g)[:nc].tolist(), K, "cols")
            mistakes.append(m)
            nc = cols.shape[-1]
        w = randn(N, K, dtype=dtype)
        x = randn(*lead, nc, dtype=dtype)
        expect = next((m for m in mistakes if m is not None), None)
        if entry == "subnet_linear":
            b = randn(N, dtype=dtype) if randint(0, 1) else None
            args = [x, w, b, rows, cols]
        else:
            gout = randn(*lead, nr, dtype=dtype)
            args = [gout, x, w, rows, cols, [bool(randint(0, 1)) for _ in range(3)]]
        if expect is not None and sum(m is not None for m in mistakes) > 1:
            expect = (expect[0], "rows|cols", None)  # either may be named first
        return entry, args, expect
    x = randn(*lead, K, dtype=dtype)
    w = randn(N, K, dtype=dtype)
    words = torch.randint(-2**31, 2**31, (*lead, (N + 31) // 32), generator=g, dtype=torch.int64)
    gates = layout(words.to(torch.int32).to(device))
    if entry == "relu_gates":
        return entry, [x, w, randn(N, dtype=dtype) if randint(0, 1) else None], None
    if entry == "gated_linear":
        return entry, [x, w, randn(N, dtype=dtype) if randint(0, 1) else None, gates], None
    return entry, [randn(*lead, N, dtype=dtype), x, w, gates, [bool(randint(0, 1)) for _ in range(3)]], None


def _bound(mag, y_ref, dtype, terms):
    """Rounding-error bound of a sum of ``terms`` products accumulated in fp32 (fp64 for fp64) and
    rounded to ``dtype``: (terms + 2) u_acc |terms| + u_out |y|, plus a tiny floor."""
    import torch

    u_acc = 2.0**-53 if dtype == torch.float64 else 2.0**-24
    u_out = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.float16: 2.0**-11}[dtype]
    return (terms + 2) * u_acc * mag + 2 * u_out * y_ref.abs() + 1e-30


def _close(name, got, want, bound):
    import torch

    if tuple(got.shape) != tuple(want.shape):
        return f"{name}: shape {list(got.shape)}, expected {list(want.shape)}"
    if got.numel() == 0:
        return ""
    err = (got.double() - want).abs()
    if got.dtype == torch.float16:  # fp16 overflow of the result: compare where it is finite
        err = torch.where(want.abs() < 6.0e4, err, torch.zeros_like(err))
    worst = (err - bound).max()
    if not bool(worst <= 0):
        i = int((err - bound).flatten().argmax())
        return f"{name}: error {float(err.flatten()[i]):.3g} over the bound {float(bound.flatten()[i]):.3g}"
    return ""


def _check(entry, args, result):
    """'' when ``result`` matches the float64 reference within the rounding-error bound."""
    import torch

    import reference as ref

    if entry == "subnet_linear":
        x, w, b, rows, cols = args
        want = ref.subnet_linear(x, w, b, rows, cols)
        mag = ref.subnet_linear(x.abs(), w.abs(), None if b is None else b.abs(), rows, cols)
        return _close("y", result, want, _bound(mag, want, x.dtype, x.shape[-1]))
    if entry == "subnet_linear_backward":
        gout, x, w, rows, cols, mask = args
        want = ref.subnet_linear_backward(gout, x, w, rows, cols)
        mags = ref.subnet_linear_backward(gout.abs(), x.abs(), w.abs(), rows, cols)
        terms = (gout.shape[-1], x.shape[:-1].numel(), x.shape[:-1].numel())
        for name, on, got, e, m, n in zip(("grad_x", "grad_weight", "grad_bias"), mask, result, want, mags, terms):
            problem = _close(name, got, e, _bound(m, e, x.dtype, n)) if on else (
                "" if got.numel() == 0 else f"{name}: not asked for, but not empty")
            if problem:
                return problem
        return ""
    if entry in ("relu_gates", "gated_linear"):
        x, w, b = args[:3]
        z = ref._linear64(x, w, b)
        bound = _bound(ref.linear_magnitude(x, w, b), z, x.dtype, x.shape[-1])
        if entry == "gated_linear":
            on = ref.unpack_gates(args[3], w.shape[0]).double()
            return _close("y", result, z * on, bound * on)
        out, gates = result
        problem = _close("out", out, torch.relu(z), bound)
        if problem:
            return problem
        sure = (z.abs() > bound)  # a gate bit is fixed only where z is farther from 0 than the error
        got_on = ref.unpack_gates(gates, w.shape[0])
        if tuple(got_on.shape) != tuple(z.shape) or not bool(((got_on == (z > 0)) | ~sure).all()):
            return "gates: a bit differs from the sign of x Wᵀ + b"
        return ""
    gout, x, w, gates, mask = args
    want = ref.gated_linear_backward(gout, x, w, gates)
    mags = ref.gated_linear_backward(gout.abs(), x.abs(), w.abs(), gates)
    M = x.shape[:-1].numel()
    for name, flag, got, e, m, n in zip(("grad_x", "grad_weight", "grad_bias"), mask, result, want, mags,
                                        (w.shape[0], M, M)):
        problem = _close(name, got, e, _bound(m, e, x.dtype, n)) if flag else (
            "" if got.numel() == 0 else f"{name}: not asked for, but not empty")
        if problem:
            return problem
    return ""


def _tensors(args):
    import torch

    return [a for a in args if isinstance(a, torch.Tensor)]


def evaluate(seed):
    """Run example ``seed``; '' when it behaved, else what went wrong."""
    import re

    import torch

    from ist_kernels.ops.grelu import _triton as tg
    from ist_kernels.ops.subnet import _triton as ts

    entry, args, expect = _draw(seed)
    fn = {"subnet_linear": ts.subnet_linear, "subnet_linear_backward": ts.subnet_linear_backward,
          "relu_gates": tg.relu_gates, "gated_linear": lambda x, w, b, gt: tg.gated_linear(x, w, b, gt),
          "gated_linear_backward": tg.gated_linear_backward}[entry]
    before = [t.clone() for t in _tensors(args)]
    try:
        result, error = fn(*args), None
    except Exception as e:  # noqa: BLE001 (reported)
        result, error = None, e
    for t, c in zip(_tensors(args), before):
        if not torch.equal(torch.nan_to_num(t), torch.nan_to_num(c)):
            return f"{entry}: an input tensor was changed"
    if expect is None:
        if error is not None:
            return f"{entry}: valid input raised {type(error).__name__}: {str(error).splitlines()[0][:200]}"
        problem = _check(entry, args, result)
        return f"{entry}: {problem}" if problem else ""
    kind, name, _ = expect
    if error is None:
        return f"{entry}: a bad {name} raised nothing, expected {kind.__name__}"
    if type(error) is not kind or not re.search(rf"({name})", str(error)):
        return f"{entry}: a bad {name} raised {type(error).__name__}: {str(error).splitlines()[0][:200]}"
    return ""


def _child():
    _child_setup()
    for line in sys.stdin.read().split():
        seed = int(line)
        try:
            problem = evaluate(seed)
        except Exception as e:  # noqa: BLE001 (a bug of the harness or the reference: reported)
            problem = f"the example itself failed: {type(e).__name__}: {e}"
        print(json.dumps({"seed": seed, "problem": problem}), flush=True)


# ----------------------------------------------------------------------------------- the parent
def _run(seeds, timeout):
    env = dict(os.environ)
    if not _has_cuda():
        env.setdefault("TRITON_INTERPRET", "1")
    try:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child"], input="\n".join(map(str, seeds)),
                              capture_output=True, text=True, timeout=timeout, env=env)
        out, rc, err = proc.stdout, proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        rc, err = f"timeout after {timeout} s", ""
    done = {}
    for line in out.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            done[r["seed"]] = r["problem"]
    return done, rc, err


def _has_cuda():
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return False


def fuzz(examples, seed, batch, timeout):
    """{seed: problem} for every example (problem '' when it behaved); crashes pinned to one seed."""
    results, todo = {}, list(range(seed, seed + examples))
    while todo:
        chunk, todo = todo[:batch], todo[batch:]
        done, rc, err = _run(chunk, timeout)
        results.update(done)
        left = [s for s in chunk if s not in done]
        if left:
            alone, rc1, err1 = _run(left[:1], timeout)
            tail = err1.strip().splitlines()[-3:] if isinstance(err1, str) else []
            results[left[0]] = alone.get(left[0]) or f"the process died (exit status {rc1}): {' | '.join(tail)}"
            todo = left[1:] + todo
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", type=int, default=200)
    p.add_argument("--seed", type=int, default=None, help="first example's seed (default: random, printed)")
    p.add_argument("--batch", type=int, default=250, help="examples per child process")
    p.add_argument("--timeout", type=int, default=1800, help="seconds a child may take")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        _child()
        return 0
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(3), "little")
    t0 = time.time()
    results = fuzz(args.examples, seed, args.batch, args.timeout)
    bad = {s: r for s, r in sorted(results.items()) if r}
    for s, r in bad.items():
        print(f"seed {s}: {r}")
    print(f"fuzz_triton: {len(results) - len(bad)}/{len(results)} examples behaved, {len(bad)} did not "
          f"(seeds {seed}..{seed + args.examples - 1}; replay one: --seed S --examples 1) in "
          f"{time.time() - t0:.0f} s", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
