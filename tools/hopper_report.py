"""Compile every declared Triton kernel at its chosen configs for sm_90a and every csrc/**/*.cu
for sm_90, offline (no GPU), and report per kernel, config and dtype what the compilers made.

    python tools/hopper_report.py [--out FILE] [--dtypes bf16,fp16] [--jobs N] [--only TEXT] [--dump DIR]

Triton kernels: each op family's Triton module (ist_kernels/ops/<family>/_triton.py) declares its
kernels in ``HOPPER_KERNELS`` (``ist_kernels.ops._triton_common.HopperKernel``: the kernel, its
launch signature per dtype, its configs, by default the autotune list and the pinned config given to
``tuned``). Each is compiled with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90,
32))`` in a process with TRITON_INTERPRET=0 and a fresh, temporary Triton cache. Registers and
spills come from the ``ptxas -v`` log of the ptxas Triton runs itself (the one it ships), shared
memory from Triton's metadata (dynamic shared memory), SASS from the cuobjdump Triton ships.

CUDA kernels: ``nvcc -cubin -arch=sm_90 -Xptxas -v`` with setup.py's and torch's nvcc flags,
per .cu file; one row per kernel instantiation; SASS from the same cuobjdump.

Columns: wgmma / TMA / cp.async are greps of the PTX for ``wgmma.mma_async``,
``cp.async.bulk.tensor`` and ``cp.async.ca|cg`` (the non-bulk form). The main loop is read off
the SASS: every backward branch (``BRA`` to a lower address) closes a loop spanning its target to
itself; the main loop is the innermost (shortest) such loop that holds a matrix instruction
(HGMMA/HMMA/DMMA/...), or, in kernels without one, the longest loop that holds no other loop. Its
instruction count is (branch - target) / 16 + 1: the SASS instructions one iteration issues
along the straight path (sm_90 instructions are 16 bytes).

Exit status 1 when a GEMM kernel's chosen config that fits shared memory lacks wgmma in a 16-bit
dtype or spills, or when anything fails to compile. Configs over the 227 KiB a block may use on
sm_90 are reported as skipped (the autotuner prunes them).
"""
import argparse
import contextlib
import importlib
import io
import multiprocessing
import os
import pkgutil
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ProcessPoolExecutor

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ARCH = 90
SMEM_LIMIT = 232448  # bytes of shared memory one block may opt in to on sm_90 (227 KiB)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}
SIXTEEN_BIT = ("bf16", "fp16")
MMA_SASS = re.compile(r"\b(?:[HIDQB]GMMA|HMMA|IMMA|DMMA)\b")
SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*?)\s*;")
BRANCH = re.compile(r"\bBRA\b.*?(0x[0-9a-f]+)\s*$")
CUDA_FLAGS = ["-O3", "-std=c++20", "-lineinfo", "-arch=sm_90", "-Icsrc"]  # setup.py's, for sm_90


# ------------------------------------------------------------------------------- reading compilers
def triton_ptxas():
    """The ptxas Triton runs for sm_90a (3.9 picks one by arch; older versions have one)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
    except ImportError:
        return knobs.nvidia.ptxas
    try:
        return get_ptxas(ARCH)
    except TypeError:
        return get_ptxas()


def _site_relative(path):
    """A tool's path from the site-packages folder on (shorter, the same on every machine)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(triton.__file__)))
    return os.path.relpath(path, root) if path and path.startswith(root) else path


def parse_ptxas_log(log):
    """{entry function: dict(regs, spill_st, spill_ld, stack, smem)} from a ``ptxas -v`` log."""
    out, props, entry = {}, {}, None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            entry = m.group(1)
            out[entry] = dict(regs=None, spill_st=0, spill_ld=0, stack=0, smem=0)
            continue
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            props = out.get(m.group(1), {})  # device functions' properties are not reported
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            props.update(stack=int(m.group(1)), spill_st=int(m.group(2)), spill_ld=int(m.group(3)))
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and entry is not None:
            out[entry]["regs"] = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            out[entry]["smem"] = int(s.group(1)) if s else 0
    return out


