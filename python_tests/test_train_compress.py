"""Compressed communication (``ist-train --compress {none,bf16,int8}``, issue 18 item 8): the
encodings against float64 references written from the math, the byte counts in both conventions,
the option, simulated == distributed (2 gloo ranks) bit for bit with compression on, and resume."""
import functools

import pytest
import torch

from ist_kernels.distributed import compress as C, plan_bytes, ps_bytes
from ist_kernels.partition.plan import SlicePlan, TensorSlices
from ist_kernels.train import cli
from ist_kernels.train.config import COMPRESS, TrainConfig

from train_helpers import TINY_MLP, assert_equal_states, outputs, run as _run, untimed

run = functools.partial(_run, base=TINY_MLP)


# ---------------------------------------------------------------- float64 references from the math

def int8_ref(x: torch.Tensor, groups) -> torch.Tensor:
    """Each group (a list of index tuples into x, as a boolean mask) quantised with scale = absmax /
    127, q = round(x / scale) clamped to [-127, 127], dequantised q * scale; in float64."""
    x = x.double()
    out = x.clone()
    for m in groups:
        v = x[m]
        scale = v.abs().max() / 127
        q = torch.zeros_like(v) if scale == 0 else torch.clamp(torch.round(v / scale), -127, 127)
        out[m] = q * scale
    return out


def slice_masks(shape, dim):
    return [torch.zeros(shape, dtype=torch.bool).index_fill_(dim, torch.tensor([i]), True) for i in range(shape[dim])]


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_int8_per_slice_is_the_math(dim):
    g = torch.Generator().manual_seed(dim)
    x = torch.randn(3, 5, 4, generator=g) * torch.tensor([1.0, 1e-3, 10.0, 0.0, 2.0]).view(1, 5, 1)
    got = C.fake_(x.clone(), dim, "int8")
    ref = int8_ref(x, slice_masks(x.shape, dim))
    for m in slice_masks(x.shape, dim):  # |error| <= scale / 2 (+ fp32 rounding)
        scale = x[m].abs().max().double() / 127
        assert (got[m].double() - ref[m]).abs().max() <= 1e-6 * max(scale, 1e-30) * 127
        assert (got[m].double() - x[m].double()).abs().max() <= scale / 2 * (1 + 1e-5) + 1e-30
    assert torch.equal(C.fake_(torch.zeros(2, 3), 0, "int8"), torch.zeros(2, 3))  # scale 0: no NaN
    one = torch.randn(4, 1, generator=g)  # slices of one element travel exactly
    assert torch.equal(C.fake_(one.clone(), 0, "int8"), one)


def test_bf16_is_a_cast():
    x = torch.randn(100, generator=torch.Generator().manual_seed(1))
    assert torch.equal(C.fake_(x.clone(), 0, "bf16"), x.to(torch.bfloat16).float())
    assert not torch.equal(C.fake_(x.clone(), 0, "bf16"), x)


@pytest.mark.parametrize("compress", ["int8", "bf16"])
@pytest.mark.parametrize("S", [2, 3])
def test_two_stage_mean_is_quantise_average_quantise(compress, S):
    g = torch.Generator().manual_seed(S)
    sizes = [7, 1, 12, 5]
    flats = [torch.randn(sum(sizes), generator=g) * (k + 1) for k in range(S)]
    got = C.two_stage_mean(flats, sizes, compress)
    segs = [s for chunk in C.chunk_segments(sizes, S) for s in chunk]
    masks = []
    for a, b in segs:
        m = torch.zeros(sum(sizes), dtype=torch.bool)
        m[a:b] = True
        masks.append(m)

    def q(x):
        return int8_ref(x, masks) if compress == "int8" else x.double().to(torch.bfloat16).double()

    ref = q(torch.stack([q(f) for f in flats]).mean(0))
    tol = 4 * torch.finfo(torch.float32).eps * torch.stack(flats).abs().max()
    if compress == "int8":  # the fp32 mean may round a value across a code boundary: one step at most
        steps = torch.stack([ref[m].abs().max() / 127 for m in masks]).max()
        assert (got.double() - ref).abs().max() <= steps + tol
        assert ((got.double() - ref).abs() > tol).float().mean() < 0.05
    else:
        assert (got.double() - ref).abs().max() <= 2 ** -7 * ref.abs().max()
    # every chunk segment lies inside one tensor and the segments tile the buffer
    bounds = [0, 7, 8, 20, 25]
    assert [a for a, _ in segs] == sorted(a for a, _ in segs) and segs[0][0] == 0 and segs[-1][1] == 25
    assert all(any(lo <= a and b <= hi for lo, hi in zip(bounds, bounds[1:])) for a, b in segs)
    for f in flats:  # the inputs are not changed
        assert f.dtype == torch.float32


