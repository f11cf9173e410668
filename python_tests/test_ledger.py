"""The byte ledger (ist_kernels.distributed.ledger, issue 36 item 3): every byte formula against hand
counts, and the modules that used to carry their own copies (the cost model, the exchange, the
codecs, the trainer's Comm) using the ledger's."""
import pytest
import torch
from torch import nn

from ist_kernels.distributed import compress as C, cost, exchange, ledger, quantize
from ist_kernels.partition.plan import SlicePlan, TensorSlices
from ist_kernels.train import comm
from ist_kernels.train.timing import Clock

# ---------------------------------------------------------------- the wire

def test_ring_factor_and_all_reduce_bytes():
    assert ledger.ring_factor(0) == ledger.ring_factor(1) == 0.0
    assert ledger.ring_factor(2) == 1.0 and ledger.ring_factor(4) == 1.5
    assert ledger.ring_factor(1024) == 2 * 1023 / 1024
    # the integer count rounds down: 2 (S - 1) n // S
    assert ledger.all_reduce_wire_bytes(10, 3) == 13  # 40 / 3 = 13.33
    assert ledger.all_reduce_wire_bytes(10, 2) == 10
    assert ledger.all_reduce_wire_bytes(10, 1) == ledger.all_reduce_wire_bytes(10, 0) == 0
    for S in (2, 3, 7, 1000):
        for n in (0, 1, 999, 10_000_003 * 4):
            exact = ledger.ring_all_reduce_bytes(n, S)
            assert exact == ledger.ring_factor(S) * n
            assert 0 <= exact - ledger.all_reduce_wire_bytes(n, S) < 1
    assert ledger.ring_all_reduce_bytes(100.0, 1) == 0.0


def test_split_evenly_gives_the_remainder_to_the_first():
    assert ledger.split_evenly(10, 3) == [4, 3, 3]
    assert ledger.split_evenly(2, 4) == [1, 1, 0, 0]
    assert ledger.split_evenly(0, 3) == [0, 0, 0]
    assert ledger.split_evenly(7, 1) == [7]
    assert ledger.split_evenly(5, 0) == []
    for total in (0, 1, 5, 17, 1000):
        for n in (1, 2, 3, 8):
            parts = ledger.split_evenly(total, n)
            assert sum(parts) == total and max(parts) - min(parts) <= 1
            assert parts == [c.numel() for c in torch.empty(total).tensor_split(n)]  # torch's chunks


def test_comm_count_sent_shares_evenly():
    c = comm.Comm(world_size=3, rank=0, distributed=False, local_workers=[0, 1, 2], shared="all_reduce",
                  clock=Clock())
    c.count_sent(10)
    assert c.sent_by_worker == {0: 4, 1: 3, 2: 3} and c.link_by_worker == {0: 4, 1: 3, 2: 3}
    c.count_all_reduce(10, times=2)  # 2 x 13 each: the integer ring count
    assert c.take()["sent_by_worker"] == {0: 30, 1: 29, 2: 29}


def test_two_stage_and_coded_average_bytes():
    # 10 int8 values among 4 ranks: chunks of 3, 3, 2, 2 values, each with one 4-byte scale
    assert ledger.coded_bytes(10, "fp32") == 40 and ledger.coded_bytes(10, "bf16") == 20
    assert ledger.coded_bytes(10, "int8") == 14 and ledger.coded_bytes(10, "int8", scales=3) == 22
    assert ledger.coded_bytes(10, "bf16", scales=3) == 20
    pay = [7, 7, 6, 6]
    # rank 0 sends the others their chunks of its values (7 + 6 + 6), then its mean chunk to each of the 3
    assert ledger.two_stage_sent(pay, 0) == 19 + 3 * 7 == 40
    assert ledger.two_stage_sent(pay, 3) == 20 + 3 * 6 == 38
    assert ledger.coded_average_bytes(10, 4, 0, "int8") == 40
    # the formula Comm.average_coded_ wrote out: (n - own) e + (S - 1) own e + 2 (S - 1) scales
    for n in (0, 1, 10, 1001):
        for S in (2, 3, 4, 8):
            sizes = ledger.split_evenly(n, S)
            for codec, e, sc in (("bf16", 2, 0), ("int8", 1, 4)):
                for r in range(S):
                    want = (n - sizes[r]) * e + (S - 1) * sizes[r] * e + 2 * (S - 1) * sc
                    assert ledger.coded_average_bytes(n, S, r, codec) == want
    # the compressed average of whole tensors: chunk payloads from the tensors' segments
    assert C.two_stage_bytes([6], 2, "int8") == [2 * (3 + 4)] * 2
    assert C.two_stage_bytes([6], 1, "int8") == [0]