def sass_functions(cubin_path):
    """{function: [(address, instruction)]} from cuobjdump -sass of a cubin."""
    text = subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", cubin_path], check=True,
                          capture_output=True, text=True).stdout
    out, cur = {}, None
    for line in text.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            cur = out.setdefault(m.group(1), [])
            continue
        m = SASS_LINE.search(line)
        if m and cur is not None:
            cur.append((int(m.group(1), 16), m.group(2)))
    return out


def main_loop(instrs):
    """(instructions per iteration, matrix instructions per iteration) of the main loop, or None
    when the code has no loop (see the module docstring for how the loop is chosen)."""
    loops = []
    for addr, ins in instrs:
        m = BRANCH.search(ins)
        if m and int(m.group(1), 16) < addr:
            lo = int(m.group(1), 16)
            body = [i for a, i in instrs if lo <= a <= addr]
            loops.append((lo, addr, len(body), sum(bool(MMA_SASS.search(i)) for i in body)))
    with_mma = [lp for lp in loops if lp[3] > 0]
    if with_mma:
        best = min(with_mma, key=lambda lp: lp[2])
    else:
        leaves = [lp for lp in loops if not any(o is not lp and lp[0] <= o[0] and o[1] <= lp[1] for o in loops)]
        if not leaves:
            return None
        best = max(leaves, key=lambda lp: lp[2])
    return best[2], best[3]


def ptx_features(ptx):
    return dict(wgmma="wgmma.mma_async" in ptx, mma_sync="mma.sync" in ptx,
                tma="cp.async.bulk.tensor" in ptx, cp_async=re.search(r"cp\.async\.c[ag]\b", ptx) is not None)


def ptx_entries(ptx):
    """{entry name: its PTX text} of a PTX module."""
    starts = [(m.start(), m.group(1)) for m in re.finditer(r"\.entry\s+(\S+?)\s*\(", ptx)]
    return {name: ptx[s:(starts[i + 1][0] if i + 1 < len(starts) else len(ptx))]
            for i, (s, name) in enumerate(starts)}


def analyse(props, ptx, sass, shared):
    loop = main_loop(sass)
    return dict(props, **ptx_features(ptx), shared=shared,
                loop=loop[0] if loop else None, loop_mma=loop[1] if loop else None)


# ------------------------------------------------------------------------------- Triton kernels
TRITON_MODULE = "_triton"  # the module of an op family (ist_kernels/ops/<family>/) holding its Triton kernels


def _kernel_modules():
    """ist_kernels.ops and the shared Triton module (ist_kernels.ops._triton_common), imported for a
    GPU. main() sets TRITON_INTERPRET=0 before this (worker processes inherit it): under the
    interpreter @triton.jit makes no JIT functions to compile."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import ist_kernels.ops
    from ist_kernels.ops import _triton_common as common
    if common.INTERPRET:
        sys.exit("hopper_report.py: ist_kernels was imported with TRITON_INTERPRET=1; this compiles for a GPU")
    return ist_kernels.ops, common


def declarations(only=None):
    """[(module, index, HopperKernel)] from every op family's Triton module
    (ist_kernels.ops.<family>._triton), and the names of the autotuned kernels that no declaration
    names."""
    package, common = _kernel_modules()
    decls = []
    names = [i.name for i in pkgutil.walk_packages(package.__path__, f"{package.__name__}.")
             if i.name.rpartition(".")[2] == TRITON_MODULE]
    for name in sorted(names):
        mod = importlib.import_module(name)
        for i, d in enumerate(getattr(mod, "HOPPER_KERNELS", ())):
            if only is None or only in d.name:
                decls.append((mod.__name__, i, d))
    declared = {d.kernel for _, _, d in decls}
    undeclared = [k.__name__ for k in common.tuned_kernels() if k not in declared]
    return decls, ([] if only else undeclared)


def _config_key(c):
    return (tuple(sorted(c.kwargs.items())), c.num_warps, c.num_stages, c.num_ctas, c.maxnreg)


def configs_of(decl):
    """[(config, is the pinned one)]: the declaration's configs, or those it was given to tuned()."""
    if decl.configs is not None:
        return [(c, False) for c in decl.configs]
    tuned, pinned = _kernel_modules()[1].chosen_configs(decl.kernel)
    out = [(c, _config_key(c) == _config_key(pinned)) for c in tuned]
    if not any(p for _, p in out):
        out.append((pinned, True))
    return out