def test_byte_counts_both_conventions():
    # a tensor of 10 slices of 12 elements (dim 0) and a shared tensor of 6; S = 2, every slice moves
    S = 2
    spec = {"w": ((10, 12), torch.float32), "b": ((6,), torch.float32)}
    cur = SlicePlan(S, (TensorSlices("w", 0, (torch.arange(0, 5), torch.arange(5, 10))), TensorSlices("b", None)))
    nxt = SlicePlan(S, (TensorSlices("w", 0, (torch.arange(5, 10), torch.arange(0, 5))), TensorSlices("b", None)))
    none = plan_bytes(cur, nxt, spec)
    assert none[0].all_to_all_bytes_sent == 5 * 12 * 4 and none[0].all_reduce_bytes == 6 * 4
    int8 = plan_bytes(cur, nxt, spec, compress="int8")
    assert int8[0].all_to_all_bytes_sent == 5 * (12 + 4)  # codes + one fp32 scale per slice
    # the shared tensor: the other rank's chunk of 3 encoded (3 codes + a scale), then this rank's mean chunk
    assert int8[0].average_bytes_sent == C.two_stage_bytes([6], S, "int8")[0] == 2 * (3 + 4)
    assert int8[0].bytes_sent == 5 * 16 + 14
    bf16 = plan_bytes(cur, nxt, spec, compress="bf16")
    assert bf16[0].bytes_sent == 5 * 12 * 2 + 2 * 3 * 2
    assert none[0].bytes_sent == 5 * 48 + 24  # ring: 2 (S - 1) / S of 24
    # parameter-server convention: each worker up- and downloads its 5 slices and the shared tensor
    assert ps_bytes(cur, spec) == [2 * (5 * 48 + 24)] * 2
    assert ps_bytes(cur, spec, compress="int8") == [2 * (5 * 16 + 6 + 4)] * 2
    assert ps_bytes(cur, spec, compress="bf16") == [2 * (5 * 24 + 12)] * 2
    # int8 is about a quarter of fp32 for large slices
    big = {"w": ((64, 1024), torch.float32), "b": ((1,), torch.float32)}
    c2 = SlicePlan(S, (TensorSlices("w", 0, (torch.arange(0, 32), torch.arange(32, 64))), TensorSlices("b", None)))
    n2 = SlicePlan(S, (TensorSlices("w", 0, (torch.arange(32, 64), torch.arange(0, 32))), TensorSlices("b", None)))
    ratio = plan_bytes(c2, n2, big, compress="int8")[0].bytes_sent / plan_bytes(c2, n2, big)[0].bytes_sent
    assert 0.25 < ratio < 0.252
    # local SGD's average: 2 (S - 1) / S of the buffer encoded, plus a scale per chunk segment
    sizes = [1000, 24]
    for S in (2, 4):
        per = C.two_stage_bytes(sizes, S, "int8")
        ring = 2 * (S - 1) / S * 4 * sum(sizes)
        assert all(0.25 <= p / ring < 0.26 for p in per), (per, ring)
        assert sum(C.two_stage_bytes(sizes, S, "bf16")) == S * ring / 2


# ---------------------------------------------------------------- the option

