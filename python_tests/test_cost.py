"""The cost model (ist_kernels.distributed.cost) against byte counts from real plans and
independent arithmetic; the time-to-target bookkeeping."""
import copy
import math
import warnings

import pytest
import torch

from ist_kernels.distributed import cost
from ist_kernels.models import preact_resnet18, preact_resnet101_basic
from ist_kernels.partition import loft_plan, resist_plan
from ist_kernels.train.comm import all_reduce_wire_bytes
from ist_kernels.train.rounds import payoff, state_split


def _spec(model):
    return {n: (tuple(t.shape), t.dtype) for n, t in model.state_dict().items()}


def test_link_rejects_bad_values():
    for kw, word in [(dict(bandwidth_bps=0), "bandwidth_bps"), (dict(bandwidth_bps=-1.0), "bandwidth_bps"),
                     (dict(latency_s=-1e-3), "latency_s"), (dict(efficiency=1.5), "efficiency")]:
        with pytest.raises(ValueError, match=word):
            cost.Link(**kw)


def test_transfer_and_collective_times():
    link = cost.Link(100e6, 0.001, efficiency=1.0)
    assert cost.Link().transfer_s(1e9) == 0.0  # unlimited
    assert link.transfer_s(12.5e6) == pytest.approx(1.0)
    # ring: 2 (S-1)/S of the buffer each way, 2 (S-1) latencies
    assert cost.ring_all_reduce_s(12.5e6, 4, link) == pytest.approx(1.5 + 6 * 0.001)
    assert cost.ring_all_reduce_s(12.5e6, 1, link) == 0.0
    # all-to-all: the link carries the larger of in and out, one latency
    assert cost.all_to_all_s(12.5e6, 25e6, link) == pytest.approx(2.0 + 0.001)
    per_rank = [(1e6, 2e6, 5e6), (3e6, 1e6, 5e6)]
    assert cost.exchange_s(per_rank, 2, link) == pytest.approx(
        (3e6 * 8 / 100e6 + 0.001) + (5e6 * 8 / 100e6 + 2 * 0.001))
    # TCP payload over Ethernet frames at MTU 1500
    assert cost.TCP_EFFICIENCY == pytest.approx(1448 / 1514)
    assert cost.Link(1e9).transfer_s(1e9) == pytest.approx(8 / cost.TCP_EFFICIENCY)


@pytest.mark.parametrize("S", [2, 3, 4, 8, 1024])
def test_ring_bytes_match_the_trainers_convention(S):
    n = 10_000_003 * 4
    assert cost.ring_all_reduce_bytes(n, S) == pytest.approx(all_reduce_wire_bytes(n, S), abs=1)
    assert cost.localsgd_round_bytes(n, S) == cost.ring_all_reduce_bytes(n, S)


@pytest.mark.parametrize("S", [2, 4, 8])
def test_subnet_bytes_match_loft_plans(S):
    """One owner per filter: the formula is what every rank's Exchange sends, on average over the
    ranks and two plan pairs, within 10%; the shared all-reduce buffer exactly."""
    model = preact_resnet18(10, 3, 8)
    spec, names = _spec(model), [n for n, _ in model.named_parameters()]
    got = []
    for seed in (1, 3):
        a = loft_plan(model, S, torch.Generator().manual_seed(seed)).slices
        b = loft_plan(model, S, torch.Generator().manual_seed(seed + 1)).slices
        per = cost.exchange_bytes(a, b, spec)
        split = state_split(a, spec, names, False)
        got += [p[0] for p in per]
        assert all(p[2] == pytest.approx(split["shared_state_bytes"], rel=1e-3) for p in per)
    want = cost.subnet_round_bytes(split["partitioned_state_bytes"], split["shared_state_bytes"], S)
    assert sum(got) / len(got) == pytest.approx(want["all_to_all"], rel=0.10)
    # and the formula is the engine's payoff estimate
    ratio = want["wire"] / cost.localsgd_round_bytes(sum(split.values()), S)
    assert ratio == pytest.approx(payoff(split, S)[1], rel=1e-9)