def config_label(c, pinned):
    tiles = " ".join(f"{k}={v}" for k, v in c.kwargs.items() if not k.startswith("GROUP"))
    extra = (f" ctas{c.num_ctas}" if c.num_ctas != 1 else "") + (f" maxnreg{c.maxnreg}" if c.maxnreg else "")
    return f"{tiles} s{c.num_stages} w{c.num_warps}{extra}" + (" (pinned)" if pinned else "")


def signature(decl, dtype_name, config):
    """(signature, constexprs, attrs) for ASTSource, from the declaration (see HopperKernel)."""
    fn = decl.kernel
    given = {**decl.args(DTYPES[dtype_name], dict(config.kwargs)), **config.kwargs}
    unknown = sorted(set(given) - set(fn.arg_names))
    if unknown:
        raise ValueError(f"{decl.name}: the declaration names {unknown}, not parameters of {fn.__name__}")
    sig, cx, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        v = given.get(p.name)
        if p.is_constexpr:
            if p.name not in given and not p.has_default:
                raise ValueError(f"{decl.name}: constexpr {p.name} of {fn.__name__} has no value in the declaration")
            sig[p.name], cx[p.name] = "constexpr", given.get(p.name, p.default)
        elif isinstance(v, str):
            sig[p.name] = v.format(dtype=dtype_name)
        elif v is not None:  # an integer the launch passes as this constant (the JIT specialises it)
            sig[p.name], cx[p.name] = "constexpr", v
        else:
            sig[p.name] = f"*{dtype_name}" if p.name.endswith("_ptr") else "i32"
        if sig[p.name][0] in "*iu":
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, cx, attrs


def _slug(*parts):
    return re.sub(r"[^A-Za-z0-9]+", "_", "_".join(parts)).strip("_")


def compile_triton(module, index, cfg_index, dtype_name, dump):
    """One kernel x config x dtype; runs in a worker process."""
    _kernel_modules()
    decl = importlib.import_module(module).HOPPER_KERNELS[index]
    config, pinned = configs_of(decl)[cfg_index]
    row = dict(kernel=decl.name, dtype=dtype_name, config=config_label(config, pinned), gemm=decl.gemm)
    t0 = time.time()
    log = io.StringIO()
    try:
        sig, cx, attrs = signature(decl, dtype_name, config)
        options = dict(num_warps=config.num_warps, num_stages=config.num_stages, num_ctas=config.num_ctas)
        if config.maxnreg:
            options["maxnreg"] = config.maxnreg
        knobs.nvidia.dump_ptxas_log = True  # Triton prints its own ptxas -v log; read it
        with contextlib.redirect_stdout(log):
            k = triton.compile(ASTSource(decl.kernel, sig, cx, attrs), target=GPUTarget("cuda", ARCH, 32),
                               options=options)
        props = parse_ptxas_log(log.getvalue()).get(k.metadata.name)
        if props is None:
            raise RuntimeError(f"no ptxas -v log for {k.metadata.name} (a cached compile?)")
        with tempfile.TemporaryDirectory() as tmp:
            cubin = os.path.join(tmp, "k.cubin")
            with open(cubin, "wb") as f:
                f.write(k.asm["cubin"])
            sass = sass_functions(cubin).get(k.metadata.name, [])
        row.update(analyse(props, k.asm["ptx"], sass, k.metadata.shared))
        if dump:
            base = os.path.join(dump, _slug(decl.name, dtype_name, config_label(config, pinned)))
            for ext in ("ttgir", "ptx"):
                with open(f"{base}.{ext}", "w") as f:
                    f.write(k.asm[ext])
            with open(f"{base}.sass", "w") as f:
                f.write("\n".join(f"/*{a:04x}*/ {i};" for a, i in sass))
    except Exception as e:  # reported in the table and failing the run
        sys.stderr.write(f"{decl.name} {dtype_name} {row['config']}:\n{traceback.format_exc()}"
                         f"{log.getvalue()[-4000:]}\n")
        row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    row["seconds"] = time.time() - t0
    return row