def test_slice_bytes_and_wire_fraction():
    assert ledger.slice_bytes(None, 12, 4) == 48
    assert ledger.slice_bytes("bf16", 12, 4) == 24
    assert ledger.slice_bytes("int8", 12, 4) == 12 + 4
    assert ledger.slice_bytes("int8", 1, 4) == 4  # one value: exactly (a code and a scale would be 5)
    assert ledger.slice_bytes("bf16", 1, 4) == 2
    assert ledger.slice_bytes("int8", 3, 8, floating=False) == 24  # integers travel exactly
    assert [ledger.wire_fraction(c) for c in ("none", None, "bf16", "int8")] == [1.0, 1.0, 0.5, 0.25]
    with pytest.raises(ValueError, match="wire_fraction"):
        ledger.wire_fraction("fp32")


def test_the_modules_use_the_ledgers_formulas():
    """Each formula exists once: the cost model, the exchange's stats, the codecs and the trainer's
    Comm call the ledger's."""
    assert cost.ring_all_reduce_bytes is ledger.ring_all_reduce_bytes
    for name in ("subnet_round_bytes", "localsgd_round_bytes", "diloco_round_bytes", "rank_state_bytes",
                 "wire_fraction"):
        assert getattr(cost, name) is getattr(ledger, name)
    assert comm.all_reduce_wire_bytes is ledger.all_reduce_wire_bytes
    for name in ("slice_bytes", "coded", "check", "SCALE_BYTES", "COMPRESS"):
        assert getattr(C, name) is getattr(ledger, name)
    assert quantize.CODEC_BYTES is ledger.CODEC_BYTES
    from ist_kernels.distributed import ps_bytes
    assert ps_bytes is ledger.ps_bytes
    st = exchange.CommStats(None, 3, all_reduce_bytes=10)
    assert st.all_reduce_wire_bytes == 13 == st.bytes_sent


# ---------------------------------------------------------------- the parameter-server convention

def _plans():
    S = 2
    spec = {"w": ((10, 12), torch.float32), "b": ((6,), torch.float32), "v": ((4,), torch.float32),
            "n": ((), torch.int64)}
    cur = SlicePlan(S, (TensorSlices("w", 0, (torch.arange(0, 5), torch.arange(5, 10))), TensorSlices("b", None),
                        TensorSlices("v", 0, (torch.arange(0, 1), torch.arange(1, 4))), TensorSlices("n", None)))
    nxt = SlicePlan(S, (TensorSlices("w", 0, (torch.arange(0, 3), torch.arange(3, 10))), TensorSlices("b", None),
                        TensorSlices("v", 0, (torch.arange(0, 2), torch.arange(2, 4))), TensorSlices("n", None)))
    return spec, cur, nxt


def test_ps_bytes_against_hand_counts():
    spec, cur, nxt = _plans()
    # worker 0: 5 rows of w (48 bytes each), b whole (24), 1 value of v (4); the int64 counter not counted
    up = [5 * 48 + 24 + 4, 5 * 48 + 24 + 3 * 4]
    assert ledger.subnet_bytes(cur, spec) == up
    assert ledger.ps_bytes(cur, spec) == [2 * u for u in up]
    down = [3 * 48 + 24 + 2 * 4, 7 * 48 + 24 + 2 * 4]
    assert ledger.ps_bytes(cur, spec, download=nxt) == [u + d for u, d in zip(up, down)]
    assert ledger.ps_bytes(cur, spec, names=["w"]) == [2 * 5 * 48] * 2
    # int8: a scale per slice of w, one for b; v's one-value slices stay fp32
    assert ledger.subnet_bytes(cur, spec, compress="int8") == [5 * (12 + 4) + (6 + 4) + 4,
                                                               5 * (12 + 4) + (6 + 4) + 3 * 4]
    assert ledger.ps_bytes(cur, spec, compress="bf16") == [2 * (5 * 24 + 12 + 2), 2 * (5 * 24 + 12 + 3 * 2)]
    assert ledger.ps_bytes(cur, spec, compress="none") == ledger.ps_bytes(cur, spec)
    meta = {n: torch.empty(shape, dtype=dt, device="meta") for n, (shape, dt) in spec.items()}
    assert ledger.ps_bytes(cur, meta) == ledger.ps_bytes(cur, spec)  # a spec of (meta) tensors
    with pytest.raises(ValueError, match="ps_bytes"):
        ledger.ps_bytes(cur, spec, compress="int4")


