"""Models this package does not define, trained through ist-train (issue 26's "done when"): Hugging
Face ResNets (LOFT, ResIST), a plain nn.Sequential MLP (IST), Llama (IST of FFN units and heads,
ResIST of layers, DiLoCo) and GPT-2 (IST), from module files given as --model MODULE:FACTORY; and
(issue 38) an MLP with a norm between its projections, HF OPT (fc1/fc2 in the decoder layer) and
torch's nn.TransformerEncoder (nn.MultiheadAttention heads), found from their data flow."""
import json
import os

import pytest
import torch

from ist_kernels.train import cli

from train_helpers import assert_equal_states, outputs, untimed

transformers = pytest.importorskip("transformers")

FACTORIES = '''
import torch
from torch import nn


def seq_mlp():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 10))


def resnet_basic():
    from transformers import ResNetConfig, ResNetForImageClassification
    return ResNetForImageClassification(ResNetConfig(num_channels=1, layer_type="basic", depths=[2, 2, 6, 2],
                                                     hidden_sizes=[8, 16, 16, 16], embedding_size=8, num_labels=10))


def resnet_bottleneck():
    from transformers import ResNetConfig, ResNetForImageClassification
    return ResNetForImageClassification(ResNetConfig(num_channels=1, layer_type="bottleneck", depths=[1, 2, 6, 1],
                                                     hidden_sizes=[16, 32, 32, 32], embedding_size=8, num_labels=10))


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2))


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=4, n_head=4))


def seq_mlp_norm():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 256), nn.LayerNorm(256), nn.GELU(), nn.Dropout(0.1),
                         nn.Linear(256, 10))


def tiny_opt():
    from transformers import OPTConfig, OPTForCausalLM
    return OPTForCausalLM(OPTConfig(vocab_size=256, hidden_size=64, ffn_dim=172, num_hidden_layers=4,
                                    num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=64))


class DigitsEncoder(nn.Module):
    """torch's nn.TransformerEncoder (nn.MultiheadAttention, linear1 / linear2 in the layer) over the
    8 rows of a digit."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
        self.out = nn.Linear(32, 10)

    def forward(self, x):
        return self.out(self.enc(self.inp(x.reshape(-1, 8, 8))).mean(1))


def digits_encoder():
    return DigitsEncoder()


def mlp_of(width=512):
    return nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 10))


def no_structure():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))


class Scaled(nn.Module):
    """An FFN reading a parameter of its module between its projections: not taken for an FFN."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 96), nn.Linear(96, 10)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return self.b(torch.relu(self.a(x.flatten(1))) * self.scale)


def scaled():
    return Scaled()
'''

COMMON = ["--rounds", "2", "--local-steps", "2", "--batch-size", "8", "--eval-interval", "0", "--no-progress",
          "--no-plots", "--threads", "1", "--device", "cpu"]
LM = ["--dataset", "pycode", "--context", "32", "--dataset-size", "20000", "--batch-size", "4"]


@pytest.fixture
def user_models(tmp_path, monkeypatch):
    """A module file of factories in the working directory, as a user has one."""
    (tmp_path / "user_models.py").write_text(FACTORIES)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _run(out, *args):
    argv = [*COMMON, *map(str, args), "--out-dir", str(out)]
    assert cli.main(argv) == 0
    return outputs(out)