# ------------------------------------------------------------------------------- CUDA kernels
def _short_names(mangled):
    """Demangled kernel names without namespaces and parameter lists."""
    try:
        text = subprocess.run(["c++filt"], input="\n".join(mangled), capture_output=True, text=True).stdout
    except OSError:  # no binutils: the mangled names
        return {m: m for m in mangled}
    out = {}
    for m, d in zip(mangled, text.splitlines()):
        d = re.sub(r"^void ", "", d)
        depth, cut = 0, len(d)
        for i in range(len(d) - 1, -1, -1):  # drop the parameter list: the last top-level (...)
            depth += {")": 1, "(": -1}.get(d[i], 0)
            if depth == 0 and d[i] == "(":
                cut = i
                break
        out[m] = re.sub(r"\(anonymous namespace\)::|\b\w+::", "", d[:cut])
    return out


def compile_cuda(path, dump):
    """One .cu file: a row per kernel; runs in a worker process."""
    import torch.utils.cpp_extension as ext
    t0 = time.time()
    rel = os.path.relpath(path, ROOT)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        cmd = ["nvcc", "-cubin", *CUDA_FLAGS, *ext.COMMON_NVCC_FLAGS, "-Xptxas", "-v", "--keep", "--keep-dir", tmp,
               path, "-o", cubin]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if r.returncode != 0:
            sys.stderr.write(f"{' '.join(cmd)}\n{r.stdout}{r.stderr}\n")
            return [dict(source=rel, kernel="(nvcc failed)", error=(r.stderr.strip().splitlines() or ["?"])[-1],
                         seconds=time.time() - t0)]
        props = parse_ptxas_log(r.stdout + r.stderr)
        ptx = "".join(open(os.path.join(tmp, f)).read() for f in sorted(os.listdir(tmp)) if f.endswith(".ptx"))
        entries = ptx_entries(ptx)
        sass = sass_functions(cubin)
        if dump:
            shutil.copy(cubin, os.path.join(dump, _slug(rel) + ".cubin"))
            with open(os.path.join(dump, _slug(rel) + ".ptx"), "w") as f:
                f.write(ptx)
    names = _short_names(sorted(props))
    rows = [dict(source=rel, kernel=names.get(m, m), **analyse(p, entries.get(m, ""), sass.get(m, []), p["smem"]))
            for m, p in sorted(props.items(), key=lambda kv: names.get(kv[0], kv[0]))]
    for row in rows:
        row["seconds"] = time.time() - t0
    return rows


# ------------------------------------------------------------------------------- the report
def _yes(v):
    return "yes" if v else "-"


def _mma(r):
    return "wgmma" if r["wgmma"] else "mma.sync" if r["mma_sync"] else "-"


def _loop(r):
    if r.get("loop") is None:
        return "-"
    return f"{r['loop']} ({r['loop_mma']} MMA)" if r["loop_mma"] else str(r["loop"])


