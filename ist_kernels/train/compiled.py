"""``--compile``: the workers' models through ``torch.compile``, compiled once per run.

A run's subnetworks have the same structure every round, so the compiled code is reused round after
round: with torch's inlined nn modules (always on in torch >= 2.5) a module's parameters are the
graph's inputs, not constants, and a new module object of the same class and shapes (simulated
storage builds one every round) passes the guards of the code compiled for the first. A round whose
structure differs (another width, another number of layers) compiles it once more: dynamo's
*recompile* of the same forward.

:class:`Compiler` (one per :class:`~ist_kernels.train.context.RunContext`) hands out each worker's
compiled wrapper (:meth:`Compiler.wrap`: the same wrapper while the worker's module is the same
object) and counts the run's compiles through dynamo's compile-event hooks
(``torch._dynamo.callback_handler``): ``compiles`` (dynamo compiles of a frame), ``recompiles``
(those of a frame compiled before: its compile id ``frame/k`` with k > 0), and the seconds spent
compiling (dynamo, AOT autograd and inductor, the backward's lazy compile included), which the run's
clock charges to its ``compile`` part instead of the part that was open (``local``).
"""
from __future__ import annotations

import contextlib
import shutil
import threading
import time
from typing import Dict, Optional, Tuple

import torch
from torch import nn

from .errors import ConfigError


def check_compile(device: torch.device) -> None:
    """ConfigError("compile") when ``torch.compile`` cannot run on ``device`` with this torch: no
    torch.compile, a Python dynamo does not support, no C++ compiler for inductor's CPU code, no
    Triton for its CUDA code."""
    version = torch.__version__
    if not hasattr(torch, "compile"):
        raise ConfigError("compile", f"torch {version} has no torch.compile (torch >= 2.0 needed); leave --compile off")
    from torch._dynamo.eval_frame import check_if_dynamo_supported
    try:
        check_if_dynamo_supported()
    except Exception as e:  # noqa: BLE001 - its message says why
        raise ConfigError("compile", f"torch.compile does not work here (torch {version}): {e}; leave --compile off") from e
    if device.type == "cuda":
        from torch.utils._triton import has_triton
        if not has_triton():
            raise ConfigError("compile", f"torch.compile on {device} needs Triton, which torch {version} does not "
                              f"find; install it or leave --compile off")
    elif device.type == "cpu":
        try:
            from torch._inductor.cpp_builder import get_cpp_compiler
            cxx = get_cpp_compiler()
        except Exception as e:  # noqa: BLE001
            raise ConfigError("compile", f"torch.compile on the CPU needs a C++ compiler: {e}; leave --compile off") from e
        if shutil.which(cxx) is None:
            raise ConfigError("compile", f"torch.compile on the CPU needs a C++ compiler ({cxx!r} not found); "
                              f"install one or leave --compile off")


class _Events:
    """The process's dynamo compile events, counted once (the hooks are process-wide): a snapshot
    (:meth:`read`) minus an earlier one is what happened in between."""

    _lock = threading.Lock()
    _installed: Optional["_Events"] = None

    def __init__(self):
        self.compiles = 0
        self.recompiles = 0
        self.seconds = 0.0
        self._t0: Optional[float] = None

    @classmethod
    def get(cls) -> "_Events":
        """The process's counter, its hooks registered (again after ``torch._dynamo.reset()``, which
        drops every hook)."""
        from torch._dynamo.callback import callback_handler
        with cls._lock:
            if cls._installed is None:
                cls._installed = cls()
            ev = cls._installed
            if ev._on_start not in callback_handler.start_callbacks:
                callback_handler.register_start_callback(ev._on_start)
                callback_handler.register_end_callback(ev._on_end)
            return ev

    def _on_start(self, args) -> None:
        from torch._dynamo.callback import CallbackTrigger
        self._t0 = time.perf_counter()
        if args.callback_trigger == CallbackTrigger.DYNAMO:
            self.compiles += 1
            self.recompiles += int(_frame_compile_id(args.compile_id) > 0)

    def _on_end(self, args) -> None:
        if self._t0 is not None:
            self.seconds += time.perf_counter() - self._t0
            self._t0 = None

    def read(self) -> Tuple[int, int, float]:
        return self.compiles, self.recompiles, self.seconds


def _frame_compile_id(compile_id: str) -> int:
    """k of dynamo's compile id ``frame/k`` (``frame/k_attempt``; ``!ca/frame/k`` under compiled
    autograd): how many times the frame was compiled before; 0 when it does not read as one."""
    try:
        return int(str(compile_id).split("/")[-1].split("_")[0])
    except ValueError:
        return 0


class Compiler:
    """The run's compiled models and its compile counts (see the module docstring). ``clock``: the
    run's :class:`~ist_kernels.train.timing.Clock`; compile time moves to its ``compile`` part when
    :meth:`charge` is called after work that may have compiled."""

    def __init__(self, device: torch.device, clock=None):
        check_compile(device)
        self._clock = clock
        self._events = _Events.get()
        self._start = self._events.read()
        self._charged = self._start[2]
        self._wrapped: Dict[int, Tuple[nn.Module, nn.Module]] = {}  # worker -> (module, its compiled wrapper)

    def wrap(self, worker: int, module: nn.Module) -> nn.Module:
        """``module`` compiled (``torch.compile``): the same wrapper while ``worker``'s module is the
        same object, a new one (which reuses the compiled code where the structure matches) when a
        new module arrives; making one is timed as ``compile``. Its parameters are ``module``'s (an optimizer over either is the same)."""
        if isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
            return module
        self._events = _Events.get()  # (hooks dropped by a torch._dynamo.reset() come back)
        held = self._wrapped.get(worker)
        if held is not None and held[0] is module:
            return held[1]
        with self._clock("compile") if self._clock is not None else contextlib.nullcontext():
            wrapper = torch.compile(module)  # (the first imports the compiler stack: a second or so)
        self._wrapped[worker] = (module, wrapper)
        return wrapper

    def charge(self) -> None:
        """Move the compile seconds since the last charge to the clock's ``compile`` part (the part
        open now, which also measured them, gives them up)."""
        seconds = self._events.read()[2]
        if self._clock is not None and seconds > self._charged:
            self._clock.add("compile", seconds - self._charged)
        self._charged = seconds

    def counts(self) -> Dict[str, float]:
        """This run's ``compiles``, ``recompiles`` and ``compile_s`` (seconds compiling) so far."""
        now = self._events.read()
        return {"compiles": now[0] - self._start[0], "recompiles": now[1] - self._start[1],
                "compile_s": round(now[2] - self._start[2], 6)}
