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


def synthetic_images(n: int, num_classes: int, seed: int = 0, stream: int = 0, *, size: int = 32,
                     prototypes: int = 6, shift: int = 4, noise: float = 100.0,
                     distractor: float = 1.0) -> Tuple[Tensor, Tensor]:
    """``n`` class-conditional CIFAR-shaped images (uint8 ``[n, 3, size, size]``) and their labels
    (int64, every class equally often up to one), generated in memory: a stand-in for CIFAR-10/100
    when the real files are not at hand (``synthetic_cifar10`` / ``synthetic_cifar100``).

    Each class has ``prototypes`` smooth colour images (random fields at 4x4 and 8x8, bicubically
    upsampled, each with its own colour), drawn from ``seed`` alone, so every ``stream`` (train 0, test 1)
    shares them. An image is ``a * P + b * Q`` shifted by up to ``shift`` pixels, where P is one of
    its class's prototypes, Q one of another class's (the distractor), a ~ U(0.5, 1.5),
    b ~ U(0, ``distractor``), plus uniform pixel noise of width ``noise`` (in 0..255 units). The
    shifts ask for a convolution, the distractor makes some images ambiguous: a small CNN learns
    far above chance in an epoch or two but cannot reach 100%. Deterministic for (seed, stream, n)
    on every platform (torch and numpy's PCG64 generators); 1-2 s for 60000 images on one CPU core.
    """
    import numpy as np
    import torch.nn.functional as F

    if n < 0 or num_classes < 1 or size < 1 or prototypes < 1 or shift < 0:
        raise ValueError(f"synthetic_images: need n >= 0, num_classes >= 1, size >= 1, prototypes >= 1 and "
                         f"shift >= 0, got n={n}, num_classes={num_classes}, size={size}, "
                         f"prototypes={prototypes}, shift={shift}")
    if seed < 0 or stream < 0:
        raise ValueError(f"synthetic_images: seed and stream must be >= 0, got {seed} and {stream}")
    K, C = prototypes, num_classes
    P, big, W = C * K, size + 2 * shift, 2 * shift + 1
    seeds = lambda *key: int(np.random.SeedSequence(list(key)).generate_state(1, np.uint64)[0])  # noqa: E731
    g = torch.Generator().manual_seed(seeds(seed))
    bank = sum(F.interpolate(torch.randn(P, 3, r, r, generator=g), size=(big, big), mode="bicubic",
                             align_corners=False) for r in (4, 8))
    bank = bank / bank.flatten(1).std(1).view(-1, 1, 1, 1)
    bank = (bank + torch.randn(P, 3, 1, 1, generator=g)).contiguous()
    # every (prototype, dy, dx) window of the bank as one view: sample i reads windows[p, dy, dx]
    windows = bank.view(-1).as_strided((P, W, W, 3, size, size), (3 * big * big, big, 1, big * big, big, 1))

    g = torch.Generator().manual_seed(seeds(seed, stream))
    pixels = np.random.default_rng([seed, stream])
    y = (torch.arange(n) % C)[torch.randperm(n, generator=g)]
    x = torch.empty(n, 3, size, size, dtype=torch.uint8)
    chunk = 256  # a chunk's float images stay in cache through the few passes below
    for a in range(0, n, chunk):
        yy = y[a:a + chunk]
        m = len(yy)
        mine = yy * K + torch.randint(0, K, (m,), generator=g)
        other = ((yy + torch.randint(1, C, (m,), generator=g)) % C) * K + torch.randint(0, K, (m,), generator=g) \
            if C > 1 else mine
        dy, dx = torch.randint(0, W, (2, m), generator=g)
        ca = 0.5 + torch.rand(m, 1, 1, 1, generator=g)
        cb = distractor * torch.rand(m, 1, 1, 1, generator=g) if C > 1 else torch.zeros(m, 1, 1, 1)
        img = windows[mine, dy, dx].mul_(ca).addcmul_(windows[other, dy, dx], cb)
        img.mul_(40.0).add_(128.0 - noise / 2 + 0.5)  # + 0.5: the uint8 cast below truncates
        u = torch.frombuffer(bytearray(pixels.bytes(m * 3 * size * size)), dtype=torch.uint8)
        img.add_(u.view(m, 3, size, size), alpha=noise / 255.0)
        x[a:a + m].copy_(img.clamp_(0, 255))
    return x, y