def verdict(r):
    """'ok', 'skipped ...' or 'FAIL ...' for a Triton row."""
    if "error" in r:
        return f"FAIL: {r['error']}"
    if r["shared"] > SMEM_LIMIT:
        return f"skipped: {r['shared']} B shared > {SMEM_LIMIT}"
    bad = []
    if r["gemm"] and r["dtype"] in SIXTEEN_BIT and not r["wgmma"]:
        bad.append("no wgmma")
    if r["gemm"] and (r["spill_st"] or r["spill_ld"]):
        bad.append("spills")
    return "FAIL: " + ", ".join(bad) if bad else "ok"


def _markdown(header, cells):
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
        ["| " + " | ".join(str(c) for c in row) + " |" for row in cells]


def _range(xs):
    return "-" if not xs else str(min(xs)) if min(xs) == max(xs) else f"{min(xs)}-{max(xs)}"


def _measures(r):
    """regs, spills, shared, MMA, TMA, cp.async, main loop: the columns every row shares."""
    if "error" in r:
        return [""] * 7
    return [r["regs"], f"{r['spill_st']}/{r['spill_ld']}", r["shared"], _mma(r), _yes(r["tma"]),
            _yes(r["cp_async"]), _loop(r)]


MEASURES = ["regs", "spills st/ld B", "shared B", "MMA", "TMA", "cp.async", "main loop instr"]


def triton_table(rows):
    return _markdown(["kernel", "dtype", "config", *MEASURES, ""],
                     [[r["kernel"], r["dtype"], r["config"], *_measures(r), verdict(r)] for r in rows])


def summary_table(rows):
    """Per kernel and dtype over the configs that fit: the ranges the full table spells out."""
    groups = {}
    for r in rows:
        groups.setdefault((r["kernel"], r["dtype"]), []).append(r)
    cells = []
    for (kernel, dtype), rs in groups.items():
        v = [verdict(r) for r in rs]
        fit = [r for r, s in zip(rs, v) if not s.startswith("skipped") and "error" not in r]
        wgmma = sum(r["wgmma"] for r in fit)
        pinned = [r for r in fit if r["config"].endswith("(pinned)")]
        cells.append([kernel, dtype, f"{sum(s == 'ok' for s in v)} / {sum(s.startswith('skipped') for s in v)} / "
                                     f"{sum(s.startswith('FAIL') for s in v)}",
                      _range([r["regs"] for r in fit]),
                      max([max(r["spill_st"], r["spill_ld"]) for r in fit], default=0),
                      "all" if fit and wgmma == len(fit) else "none" if not wgmma else f"{wgmma} of {len(fit)}",
                      _range([r["loop"] for r in fit if r["loop"] is not None]), _loop(pinned[0]) if pinned else "-"])
    return _markdown(["kernel", "dtype", "configs ok / skipped / failed", "regs", "spills max B", "wgmma",
                      "main loop instr", "pinned config's loop"], cells)


def cuda_table(rows):
    return _markdown(["source", "kernel", *MEASURES, "stack B", ""],
                     [[r["source"], f"`{r['kernel']}`", *_measures(r), r.get("stack", ""),
                       f"FAIL: {r['error']}" if "error" in r else ""] for r in rows])


