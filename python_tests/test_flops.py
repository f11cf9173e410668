"""cost.model_step_flops and cost.subnetwork_step_flops against hand counts written from the
shapes below (a plain MLP, gpt_tiny, a Hugging Face Llama): full model, IST's FFN and head
subnetworks, ResIST's shallower ones. Convention (cost.model_step_flops): a multiply-add is 2 FLOPs,
matrix products and attention's score/value products only, backward = weight and input gradients
(none for the input of a layer reading the data), attention over the whole T x T scores."""
import pytest
import torch
from torch import nn

from ist_kernels.distributed import cost
from ist_kernels.models import gpt_tiny, preact_resnet18
from ist_kernels.models.gpt import gpt_shape
from ist_kernels.partition import loft_plan


def _mlp(I, H, O):
    return nn.Sequential(nn.Linear(I, H), nn.GELU(), nn.Linear(H, O))


def _mlp_step(B, I, H, O):
    # forward 2BIH + 2BHO; backward: both weight gradients, the hidden layer's input gradient 2BHO
    # (the first layer reads the data: no input gradient)
    return 4 * B * I * H + 6 * B * H * O


def test_plain_mlp_full_and_ist_subnetworks():
    B, I, H, O = 4, 10, 12, 3
    model = _mlp(I, H, O)
    x = torch.randn(B, I)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    full = _mlp_step(B, I, H, O)
    assert cost.model_step_flops(model, x) == full
    assert cost.model_step_flops(model, x, meta=False) == full
    assert cost.model_step_flops(model, x) == cost.step_flops(model, (I,), B)  # one FLOP model
    for S in (2, 4):
        assert cost.subnetwork_step_flops(model, "ist", S, {"partition": "ffn"}, x) == [_mlp_step(B, I, H // S, O)] * S
    assert cost.subnetwork_step_flops(model, "ist", 5, None, x) == [_mlp_step(B, I, h, O) for h in (3, 3, 2, 2, 2)]
    for m in ("localsgd", "ddp", "diloco"):
        assert cost.subnetwork_step_flops(model, m, 3, None, x) == [full] * 3
    with pytest.raises(ValueError, match="attention"):
        cost.subnetwork_step_flops(model, "ist", 2, {"partition": "heads"}, x)
    with pytest.raises(ValueError, match="unknown method"):
        cost.subnetwork_step_flops(model, "sgd", 2, None, x)
    assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())  # counted on copies
    assert all(p.grad is None and p.device.type == "cpu" for p in model.parameters())


# gpt_tiny: width 128, 4 blocks, heads of 32 (4 heads), FFN 4 x 128, vocabulary 256 (tied head)
W, D, NH, HD, F, V = 128, 4, 4, 32, 512, 256


def _gpt_step(B, T, depth=D, heads=NH, ffn=F):
    """3 x the forward: embeddings first, so every product's input gradient is computed."""
    N = B * T
    a = heads * HD  # the heads' width
    per_block = N * (2 * W * 3 * a + 2 * a * W + 2 * W * ffn + 2 * ffn * W) + B * heads * 2 * (2 * T * T * HD)
    return 3 * (depth * per_block + N * 2 * W * V)


def test_gpt_tiny_full_ist_and_resist_against_hand_count():
    assert gpt_shape("gpt_tiny") == (W, D, NH) and W == NH * HD
    model = gpt_tiny(vocab_size=V, context=32)
    B, T = 2, 16
    x = torch.randint(0, V, (B, T))
    assert cost.model_step_flops(model, x) == _gpt_step(B, T)
    # the CPU's fused attention kernel counts as the meta device's math path does
    assert cost.model_step_flops(model, x, meta=False) == _gpt_step(B, T)
    for S in (2, 4):
        assert cost.subnetwork_step_flops(model, "ist", S, {"partition": "ffn"}, x) == [_gpt_step(B, T, ffn=F // S)] * S
        assert cost.subnetwork_step_flops(model, "ist", S, {"partition": "heads"}, x) == [_gpt_step(B, T, heads=NH // S)] * S
        assert cost.subnetwork_step_flops(model, "ist", S, {"partition": "both"}, x) == \
            [_gpt_step(B, T, heads=NH // S, ffn=F // S)] * S
    # ResIST: the first and last blocks shared, the 2 between dealt to 2 workers, one each
    assert cost.subnetwork_step_flops(model, "resist", 2, None, x) == [_gpt_step(B, T, depth=3)] * 2
    assert cost.subnetwork_step_flops(model, "resist", 2, {"min_depth": 2}, x) == [_gpt_step(B, T)] * 2
    assert cost.subnetwork_step_flops(model, "localsgd", 2, None, x) == [_gpt_step(B, T)] * 2


def test_loft_subnetwork_divides_the_partitioned_convolutions():
    model = preact_resnet18(10, 3, 4)
    B = 2
    x = torch.randn(B, 3, 8, 8)
    full = cost.model_step_flops(model, x)
    assert full == cost.step_flops(model, (3, 8, 8), B)
    plan = loft_plan(model, 2, torch.Generator().manual_seed(0))
    part, rest = cost.split_step_flops(model, (3, 8, 8), B, {t.name for t in plan.slices.tensors if not t.shared})
    assert part + rest == full
    for S in (2, 4):  # every partitioned conv has a multiple of 4 filters: each worker's convs are 1/S
        assert cost.subnetwork_step_flops(model, "loft", S, None, x) == [rest + part // S] * S


def test_hugging_face_llama_against_hand_count():
    transformers = pytest.importorskip("transformers", reason="transformers (the [hf] extra) is not installed")
    Wl, F_, L, H, KV, V_ = 64, 96, 4, 4, 2, 64
    d = Wl // H
    cfg = transformers.LlamaConfig(vocab_size=V_, hidden_size=Wl, intermediate_size=F_, num_hidden_layers=L,
                                   num_attention_heads=H, num_key_value_heads=KV, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    B, T = 2, 16
    x = torch.randint(0, V_, (B, T))

    def step(layers=L, heads=H, kv=KV, ffn=F_):
        N = B * T
        # q and o: heads x d wide; k and v: kv heads x d; gated FFN: gate, up, down
        per_layer = N * (2 * Wl * heads * d * 2 + 2 * Wl * kv * d * 2 + 3 * 2 * Wl * ffn) + B * heads * 2 * (2 * T * T * d)
        return 3 * (layers * per_layer + N * 2 * Wl * V_)

    assert cost.model_step_flops(model, x) == step()
    assert cost.model_step_flops(model, {"input_ids": x}) == step()
    assert cost.model_step_flops(model, x, meta=False) == step()
    for S in (2, 4):
        assert cost.subnetwork_step_flops(model, "ist", S, None, x) == [step(ffn=F_ // S)] * S
    # S = 2 divides the 2 key/value heads: each worker gets one and its group of 2 query heads
    assert cost.subnetwork_step_flops(model, "ist", 2, {"partition": "heads"}, x) == [step(heads=H // 2, kv=KV // 2)] * 2
    with pytest.raises(ValueError, match="not divisible"):
        cost.subnetwork_step_flops(model, "ist", 4, {"partition": "heads"}, x)
    assert cost.subnetwork_step_flops(model, "resist", 2, None, x) == [step(layers=L - 1)] * 2
    assert all(p.grad is None and p.device.type == "cpu" for p in model.parameters())