@pytest.mark.parametrize("S", [2, 8, 16])
def test_subnet_bytes_match_resist_plans_with_shared_blocks(S):
    """ResIST deals max(min_depth, blocks / S) blocks to each sub-ResNet: past S * min_depth >
    blocks every block has several owners and the exchange grows with their square."""
    model = preact_resnet101_basic(10, 3, 4)
    spec, names = _spec(model), [n for n, _ in model.named_parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plans = [resist_plan(model, S, 5, torch.Generator().manual_seed(s)) for s in range(4)]
    blocks = len(plans[0].partitioned_blocks)
    k = cost.resist_owners(S, blocks, 5)
    assert k == pytest.approx(max(1.0, S * 5 / blocks))
    got = []
    for a, b in zip(plans[:-1], plans[1:]):
        got += [p[0] for p in cost.exchange_bytes(a.slices, b.slices, spec)]
    split = state_split(plans[0].slices, spec, names, False)
    want = cost.subnet_round_bytes(split["partitioned_state_bytes"], split["shared_state_bytes"], S, k)
    assert sum(got) / len(got) == pytest.approx(want["all_to_all"], rel=0.10)


def test_subnet_bytes_and_memory_formulas():
    with pytest.raises(ValueError, match="owners"):
        cost.subnet_round_bytes(100, 10, 4, owners=5)
    b = cost.subnet_round_bytes(1600.0, 100.0, 4)
    assert b["all_to_all"] == pytest.approx(1600 * 3 / 16) and b["wire"] == pytest.approx(300 + 150)
    assert cost.rank_state_bytes(1600, 100, 4) == pytest.approx((400 + 100) * 2)
    assert cost.rank_state_bytes(1600, 100, 4, owners=2, optimizer_copies=0) == pytest.approx(900)


def test_predict_round_and_time_to_target():
    link = cost.Link(8e6, efficiency=1.0)  # 1 MB/s
    r = cost.predict_round(steps=4, step_s=0.25, bytes_per_rank=2e6, link=link, overhead_s=0.5)
    assert (r.compute, r.comm, r.total) == (1.0, pytest.approx(2.0), pytest.approx(3.5))
    assert cost.predict_round(steps=0, step_s=0, bytes_per_rank=1.0, link=link, comm_floor_s=0.3).comm == 0.3
    with pytest.raises(ValueError):
        cost.predict_round(steps=-1, step_s=0, bytes_per_rank=0, link=link)
    secs, acc = [1.0, 2.0, 3.0, 4.0], [0.5, None, 0.9, 0.95]
    assert cost.time_to_target(secs, acc, 0.9) == 6.0
    assert cost.rounds_to_target(acc, 0.9) == 3
    assert cost.time_to_target(secs, acc, 0.99) is None and cost.rounds_to_target(acc, 0.99) is None
    with pytest.raises(ValueError, match="length"):
        cost.time_to_target(secs, acc[:2], 0.5)
    assert cost.speedup(4.0, 2.0) == 2.0 and cost.speedup(None, 2.0) is None and cost.speedup(1.0, 0.0) is None


def test_step_flops_counts_forward_and_backward_on_meta():
    B, I, O = 5, 7, 3
    model = torch.nn.Linear(I, O).to("meta")
    # forward 2BIO; backward: the weight's gradient 2BIO (the input needs none)
    assert cost.step_flops(model, (I,), B) == 4 * B * I * O
    assert math.isfinite(cost.step_flops(preact_resnet18(10, 3, 4).to("meta"), (3, 8, 8), 2))


def test_split_step_flops_splits_the_step_by_partitioned_weights():
    B, I, H, O = 5, 7, 6, 3
    model = torch.nn.Sequential(torch.nn.Linear(I, H), torch.nn.ReLU(), torch.nn.Linear(H, O))
    before = {n: t.clone() for n, t in model.state_dict().items()}
    # layer 0: forward 2BIH + its weight's gradient 2BIH; layer 2: forward, weight and input gradients, 2BHO each
    part, rest = cost.split_step_flops(model, (I,), B, {"0.weight", "0.bias"})
    assert (part, rest) == (4 * B * I * H, 6 * B * H * O)
    assert part + rest == cost.step_flops(copy.deepcopy(model).to("meta"), (I,), B)
    assert cost.split_step_flops(model, (I,), B, {"2.weight"}) == (6 * B * H * O, 4 * B * I * H)
    assert cost.split_step_flops(model, (I,), B, set()) == (0.0, part + rest)
    assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())  # counted on a copy
    assert all(p.grad is None for p in model.parameters())
