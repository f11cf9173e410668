"""The options every experiment has (``--seeds``, ``--quick``, ``--out``, ``--jobs``, ``--dpi``), argparse
types for comma-separated lists, and the parse that applies ``--quick``'s values."""
import argparse
import os
from typing import Any, Callable, Dict, List, Sequence

DEFAULT_DPI = 80


def number_list(cast: Callable[[str], Any], what: str) -> Callable[[str], List[Any]]:
    """An argparse type: a comma-separated list of ``cast(value)`` (``what`` names one value in its errors)."""
    def parse(s: str) -> List[Any]:
        try:
            out = [cast(v) for v in s.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}s, got {s!r}") from None
        if not out:
            raise argparse.ArgumentTypeError(f"expected at least one {what}")
        return out
    return parse


ints = number_list(int, "integer")
ints.__doc__ = "A comma-separated list of integers (argparse type)."
floats = number_list(float, "number")
floats.__doc__ = "A comma-separated list of numbers (argparse type)."


def names(s: str) -> List[str]:
    """A comma-separated list of names (argparse type)."""
    out = [v.strip() for v in s.split(",") if v.strip()]
    if not out:
        raise argparse.ArgumentTypeError("expected at least one name")
    return out


def parser(name: str, doc: str, seeds: Sequence[int] = (0, 1, 2), quick: str = "") -> argparse.ArgumentParser:
    """The experiment's parser with the options every experiment has; ``doc`` is its module
    docstring (first line: the summary listed by ``python -m ist_kernels.experiments --help``)."""
    p = argparse.ArgumentParser(prog=f"python -m ist_kernels.experiments {name}", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("common options")
    g.add_argument("--seeds", "--seed", dest="seeds", type=ints, default=list(seeds), metavar="S[,S...]",
                   help="seeds of the independent runs (default %(default)s); tables give mean ± std over them")
    g.add_argument("--quick", action="store_true", help="tiny run for CI, well under a minute on 2 cores" +
                   (f" ({quick})" if quick else ""))
    g.add_argument("--out", default=os.path.join("outputs", "experiments", name),
                   help=f"output folder for {name}.json, {name}.md, {name}.png (default %(default)s)")
    g.add_argument("--jobs", type=int, default=1, help="worker processes for the runs (default %(default)s)")
    g.add_argument("--dpi", type=int, default=DEFAULT_DPI, help="PNG resolution (default %(default)s)")
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.jobs < 1:
        p.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.dpi < 10:
        p.error(f"--dpi must be >= 10, got {args.dpi}")
    if any(s < 0 for s in args.seeds) or len(set(args.seeds)) != len(args.seeds):
        p.error(f"--seeds must be distinct integers >= 0, got {args.seeds}")


def parse_args(p: argparse.ArgumentParser, argv: Sequence[str], quick: Dict[str, object],
               positive: Sequence[str]) -> argparse.Namespace:
    """Parse ``argv``; with ``--quick`` set each ``quick`` option (a value, or a function of the
    parsed one) and keep the first two seeds; check the common options and that every option in
    ``positive`` is >= 1."""
    args = p.parse_args(list(argv))
    if args.quick:
        for name, value in quick.items():
            setattr(args, name, value(getattr(args, name)) if callable(value) else value)
        args.seeds = args.seeds[:2]
    check_args(p, args)
    for name in positive:
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def summary_line(doc: str) -> str:
    return doc.strip().splitlines()[0].strip()