def _tool_version(cmd):
    try:
        out = subprocess.run(cmd, capture_output=True, text=True).stdout
        return out.strip().splitlines()[-1]
    except OSError:
        return "not found"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="also write the markdown report here")
    p.add_argument("--dtypes", default="bf16,fp16", help=f"comma-separated, of {', '.join(DTYPES)}")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile processes")
    p.add_argument("--only", help="only the Triton kernels whose name contains this (no CUDA)")
    p.add_argument("--dump", help="write each kernel's TTGIR / PTX / SASS (cubin for CUDA) here")
    args = p.parse_args(argv)
    dtypes = args.dtypes.split(",")
    bad = [d for d in dtypes if d not in DTYPES]
    if bad:
        p.error(f"--dtypes: unknown {bad}; expected some of {list(DTYPES)}")
    os.environ["TRITON_INTERPRET"] = "0"  # before ist_kernels is imported, here and in the workers
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, without its warning
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
    t0 = time.time()
    decls, undeclared = declarations(args.only)
    tasks = [(m, i, c, dt) for m, i, d in decls for dt in dtypes for c in range(len(configs_of(d)))]
    cu = [] if args.only else sorted(os.path.join(dp, f) for dp, _, fs in os.walk(os.path.join(ROOT, "csrc"))
                                     for f in fs if f.endswith(".cu"))
    have_nvcc = shutil.which("nvcc") is not None
    cache = tempfile.mkdtemp(prefix="hopper_report_triton_cache_")
    os.environ["TRITON_CACHE_DIR"] = cache  # fresh per run: every kernel really compiles (and logs)
    try:
        spawn = multiprocessing.get_context("spawn")  # fresh interpreters: nothing forked from a torch process
        with ProcessPoolExecutor(max_workers=max(1, args.jobs), mp_context=spawn) as pool:
            cu_futs = [pool.submit(compile_cuda, f, args.dump) for f in cu] if have_nvcc else []
            futs = [pool.submit(compile_triton, *t, args.dump) for t in tasks]
            trows = []
            for n, f in enumerate(futs, 1):
                r = f.result()
                trows.append(r)
                print(f"[{n}/{len(futs)}] {r['kernel']} {r['dtype']} {r['config']}: {verdict(r)} ({r['seconds']:.1f}s)",
                      file=sys.stderr, flush=True)
            crows = [r for f in cu_futs for r in f.result()]
    finally:
        shutil.rmtree(cache, ignore_errors=True)

    failures = [f"{r['kernel']} {r['dtype']} {r['config']}: {verdict(r)}"
                for r in trows if verdict(r).startswith("FAIL")]
    failures += [f"{r['source']}: FAIL: nvcc: {r['error']}" for r in crows if "error" in r]
    ptxas = triton_ptxas()
    nvcc = _tool_version(["nvcc", "--version"]) if have_nvcc else "nvcc not found: CUDA sources not compiled"
    md = [f"# sm_90 report: what the compilers make of the kernels ({time.strftime('%Y-%m-%d')})", "",
          f"`python tools/hopper_report.py`, {time.time() - t0:.0f} s with {args.jobs} processes. "
          f"Triton {triton.__version__} for sm_90a, its ptxas {getattr(ptxas, 'version', '')} "
          f"(`{_site_relative(ptxas.path)}`); SASS by `{_site_relative(knobs.nvidia.cuobjdump.path)}`. "
          f"CUDA: `nvcc -cubin {' '.join(CUDA_FLAGS)} -Xptxas -v` ({nvcc}). "
          "Shared memory: Triton's dynamic allocation / ptxas' static smem; a config over "
          f"{SMEM_LIMIT} B is skipped (the autotuner prunes it). MMA / TMA / cp.async: the PTX has "
          "`wgmma.mma_async` (else `mma.sync`) / `cp.async.bulk.tensor` / `cp.async.ca|cg`. Main loop: the "
          "innermost SASS loop (a backward `BRA` and its target) that holds a matrix instruction, else the "
          "longest loop without an inner loop; its instructions from the target to the branch, the matrix "
          "ones in parentheses. A GEMM kernel's config that fits must have wgmma (bf16/fp16) and no spills.", ""]
    if trows:
        md += ["## Triton kernels, per kernel and dtype (configs that fit)", ""] + summary_table(trows)
        md += ["", "## Triton kernels, every chosen config", ""] + triton_table(trows)
    if undeclared:
        md += ["", f"Autotuned kernels with no HOPPER_KERNELS declaration (not compiled): {', '.join(undeclared)}."]
    if crows:
        md += ["", "## CUDA kernels (nvcc, sm_90)", ""] + cuda_table(crows)
    md += ["", "## Result", ""]
    md += [f"- {f}" for f in failures] or ["PASS: every GEMM kernel's chosen configs that fit have wgmma, no spills."]
    text = "\n".join(md) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