def test_ps_model_bytes():
    ts = [torch.zeros(3, 4), torch.zeros(2, dtype=torch.int64)]
    assert ledger.ps_model_bytes(ts) == 2 * (48 + 16)
    assert ledger.ps_model_bytes(ts, "bf16") == 2 * (24 + 16)
    assert ledger.ps_model_bytes(ts, "int8") == 2 * (12 + 4 + 16)
    c = comm.Comm(world_size=2, rank=0, distributed=False, local_workers=[0, 1], shared="all_reduce",
                  clock=Clock(), compress="int8")
    assert c.model_ps_bytes(ts) == ledger.ps_model_bytes(ts, "int8")


# ---------------------------------------------------------------- held state

def test_held_bytes_counts_each_tensor_once():
    a = nn.Linear(4, 3)  # 12 + 3 floats
    b = nn.Linear(4, 3)
    b.weight = a.weight  # tied
    assert ledger.held_bytes(a) == 60
    assert ledger.held_bytes(a, b) == 60 + 12
    assert ledger.held_bytes(a, a.weight, a.weight.data, [a.bias, {"again": (a.bias,)}]) == 60
    t = torch.zeros(10)
    assert ledger.held_bytes(t[:5], t[5:]) == 40  # two views of one storage: different elements
    assert ledger.held_bytes(t, t[:5]) == 60  # a view counts as its own elements
    assert ledger.held_bytes(None, [], {}) == 0
    assert ledger.held_bytes({"x": [torch.zeros(2, dtype=torch.float64), (torch.zeros(3, dtype=torch.int8),)]}) == 19


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))


def _step(model, opt):
    model(torch.randn(5, 4)).sum().backward()
    opt.step()


@pytest.mark.parametrize("which", ["sgd", "adamw"])
def test_held_bytes_of_optimizer_state_and_full_state_bytes(which):
    model = _net()
    # parameters: 15 + 6 + 8 = 29 floats (116 bytes) in 6 tensors; buffers: running mean and var (24
    # bytes) and the int64 batch counter (8)
    state_dict = 116 + 24 + 8
    if which == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        want = state_dict + 116  # a momentum buffer per parameter
        assert ledger.full_state_bytes(model, 1) == want
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        want = state_dict + 2 * 116 + 6 * 4  # two moments and a float32 step per parameter tensor
        assert ledger.full_state_bytes(model, 2, 4) == want
    assert ledger.held_bytes(model, opt) == state_dict  # no state before the first step
    _step(model, opt)
    assert ledger.held_bytes(model, opt) == want
    assert ledger.full_state_bytes(model) == ledger.held_bytes(model) == state_dict


def test_full_state_bytes_ties_and_frozen_parameters():
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    model[1].weight = model[0].weight  # tied: counted once, and so is its optimizer state
    assert ledger.full_state_bytes(model, 1) == 2 * 64
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].requires_grad_(False)  # frozen: held, but no optimizer state
    assert ledger.full_state_bytes(model, 2, 4) == (20 + 10) * 4 + 2 * 10 * 4 + 2 * 4


