"""SubnetMLP.compact: a round's subnetworks as dense compact modules, compacted once and written
back once (issue 19 item 3), equal to extract_all / subnet_forward / aggregate_."""
import pytest
import torch

from ist_kernels.nn import SubnetMLP
from ist_kernels.nn.subnet import CompactSubnetMLP
from ist_kernels.partition import categorical_partition, round_generator
from ist_kernels.train import paper001 as simulated


def make(depth, bias, train_output, width=24, S=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    model = SubnetMLP(7, width, depth, 2, bias=bias, train_output=train_output, generator=g, dtype=torch.float64)
    neurons = [[categorical_partition(width, S, round_generator(seed=seed, round=l))[s] for l in range(depth)]
               for s in range(S)]
    x = torch.randn(16, 7, generator=g, dtype=torch.float64)
    y = torch.randn(16, 2, generator=g, dtype=torch.float64)
    return model, neurons, x, y


CASES = [(1, False, False), (1, True, True), (2, True, False), (3, False, True)]


@pytest.mark.parametrize("depth,bias,train_output", CASES)
def test_compact_modules_equal_extract_and_subnet_forward(depth, bias, train_output):
    model, neurons, x, _ = make(depth, bias, train_output)
    params = model.extract_all(neurons)
    with torch.no_grad():
        rnd = model.compact(neurons)
        for s, mod in enumerate(rnd.modules):
            assert isinstance(mod, CompactSubnetMLP)
            assert all(torch.equal(a, b) for a, b in zip(rnd.params[s], params[s]))
            got = mod(x)
            want = model.subnet_forward(x, params[s], neurons[s])
            if train_output:
                assert torch.equal(got, want)  # the same dense GEMMs
            else:  # the fixed output through subnet_linear there, a compact dense GEMM here
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("depth,bias,train_output", CASES)
def test_a_round_equals_extract_train_aggregate(depth, bias, train_output):
    model, neurons, x, y = make(depth, bias, train_output)
    ref = SubnetMLP(7, 24, depth, 2, bias=bias, train_output=train_output, dtype=torch.float64)
    ref.load_state_dict(model.state_dict())
    steps, lr = 3, 0.05
    # reference: the existing path (extract_all, local_train on subnet_forward, aggregate_)
    params = ref.extract_all(neurons)
    for p, n in zip(params, neurons):
        simulated.local_train(ref, p, n, x, y, steps, lr)
    ref.aggregate_([[p.detach() for p in ps] for ps in params], neurons)
    # compact: dense modules trained in place, written back on leaving the block
    with model.compact(neurons) as rnd:
        for mod in rnd.modules:
            opt = torch.optim.SGD(mod.parameters(), lr=lr)
            for _ in range(steps):
                opt.zero_grad()
                simulated.regression_loss(mod(x), y).backward()
                opt.step()
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)


def test_write_back_is_aggregate_bit_for_bit():
    model, neurons, _, _ = make(2, True, True)
    ref = SubnetMLP(7, 24, 2, 2, bias=True, train_output=True, dtype=torch.float64)
    ref.load_state_dict(model.state_dict())
    rnd = model.compact(neurons)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for ps in rnd.params:
            for p in ps:
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    ref.aggregate_([[p.clone() for p in ps] for ps in rnd.params], neurons)
    rnd.write_back()
    for a, b in zip(model.state_dict().values(), ref.state_dict().values()):
        assert torch.equal(a, b)


def test_no_write_back_on_error_and_refresh():
    model, neurons, _, _ = make(1, False, True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match="boom"):
        with model.compact(neurons) as rnd:
            with torch.no_grad():
                rnd.params[0][0].add_(1.0)
            raise RuntimeError("boom")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    rnd.refresh()  # the model's values again, into the same tensors
    fresh = model.extract_all(neurons)
    assert all(torch.equal(a, b) for ps, qs in zip(rnd.params, fresh) for a, b in zip(ps, qs))
    with pytest.raises(ValueError, match="at least one subnetwork"):
        model.compact([])
