"""Model shapes by name. Each function returns a `ModelConfig`; keyword overrides replace fields
(e.g. `scout(param_dtype="bfloat16", remat=True)`).

  tiny()      a small dense Llama for tests
  tiny_moe()  a small Llama-4 (MoE + shared expert, NoPE every 2nd layer, chunked attention,
              qk norm, temperature tuning) for tests; has an HF Llama4ForCausalLM equivalent
  dense_8b()  Llama-3.1-8B: 8,030,261,248 parameters
  scout()     Llama-4-Scout-17B-16E, text model: 107.77B parameters (109B with the vision tower
              of the published checkpoint), 17.2B active per token (embedding included)

Sources: Meta's Llama-3.1-8B config.json and the published Llama-4-Scout-17B-16E text_config
(transformers `Llama4TextConfig` defaults agree except rope_scaling, which the checkpoint sets).
Scout notes: every layer is MoE (interleave_moe_layer_step 1), so `intermediate_size_mlp`
(16384, the width of Maverick's dense layers) is unused; the shared expert is a
`Llama4TextMLP(config)` of width `intermediate_size` = 8192, like each routed expert.
"""

from __future__ import annotations

import dataclasses

from flax.core import FrozenDict

from rl_scaling.policy.model_config import ModelConfig

# Llama-3.1 frequency scaling (also in Scout's config). A FrozenDict keeps ModelConfig hashable.
LLAMA31_ROPE_SCALING = FrozenDict(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)


def _make(overrides, **fields):
    return dataclasses.replace(ModelConfig(**fields), **overrides) if overrides else ModelConfig(**fields)


def tiny(**overrides) -> ModelConfig:
    return _make(overrides, vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                 mlp_dim=128, rope_theta=10000.0)


def tiny_moe(**overrides) -> ModelConfig:
    return _make(
        overrides, vocab_size=128, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16,
        mlp_dim=64, rope_theta=500000.0,
        num_experts=4, num_experts_per_tok=1, moe_mlp_dim=64, shared_expert=True, router_aux_loss_coef=0.001,
        nope_layer_interval=2, attention_chunk_size=4, use_qk_norm=True, attn_temperature_tuning=True,
        floor_scale=4.0, attn_scale=0.1,
    )


def dense_8b(**overrides) -> ModelConfig:
    """Llama-3.1-8B."""
    return _make(
        overrides, vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
        mlp_dim=14336, rope_theta=500000.0, rope_scaling=LLAMA31_ROPE_SCALING, norm_eps=1e-5,
        tie_embeddings=False, dtype="bfloat16",
    )


def scout(**overrides) -> ModelConfig:
    """Llama-4-Scout-17B-16E (text)."""
    return _make(
        overrides, vocab_size=202048, d_model=5120, n_layers=48, n_heads=40, n_kv_heads=8, head_dim=128,
        mlp_dim=8192, rope_theta=500000.0, rope_scaling=LLAMA31_ROPE_SCALING, norm_eps=1e-5,
        tie_embeddings=False, dtype="bfloat16",
        num_experts=16, num_experts_per_tok=1, moe_mlp_dim=8192, shared_expert=True, router_aux_loss_coef=0.001,
        nope_layer_interval=4, attention_chunk_size=8192, use_qk_norm=True, attn_temperature_tuning=True,
        floor_scale=8192.0, attn_scale=0.1,
    )


PRESETS = {"tiny": tiny, "tiny_moe": tiny_moe, "dense_8b": dense_8b, "scout": scout}


def get(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose from {sorted(PRESETS)}")
    return PRESETS[name](**overrides)