def _summary(out, method):
    with open(os.path.join(out, method, "summary.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("factory", ["resnet_basic", "resnet_bottleneck"])
@pytest.mark.parametrize("method", ["loft", "resist"])
def test_hf_resnets_loft_resist(user_models, factory, method):
    out = user_models / f"{factory}-{method}"
    assert cli.main([*COMMON, "--model", f"user_models:{factory}", "--method", method, "--dataset", "digits",
                     "--simulate", "2", "--baseline", "--out-dir", str(out)]) == 0
    s = _summary(out, method)
    assert s["bytes_ratio"] < 1, s["bytes_ratio"]
    assert s["accuracy"] is not None


def test_sequential_mlp_ist(user_models):
    out = user_models / "mlp"
    assert cli.main([*COMMON, "--model", "user_models:seq_mlp", "--method", "ist", "--dataset", "digits",
                     "--simulate", "2", "--baseline", "--out-dir", str(out)]) == 0
    assert _summary(out, "ist")["bytes_ratio"] < 1


def test_sequential_mlp_with_a_norm_between_ist(user_models):
    """Linear -> LayerNorm -> GELU -> Dropout -> Linear: found from its data flow (issue 38)."""
    out = user_models / "mlp_norm"
    assert cli.main([*COMMON, "--model", "user_models:seq_mlp_norm", "--method", "ist", "--dataset", "digits",
                     "--simulate", "2", "--baseline", "--out-dir", str(out)]) == 0
    assert _summary(out, "ist")["bytes_ratio"] < 1


def test_torch_transformer_encoder_distributed_equals_simulated(user_models):
    """nn.TransformerEncoder (heads of nn.MultiheadAttention, linear1/linear2 beside them): 2 gloo
    ranks under decentralized storage give the simulated run's model."""
    args = ["--model", "user_models:digits_encoder", "--method", "ist", "--option", "partition=both",
            "--dataset", "digits", "--rounds", "3", "--shared", "exact"]
    _, m_sim, h_sim = _run(user_models / "sim", *args, "--simulate", "2")
    s_dist, m_dist, h_dist = _run(user_models / "dist", *args, "--workers", "2")
    assert_equal_states(m_dist, m_sim)
    assert untimed(h_dist) == untimed(h_sim)
    assert 0 < s_dist["rank_state_bytes"] < s_dist["full_state_bytes"]


@pytest.mark.parametrize("factory,method,options", [
    ("tiny_opt", "ist", ["--option", "partition=both"]),
    ("tiny_llama", "ist", []),
    ("tiny_llama", "ist", ["--option", "partition=heads"]),
    ("tiny_llama", "resist", []),
    ("tiny_gpt2", "ist", []),
])
def test_hf_language_models(user_models, factory, method, options):
    out = user_models / f"{factory}-{method}"
    assert cli.main([*COMMON, *LM, "--model", f"user_models:{factory}", "--method", method, *options,
                     "--simulate", "2", "--rounds", "3", "--baseline", "--out-dir", str(out)]) == 0
    s = _summary(out, method)
    assert "bits_per_byte" in s and s["bits_per_byte"] > 0
    assert s["bytes_ratio"] < 1, s["bytes_ratio"]


def test_llama_diloco(user_models):
    out = user_models / "diloco"
    assert cli.main([*COMMON, *LM, "--model", "user_models:tiny_llama", "--method", "diloco", "--simulate", "2",
                     "--out-dir", str(out)]) == 0
    with open(out / "summary.json") as f:
        assert "bits_per_byte" in json.load(f)


def test_llama_ist_distributed_equals_simulated_and_resumes(user_models):
    """2 gloo ranks (decentralized storage: a rank holds less than the full model) give the simulated
    run's model; stopping after round 1 and resuming gives the uninterrupted run's."""
    args = [*LM, "--model", "user_models:tiny_llama", "--method", "ist", "--option", "partition=both",
            "--rounds", "3", "--shared", "exact"]
    s_sim, m_sim, h_sim = _run(user_models / "sim", *args, "--simulate", "2")
    s_dist, m_dist, h_dist = _run(user_models / "dist", *args, "--workers", "2")
    assert_equal_states(m_dist, m_sim)
    assert untimed(h_dist) == untimed(h_sim)
    assert 0 < s_dist["rank_state_bytes"] < s_dist["full_state_bytes"]
    _run(user_models / "cut", *args, "--workers", "2", "--stop-after", "1", "--checkpoint-interval", "1")
    _, m_res, _ = _run(user_models / "cut", *args, "--workers", "2", "--resume")
    assert_equal_states(m_res, m_dist)


def test_no_structure_found_is_a_clear_error_before_any_work(user_models, capsys):
    out = user_models / "nothing"
    assert cli.main([*COMMON, "--model", "user_models:no_structure", "--method", "ist", "--dataset", "digits",
                     "--simulate", "2", "--out-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert "options.partition" in err and "found no FFN" in err and "looked for" in err, err
    assert not out.exists()
    assert cli.main([*COMMON, "--model", "user_models:no_structure", "--method", "resist", "--dataset", "digits",
                     "--simulate", "2", "--out-dir", str(out)]) == 2
    assert "model" in capsys.readouterr().err
    assert not out.exists()
    torch.manual_seed(0)  # (nothing above touched the global RNG state a later test might read)


def test_model_spec_where_the_structure_is_not_found(user_models, capsys):
    """An FFN the search does not take (its module has a parameter of its own): the error says what
    was looked for and how to pass a spec; with --model-spec the run partitions its 96 units."""
    out = user_models / "spec"
    base = [*COMMON, "--model", "user_models:scaled", "--method", "ist", "--dataset", "digits", "--simulate", "2",
            "--out-dir", str(out)]
    assert cli.main(base) == 2
    err = capsys.readouterr().err
    assert "looked for an FFN" in err and "--model-spec" in err, err
    assert not out.exists()
    assert cli.main([*base, "--model-spec", '{"ffns": [[["a"], "b"]]}', "--baseline"]) == 0
    assert _summary(out, "ist")["bytes_ratio"] < 1
    assert cli.main([*base, "--model-spec", '{"ffns": [[["a"], "nosuch"]]}', "--overwrite"]) == 2
    assert "nosuch" in capsys.readouterr().err


def test_resume_checks_the_factory_arguments(user_models, capsys):
    out = user_models / "args"
    base = [*COMMON, "--model", "user_models:mlp_of", "--method", "ist", "--dataset", "digits", "--simulate", "2",
            "--out-dir", str(out)]
    assert cli.main([*base, "--model-args", "width=32", "--stop-after", "1"]) == 0
    assert cli.main([*base, "--model-args", "width=64", "--resume"]) == 2
    assert "model_args" in capsys.readouterr().err
    assert cli.main([*base, "--model-args", "width=32", "--resume"]) == 0
