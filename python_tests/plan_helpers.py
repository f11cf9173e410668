"""What the partition tests share: float64 models with weights large enough that every term shows,
and an IST plan's aggregation round trip."""
import torch

from ist_kernels.partition import input_scale

TOL = dict(rtol=1e-12, atol=1e-12)


def noisy(m, seed=0):
    """``m`` in float64, eval mode, its weights moved by 0.1 N(0, 1) (larger than the inits')."""
    torch.manual_seed(seed)
    m = m.double().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return m


def aggregation_round_trip(model, plan, x, fwd=lambda m, x: m(x)):
    """Aggregation writes every owned slice back (+s+1 from subnetwork s) and shared tensors as the
    mean; the model keeps its shapes and still runs, and so do the next subnetworks."""
    S = plan.num_subnetworks
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    subs = plan.build()
    with torch.no_grad():
        for s, sub in enumerate(subs):
            for p in sub.module.parameters():
                p.add_(s + 1.0)
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    now = {k: v.clone() for k, v in plan.model_tensors().items()}
    expected = {}
    for t in plan.partitioned:
        g = now[t.name]
        for s in range(S):
            g.index_copy_(t.dim, t.owners[s], g.index_select(t.dim, t.owners[s]) + s + 1.0)
        expected[t.name] = g
    for t in plan.shared:
        expected[t.name] = now[t.name] + (S + 1) / 2 if t.name in params else now[t.name]
    plan.aggregate(subs)
    assert {k: v.shape for k, v in model.state_dict().items()} == shapes
    got = plan.model_tensors()
    for k, v in expected.items():
        torch.testing.assert_close(got[k], v, **TOL)
    assert all(input_scale(model.get_submodule(n)) == 1 / S for n in plan.output_projections())
    fwd(model, x)
    for sub in plan.build():
        fwd(sub.module, x)


def zero_except(w, dim, keep):
    """Zero ``w`` in place along ``dim`` except at the indices ``keep`` (a reference's removed units)."""
    mask = torch.zeros(w.shape[dim], dtype=torch.bool)
    mask[keep] = True
    shape = [1] * w.dim()
    shape[dim] = -1
    w.mul_(mask.view(shape).to(w.dtype))
