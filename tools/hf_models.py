"""Hugging Face models built from a config (no download), as ``--model tools/hf_models.py:FACTORY``
takes them: the models the GPU step-cost check (``tools/gpu_step_costs.py``) trains beside the
package's own GPT. Needs ``transformers``."""


def llama(hidden=1024, layers=8, heads=16, kv=4, ffn=2816, vocab=256, context=512):
    """A ``LlamaForCausalLM``: by default hidden 1024, 8 layers, 16 heads, 4 KV heads (grouped-query
    attention), FFN 2816, byte vocabulary, untied output embedding (about 100M parameters)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=int(vocab), hidden_size=int(hidden), intermediate_size=int(ffn),
                      num_hidden_layers=int(layers), num_attention_heads=int(heads),
                      num_key_value_heads=int(kv), max_position_embeddings=int(context),
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)
