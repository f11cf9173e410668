"""A workload: a dict of trainer settings (``dataset``, ``model``, ``width``, ``lr``, ``batch_size``,
``local_steps``, ``rounds``; optionally ``depth``, ``metric``, ``train``, ``methods``, ``variants``,
``options`` and ``flags``, as the speed experiment's ``CONFIGS``), and the trainer's command line of
each of its methods."""
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ...train.config import TrainConfig
from ...train.errors import ConfigError
from ...train.methods import METHODS

#: the metrics a workload can have: higher is better?
METRICS = {"accuracy": True, "bits_per_byte": False}


def _without_lr(flags: Sequence[str]) -> List[str]:
    out, skip = [], False
    for f in flags:
        if skip:
            skip = False
        elif f == "--lr":
            skip = True
        else:
            out.append(f)
    return out


def trainer_method(w: Dict[str, Any], name: str) -> Tuple[str, List[str]]:
    """(the trainer's --method, its --option values) of ``name`` on workload ``w``: a variant of the
    workload's (lm's ist-ffn: ist with partition=ffn) or a trainer method itself."""
    method, options = w.get("variants", {}).get(name, (name, []))
    return method, list(options)


def _per_method(w: Dict[str, Any], key: str, name: str) -> List[str]:
    """``w[key]``'s list for the method ``name``: its own entry, else its trainer method's."""
    table = w.get(key, {})
    return list(table[name] if name in table else table.get(trainer_method(w, name)[0], []))


def higher_is_better(w: Dict[str, Any]) -> bool:
    return METRICS[w.get("metric", "accuracy")]


def base_lr(w: Dict[str, Any], method: str) -> float:
    """The workload's learning rate for ``method``: its own ``--lr`` flag (diloco's inner AdamW) or the
    workload's; the tuning grid multiplies it."""
    extra = _per_method(w, "flags", method)
    for i, f in enumerate(extra[:-1]):
        if f == "--lr":
            return float(extra[i + 1])
    return float(w["lr"])


def method_flags(w: Dict[str, Any], method: str, compress: str, lr: Optional[float] = None) -> List[str]:
    """The trainer's flags of ``method`` on workload ``w``; ``lr``: in place of :func:`base_lr`."""
    lr = base_lr(w, method) if lr is None else lr
    tm, variant_options = trainer_method(w, method)
    flags = ["--method", tm, "--model", w["model"], "--width", str(w["width"]), "--dataset", w["dataset"],
             "--rounds", str(w["rounds"]), "--local-steps", str(w["local_steps"]), "--batch-size",
             str(w["batch_size"]), "--lr", f"{lr:.6g}", "--eval-interval", "1"]
    if "depth" in w:
        flags += ["--depth", str(w["depth"])]
    for k, v in w.get("train", {}).items():
        flags += [f"--{k.replace('_', '-')}", str(v)]
    for o in variant_options + _per_method(w, "options", method):
        flags += ["--option", o]
    flags += _without_lr(_per_method(w, "flags", method))
    if compress != "none":
        flags += ["--compress", compress]
    return flags


def trains(w: Dict[str, Any], method: str, S: int) -> Optional[str]:
    """None when ``method`` can train workload ``w`` with S workers, else why not."""
    universe = w.get("methods")
    if universe is not None and method not in universe:
        return f"not one of the workload's methods ({', '.join(universe)})"
    tm, variant_options = trainer_method(w, method)
    if tm not in METHODS:
        return f"the trainer has no method {tm!r}"
    opts = dict(o.split("=", 1) for o in variant_options + _per_method(w, "options", method))
    kw = {k: w[k] for k in ("dataset", "model", "width", "depth", "lr", "batch_size", "local_steps", "rounds") if k in w}
    try:
        TrainConfig(method=tm, workers=S, options=opts, **kw, **w.get("train", {})).validate()
    except (ConfigError, ValueError) as e:
        return str(e)
    return None


def compresses(method: str) -> bool:
    return method != "ddp"  # torch's DistributedDataParallel sends its own gradient buckets
