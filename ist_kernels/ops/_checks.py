"""Argument checks shared by fake kernels and Python-registered (Triton) kernels.

The C++ kernels check the same things in csrc/checks.h. Messages name the op and the argument.
"""
import torch


def check(cond: bool, op: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{op}: {msg}")


def gate_words(num_features: int) -> int:
    return (num_features + 31) // 32


def check_same_device(op: str, **tensors) -> None:
    named = [(n, t) for n, t in tensors.items() if t is not None]
    if not named:
        return
    dev = named[0][1].device
    for n, t in named[1:]:
        if t.device != dev:
            raise ValueError(f"{op}: {n} is on {t.device} but {named[0][0]} is on {dev}; all tensors must be on one device")
