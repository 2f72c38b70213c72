"""Tiny random-weight HF causal LMs of every supported architecture, built from configs."""
import torch
import transformers
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)

ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),    # q/k norms before RoPE
    "phi3": (Phi3Config, Phi3ForCausalLM),       # one fused qkv_proj
    # q/k norms, query_pre_attn_scalar scaling, sliding and full layers (layer_types)
    "gemma3_text": (Gemma3TextConfig, Gemma3ForCausalLM),
}
# The other supported model types: attention as one of the above (tests/test_more_models.py).
MORE_ARCHS = {name: (getattr(transformers, config), getattr(transformers, model)) for name, (config, model) in {
    "gemma": ("GemmaConfig", "GemmaForCausalLM"),
    "granite": ("GraniteConfig", "GraniteForCausalLM"),               # attention_multiplier scaling
    "ministral": ("MinistralConfig", "MinistralForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),               # Mistral's attention, MoE
    "olmo": ("OlmoConfig", "OlmoForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),                     # q/k norms over all heads
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM"),
}.items()}


def arch_config(arch: str, layers: int) -> dict:
    """What an architecture's config needs besides the shape: Phi-3's default pad token id is
    past the tiny vocabulary; Gemma 3 scales queries by query_pre_attn_scalar (not head_dim)
    and gets sliding and full layers in turn (its default, 5 sliding : 1 full, would make a
    tiny model all sliding)."""
    if arch == "phi3":
        return dict(pad_token_id=0)
    if arch == "gemma3_text":
        return dict(query_pre_attn_scalar=24,
                    layer_types=["full_attention" if i % 2 else "sliding_attention" for i in range(layers)])
    if arch in ("mixtral", "qwen2_moe", "qwen3_moe"):   # a few small experts
        return dict(num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                    shared_expert_intermediate_size=32)
    return {}


VOCAB = 101


def tiny_model(arch: str = "llama", heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
               layers: int = 2, dtype=torch.float32, seed: int = 0, attn: str = "sdpa", **extra):
    """A 2-layer model with `heads` query heads and `kv_heads` KV heads (GQA, MQA or MHA)."""
    config_cls, model_cls = ARCHS[arch] if arch in ARCHS else MORE_ARCHS[arch]
    extra = {**arch_config(arch, layers), **extra}
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
            attn = layer.self_attn
            if hasattr(attn, "qkv_proj"):   # Phi-3: the query and key rows of the fused projection
                attn.qkv_proj.weight[:(heads + kv_heads) * head_dim].mul_(4)
            elif arch == "gemma3_text":     # normed after the projection: scale the norms (1 + w)
                attn.q_norm.weight.fill_(1.0)
                attn.k_norm.weight.fill_(1.0)
            else:
                attn.q_proj.weight.mul_(4)
                attn.k_proj.weight.mul_(4)
    return model
