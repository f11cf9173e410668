"""python -m ist_kernels.experiments NAME [options]: small-scale reproductions of the papers'
experiments. Each experiment is the module ist_kernels/experiments/NAME.py with a main(argv)."""
import importlib
import pkgutil
import sys

import ist_kernels.experiments as _pkg


def available():
    return sorted(m.name for m in pkgutil.iter_modules(_pkg.__path__) if not m.name.startswith("_"))


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    names = available()
    if not argv or argv[0] not in names:
        print(f"usage: python -m ist_kernels.experiments {{{','.join(names)}}} [options]", file=sys.stderr)
        return 2
    return importlib.import_module(f"ist_kernels.experiments.{argv[0]}").main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
