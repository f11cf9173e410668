"""python -m ist_kernels.experiments EXPERIMENT [options]

Small-scale reproductions of the papers' experiments. Each writes EXPERIMENT.json (raw results),
EXPERIMENT.md (tables, mean ± std over seeds) and EXPERIMENT.png into --out; --quick is a tiny run
for CI. Each experiment is the module ist_kernels/experiments/EXPERIMENT.py with a docstring (its
first line is the summary below), a parser() and a main(argv). The table of the papers'
claims is made from the JSON files by python -m ist_kernels.experiments.claims."""
import importlib
import pkgutil
import sys
import textwrap

import ist_kernels.experiments as _pkg

from .harness.options import summary_line


def available():
    """The experiments: the package's public modules with a parser() (claims.py only reads their JSON; the
    harness is a package, not an experiment)."""
    names = sorted(m.name for m in pkgutil.iter_modules(_pkg.__path__) if not m.name.startswith("_") and not m.ispkg)
    return [n for n in names if hasattr(_module(n), "parser")]


def _module(name: str):
    return importlib.import_module(f"ist_kernels.experiments.{name}")


def overview() -> str:
    """The top-level help: every experiment, its summary and its options (its usage line)."""
    lines = [f"usage: python -m ist_kernels.experiments {{{','.join(available())}}} [options]", "",
             textwrap.fill(" ".join(__doc__.split("\n\n", 1)[1].split()), 100), "", "experiments:"]
    for name in available():
        mod = _module(name)
        lines.append(f"  {name:8s} {summary_line(mod.__doc__)}")
        options = mod.parser().format_usage().split(f" {name} ", 1)[1]
        lines += textwrap.wrap("options: " + " ".join(options.split()), 100, initial_indent=" " * 11,
                               subsequent_indent=" " * 13, break_on_hyphens=False)
    lines += ["", "python -m ist_kernels.experiments EXPERIMENT --help describes one experiment and its options."]
    return "\n".join(lines)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    names = available()
    if not argv or argv[0] in ("-h", "--help"):
        print(overview(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] not in names:
        print(f"python -m ist_kernels.experiments: unknown experiment {argv[0]!r}; available: "
              f"{', '.join(names)} (--help lists them with their options)", file=sys.stderr)
        return 2
    return _module(argv[0]).main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
