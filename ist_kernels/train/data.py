"""Data sets of the papers' experiments, generated or loaded offline (nothing downloads)."""
from typing import Optional, Tuple

import torch
from torch import Tensor


def diabetes_regression(n: int = 100, generator: Optional[torch.Generator] = None,
                        dtype=torch.float32) -> Tuple[Tensor, Tensor]:
    """n samples of sklearn's bundled diabetes regression data (442 x 10) in paper 001's setting
    (Hypothesis 1, Theorem 3): every input scaled to ‖x_i‖ = 1, targets standardised (mean 0,
    std 1). Without a generator the first n samples are taken, else a random subset."""
    from sklearn.datasets import load_diabetes

    X, y = load_diabetes(return_X_y=True)
    if not 1 <= n <= len(X):
        raise ValueError(f"diabetes_regression: n must be in [1, {len(X)}], got {n}")
    idx = torch.arange(n) if generator is None else torch.randperm(len(X), generator=generator)[:n]
    x = torch.as_tensor(X, dtype=torch.float64)[idx]
    y = torch.as_tensor(y, dtype=torch.float64)[idx]
    x = x / x.norm(dim=1, keepdim=True)
    y = (y - y.mean()) / y.std() if n > 1 else y - y.mean()
    return x.to(dtype), y.to(dtype)


def teacher_regression(n: int = 100, d: int = 128, generator: Optional[torch.Generator] = None,
                       dtype=torch.float32, hidden: int = 16) -> Tuple[Tensor, Tensor]:
    """A synthetic stand-in for paper 001 §5's data (the Communities and Crime subset: n = 100
    samples, 128 features), in the setting of its Hypothesis 1: inputs x_i ~ N(0, I_d) scaled to
    ‖x_i‖ = 1 (no two co-aligned), targets from a fixed random teacher
    y_i = Σ_j v_j relu(√d ⟨u_j, x_i⟩) with ``hidden`` units, u_j ~ N(0, I_d / d), v_j ~ N(0, 1),
    standardised (mean 0, std 1). Everything is drawn from ``generator``."""
    if n < 1 or d < 1 or hidden < 1:
        raise ValueError(f"teacher_regression: n, d and hidden must be >= 1, got {n}, {d}, {hidden}")
    x = torch.randn(n, d, generator=generator, dtype=torch.float64)
    x = x / x.norm(dim=1, keepdim=True)
    u = torch.randn(hidden, d, generator=generator, dtype=torch.float64) / d ** 0.5
    v = torch.randn(hidden, generator=generator, dtype=torch.float64)
    y = torch.relu(d ** 0.5 * x @ u.T) @ v
    y = (y - y.mean()) / y.std() if n > 1 else y - y.mean()
    return x.to(dtype), y.to(dtype)


def communities_regression(path: str, n: int = 100, dtype=torch.float32) -> Tuple[Tensor, Tensor]:
    """The first n rows of the UCI Communities and Crime file ``communities.data`` (paper 001 §5;
    nothing downloads: give the local file): its numeric predictive columns without missing
    values ('?'), each row scaled to ‖x_i‖ = 1, the last column (ViolentCrimesPerPop)
    standardised as the target. The first five columns (state, county, community, name, fold)
    are not predictive and are dropped."""
    import csv
    import os

    if not os.path.isfile(path):
        raise ValueError(f"communities_regression: {path!r} is not a file (expected UCI communities.data)")
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    if len(rows) < n or any(len(r) != len(rows[0]) for r in rows) or len(rows[0]) < 7:
        raise ValueError(f"communities_regression: {path!r} must hold >= {n} rows of one length >= 7 "
                         "(5 non-predictive columns, features, the target last)")
    rows = rows[:n]
    cols = [j for j in range(5, len(rows[0]) - 1) if all(r[j].strip() != "?" for r in rows)]
    try:
        x = torch.tensor([[float(r[j]) for j in cols] for r in rows], dtype=torch.float64)
        y = torch.tensor([float(r[-1]) for r in rows], dtype=torch.float64)
    except ValueError as e:
        raise ValueError(f"communities_regression: {path!r} has a non-numeric value: {e}") from None
    x = x / x.norm(dim=1, keepdim=True).clamp_min(1e-12)
    y = (y - y.mean()) / y.std() if n > 1 else y - y.mean()
    return x.to(dtype), y.to(dtype)


def signal_noise(n: int, d: int, sigma_n: float, *, num_classes: int = 2, mu: float = 1.0,
                 signed: bool = False, swap_patches: bool = True,
                 generator: Optional[torch.Generator] = None, dtype=torch.float32) -> Tuple[Tensor, Tensor]:
    """The signal + noise data of paper 002 (Definition 2.1): x = [x_1, x_2] with one patch the
    signal μ e_y and the other Gaussian noise ξ ~ N(0, σ_n² I_d).

    Returns x of shape [n, 2, d] (the two patches) and labels y in {0, ..., num_classes-1}.
    ``signed=True`` is §5.1's binary variant: two classes with signals −μ e_1 and +μ e_1
    (x_1 = y e_1 for y = ±1). ``swap_patches``: with probability ½ the signal goes to the second
    patch (Definition 2.1, step 3); §5.1 always puts it first (``swap_patches=False``).
    """
    if signed and num_classes != 2:
        raise ValueError("signal_noise: signed=True is the binary setting, num_classes must be 2")
    if not signed and num_classes > d:
        raise ValueError(f"signal_noise: num_classes={num_classes} signals e_y need d >= num_classes, got d={d}")
    y = torch.randint(0, num_classes, (n,), generator=generator)
    noise = torch.randn(n, d, generator=generator, dtype=torch.float64) * sigma_n
    signal = torch.zeros(n, d, dtype=torch.float64)
    if signed:
        signal[:, 0] = mu * (2.0 * y - 1.0)
    else:
        signal[torch.arange(n), y] = mu
    x = torch.stack([signal, noise], dim=1)
    if swap_patches:
        swap = torch.rand(n, generator=generator) < 0.5
        x[swap] = x[swap].flip(1)
    return x.to(dtype), y


def ackley_data(n: int, d: int, generator: torch.Generator):
    """Paper 004 §6.1's Ackley regression problem. The paper does not say how x is drawn; we draw
    x ~ N(0, I_d) and normalise ‖x_i‖ = 1 as §2.1 assumes, then
    y_i = Σ_{d'} x_{i,d-d'} (log|x_{i,d'}| (cos x_{i,d'} + x_{i,d'}³ sin x_{i,d'}) + sqrt|x_{i,d'}|),
    pairing coordinate j with coordinate d-1-j (0-based)."""
    x = torch.randn(n, d, generator=generator, dtype=torch.float64)
    x = x / x.norm(dim=1, keepdim=True)
    a = x.abs()
    f = torch.log(a) * (torch.cos(x) + x.pow(3) * torch.sin(x)) + a.sqrt()
    y = (x.flip(1) * f).sum(1, keepdim=True)
    return x, y