def test_option_help_default_choices_and_errors(capsys):
    assert COMPRESS == C.COMPRESS
    help_text = cli._parser().format_help()
    assert "--compress {none,bf16,int8}" in help_text and "(default: none)" in help_text.split("--compress")[1]
    assert TrainConfig().compress == "none"
    assert cli.main(["--compress", "int4", "--simulate", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "compress" in err and "none, bf16, int8" in err and "'int4'" in err
    assert cli.main(["--method", "ddp", "--compress", "int8", "--simulate", "2", "--no-progress"]) == 2
    assert "ddp" in capsys.readouterr().err
    # DiLoCo's pseudo-gradient codec is --compress (its outer_grad option folded into it)
    assert cli.main(["--method", "diloco", "--option", "outer_grad=int8", "--simulate", "2", "--no-progress"]) == 2
    assert "outer_grad" in (err := capsys.readouterr().err) and "--compress" in err
    assert cli.main(["--method", "resist", "--compress", "bf16", "--outer-optimizer", "nesterov", "--simulate", "2",
                     "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "compress" in err and "outer-optimizer" in err


# ---------------------------------------------------------------- simulated == distributed (gloo), resume

IST = ["--method", "ist", "--rounds", 3]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """ist with its local-SGD baseline (--baseline: one launch runs both), --compress int8, simulated
    and on 2 gloo ranks; and the same uncompressed, simulated: {mode: {method: outputs}}."""
    root = tmp_path_factory.mktemp("compress")
    out = {}
    for mode, args in (("sim", ["--simulate", 2, "--compress", "int8"]), ("dist", ["--workers", 2, "--compress", "int8"]),
                       ("plain", ["--simulate", 2])):
        assert cli.main([*TINY_MLP, *map(str, IST), "--baseline", "--device", "cpu", "--out-dir", str(root / mode),
                         *map(str, args)]) == 0
        out[mode] = {m: outputs(root / mode / m) for m in ("ist", "localsgd")}
    out["root"] = root
    return out


@pytest.mark.parametrize("method", ["ist", "localsgd"])
def test_int8_distributed_equals_simulated(runs, method):
    (s_sum, s_model, s_hist), (d_sum, d_model, d_hist) = runs["sim"][method], runs["dist"][method]
    assert (s_sum["mode"], d_sum["mode"]) == ("simulated", "distributed")
    assert s_sum["compress"] == d_sum["compress"] == "int8"
    assert f"| {method} (int8) " in (runs["root"] / "dist" / "summary.md").read_text()
    assert_equal_states(s_model, d_model)
    assert untimed(s_hist) == untimed(d_hist)  # losses, accuracies and bytes (both conventions), round by round
    p_sum, p_model, p_hist = runs["plain"][method]
    # compression changes the model (the test would prove nothing otherwise), a little
    assert any(not torch.equal(s_model[k], p_model[k]) for k in s_model)
    assert abs(s_sum["accuracy"] - p_sum["accuracy"]) < 0.1
    for a, b in zip(s_hist[1:], p_hist[1:]):
        if method == "localsgd":  # 2 (S - 1) / S of the model at a byte a value, a scale per segment
            assert 0.25 <= a["bytes_sent"] / b["bytes_sent"] < 0.26
            assert 0.25 <= a["ps_bytes"] / b["ps_bytes"] < 0.26
        else:  # width 16: a neuron moves 64 + 10 weights (a scale each) and its fp32 bias
            if b["bytes_sent"] > 200:  # (the last round moves only the shared output bias)
                assert 0.25 < a["bytes_sent"] / b["bytes_sent"] < 0.35
            assert 0.25 < a["ps_bytes"] / b["ps_bytes"] < 0.35


def test_resume_is_exact_with_compression(tmp_path, runs):
    args = [*IST, "--simulate", 2, "--compress", "int8", "--checkpoint-interval", 1]
    run(tmp_path / "r", *args, "--stop-after", 1)
    _, model, hist = run(tmp_path / "r", *args, "--resume")
    assert_equal_states(model, runs["sim"]["ist"][1])
    assert untimed(hist) == untimed(runs["sim"]["ist"][2])
    # the compression must not change on resume
    assert cli.main([*TINY_MLP, "--out-dir", str(tmp_path / "r"), "--device", "cpu", *map(str, IST),
                     "--simulate", "2", "--resume", "--compress", "bf16"]) == 2


# ---------------------------------------------------------------- the cost model and the speed experiment

def test_cost_model_counts_compressed_bytes():
    from ist_kernels.distributed import cost

    S = 2
    spec = {"w": ((64, 1024), torch.float32), "b": ((1000,), torch.float32)}
    cur = SlicePlan(S, (TensorSlices("w", 0, (torch.arange(0, 32), torch.arange(32, 64))), TensorSlices("b", None)))
    nxt = SlicePlan(S, (TensorSlices("w", 0, (torch.arange(32, 64), torch.arange(0, 32))), TensorSlices("b", None)))
    for comp in ("int8", "bf16"):
        st = plan_bytes(cur, nxt, spec, compress=comp)
        assert cost.exchange_bytes(cur, nxt, spec, compress=comp) == [
            (s.all_to_all_bytes_sent + s.average_bytes_sent, s.all_to_all_bytes_received + s.average_bytes_received, 0)
            for s in st]
    assert cost.exchange_bytes(cur, nxt, spec) == cost.exchange_bytes(cur, nxt, spec, compress="none")
    assert cost.localsgd_round_bytes(4e6, 4, "int8") == cost.localsgd_round_bytes(4e6, 4) / 4
    assert cost.localsgd_round_bytes(4e6, 4, "bf16") == cost.localsgd_round_bytes(4e6, 4) / 2
    plain, small = cost.subnet_round_bytes(8e6, 1e6, 4, 2.0), cost.subnet_round_bytes(8e6, 1e6, 4, 2.0, "int8")
    assert small["wire"] == plain["wire"] / 4 and small["all_to_all"] == plain["all_to_all"] / 4
    with pytest.raises(ValueError, match="compress"):
        cost.wire_fraction("int4")


def test_speed_runs_compressed_rows():
    from ist_kernels.experiments import speed

    quick = speed.parse(["--quick"])
    todo, _ = speed.cells(quick)
    compressed = {(c[3], c[4]) for c in todo if c[4] != "none"}
    assert compressed == {("resist", "int8")}  # --quick: one compressed method, beside its uncompressed run
    assert all((c[0], c[1], c[2], c[3], "none", c[5]) in todo for c in todo)
    full = speed.parse([])
    todo, _ = speed.cells(full)
    methods = {c[3] for c in todo}
    for m in methods - {"ddp"}:
        assert {c[4] for c in todo if c[3] == m} == {"none", "int8", "bf16"}, m
    assert {c[4] for c in todo if c[3] == "ddp"} <= {"none"}
    with pytest.raises(SystemExit):
        speed.parse(["--compress", "int4"])
