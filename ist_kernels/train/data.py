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
