"""Tiny random-weight HF causal LMs of every supported architecture, built from configs."""
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),    # q/k norms before RoPE
}
VOCAB = 101


def tiny_model(arch: str = "llama", heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
               layers: int = 2, dtype=torch.float32, seed: int = 0, attn: str = "sdpa", **extra):
    """A 2-layer model with `heads` query heads and `kv_heads` KV heads (GQA, MQA or MHA)."""
    config_cls, model_cls = ARCHS[arch]
    config = config_cls(vocab_size=VOCAB, hidden_size=heads * head_dim, intermediate_size=64,
                        num_hidden_layers=layers, num_attention_heads=heads,
                        num_key_value_heads=kv_heads, head_dim=head_dim,
                        max_position_embeddings=1024, tie_word_embeddings=False, **extra)
    config._attn_implementation = attn
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype).eval()
    # Larger random weights than the init give peaky attention, so scores are far from ties.
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4)
            layer.self_attn.k_proj.weight.mul_(4)
    return model