def test_state_split_and_payoff():
    spec, cur, _ = _plans()
    spec = {**spec, "rm": ((6,), torch.float32)}
    plan = SlicePlan(2, (*cur.tensors, TensorSlices("rm", None)))
    # w and v partitioned, b shared; parameters w, b, v (twice with momentum); rm and the counter once
    split = ledger.state_split(plan, spec, ["w", "b", "v"], True)
    assert split == {"partitioned_state_bytes": 2 * (480 + 16), "shared_state_bytes": 2 * 24 + 24 + 8}
    assert ledger.state_split(plan, spec, ["w", "b", "v"], False)["partitioned_state_bytes"] == 480 + 16
    P, Sh = split["partitioned_state_bytes"], split["shared_state_bytes"]
    for S in (2, 4, 16):
        frac, ratio = ledger.payoff(split, S)
        assert frac == P / (P + Sh)
        # a rank sends P (S - 1) / S^2 and 2 (S - 1) / S of the shared part; local SGD 2 (S - 1) / S of all
        assert ratio == pytest.approx((P * (S - 1) / S ** 2 + 2 * (S - 1) / S * Sh) / (2 * (S - 1) / S * (P + Sh)))
    assert ledger.payoff(split, 1) == (0.0, 1.0)
    assert ledger.payoff({"shared_state_bytes": 0, "partitioned_state_bytes": 0}, 4) == (0.0, 1.0)
    assert ledger.payoff({"shared_state_bytes": 0, "partitioned_state_bytes": 8}, 2) == (1.0, 0.25)


# ---------------------------------------------------------------- optimizer moments (momentum_state)

def test_moment_bytes_against_hand_counts_and_the_exchanges_int8():
    """Moments coded block-wise: the parameter-server count by hand (w's rows of 12 values: 12 + 4
    bytes at 8 bits, 6 + 4 at 4; the shared b's 6 values exactly, 24 bytes; v's one-value slices
    exact), and the wire count of 8-bit codes equal to the Exchange's own --compress int8 count of
    the partitioned tensors (one 4-byte scale per slice of <= 256 values: the same bytes) plus the
    shared b exactly, from the routing of the plans."""
    spec, cur, nxt = _plans()
    assert ledger.subnet_bytes(cur, spec, state_code=8) == [5 * 16 + 24 + 4, 5 * 16 + 24 + 3 * 4]
    assert ledger.subnet_bytes(cur, spec, state_code=4) == [5 * 10 + 24 + 4, 5 * 10 + 24 + 3 * 4]
    assert ledger.subnet_bytes(cur, spec, state_code="exact") == ledger.subnet_bytes(cur, spec)
    assert ledger.ps_bytes(cur, spec, download=nxt, state_code=8) == [
        5 * 16 + 24 + 4 + 3 * 16 + 24 + 2 * 4, 5 * 16 + 24 + 3 * 4 + 7 * 16 + 24 + 2 * 4]
    with pytest.raises(ValueError, match="not both"):
        ledger.subnet_bytes(cur, spec, compress="int8", state_code=8)
    for shared in ("exact", "all_reduce"):
        c = comm.Comm(world_size=2, rank=0, distributed=False, local_workers=[0, 1], shared=shared, clock=Clock())
        names = ["w", "b", "v"]
        c.count_exchange(cur, nxt, spec, names=names, state_code=8)
        coded = c.take()
        want = exchange.plan_bytes(cur, nxt, spec, shared=shared, names=["w", "v"], compress="int8")
        if shared == "exact":  # b through the all-to-all, exactly
            exact_b = exchange.plan_bytes(cur, nxt, spec, shared=shared, names=["b"])
            assert coded["sent_by_worker"] == {r: st.bytes_sent + b.bytes_sent
                                               for r, (st, b) in enumerate(zip(want, exact_b))}
        else:  # the shared b through the ring all_reduce, exactly: 2 (S - 1) / S of 24 bytes
            assert coded["sent_by_worker"] == {r: st.all_to_all_bytes_sent + 24 for r, st in enumerate(want)}
        c.count_exchange(cur, nxt, spec, names=names, state_code="exact")
        assert c.take()["sent"] == sum(st.bytes_sent for st in exchange.plan_bytes(cur, nxt, spec, shared=shared,
                                                                                     names=names))


def test_a_products_slices_are_its_elements():
    """A product (rows x cols of a 2-D tensor) is counted one slice per element: 4 bytes each, a
    moment's code or int8 none (one value would cost 5), bf16 2."""
    spec = {"p": ((4, 6), torch.float32)}
    i = torch.tensor
    plan = SlicePlan(2, (TensorSlices("p", 0, (i([1, 2]), i([0, 3])), cols=(i([0, 4, 5]), i([1])), col_dim=1),))
    assert ledger.subnet_bytes(plan, spec) == [6 * 4, 2 * 4]
    assert ledger.subnet_bytes(plan, spec, state_code=8) == ledger.subnet_bytes(plan, spec, compress="int8") == [24, 8]
    assert ledger.subnet_bytes(plan, spec, compress="bf16") == [12, 4]
