"""Model presets: parameter counts from abstract shapes (nothing allocated)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import math  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402
from flax import linen as nn  # noqa: E402

from rl_scaling import sharding  # noqa: E402
from rl_scaling.policy import model as M  # noqa: E402
from rl_scaling.policy import presets  # noqa: E402


def count(cfg):
    with jax.set_mesh(sharding.make_mesh(devices=jax.devices()[:1])):
        shapes = nn.unbox(jax.eval_shape(lambda: M.init_params(cfg, jax.random.key(0))))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))


def test_dense_8b_is_llama31_8b():
    cfg = presets.dense_8b()
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.mlp_dim, cfg.vocab_size) == (
        32, 4096, 32, 8, 128, 14336, 128256)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["factor"] == 8.0 and not cfg.tie_embeddings
    total = count(cfg)
    assert total == 8_030_261_248  # Meta's published count for Llama-3.1-8B
    assert M.compute_params(cfg, active=False) + cfg.vocab_size * cfg.d_model == total
    assert M.compute_params(cfg) == M.compute_params(cfg, active=False)


def test_scout_counts():
    cfg = presets.scout()
    total = count(cfg)
    # Hand count from the published config: per layer attention 5120*128*(2*40+2*8), 16 routed
    # experts + 1 shared expert of 3*5120*8192, router 5120*16, two norms; then embedding,
    # LM head and final norm.
    attn, expert = 5120 * 128 * 96, 3 * 5120 * 8192
    layer = attn + 17 * expert + 5120 * 16 + 2 * 5120
    assert total == 48 * layer + 2 * 202048 * 5120 + 5120 == 107_769_861_120
    # "109B total": the published multimodal checkpoint (108.6B) adds a ~0.9B vision tower
    # that this text policy does not have.
    assert total == pytest.approx(108.64e9, rel=0.01)
    active = M.compute_params(cfg) + cfg.vocab_size * cfg.d_model  # + the embedding lookup
    assert active == total - 15 * 48 * expert
    assert active == pytest.approx(17e9, rel=0.011)  # 17.17B; "17B active" is rounded
    assert M.compute_params(cfg, active=False) + cfg.vocab_size * cfg.d_model == total


def test_scout_matches_llama4_details():
    cfg = presets.scout()
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size) == (
        48, 5120, 40, 8, 128, 202048)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_mlp_dim, cfg.mlp_dim, cfg.shared_expert) == (
        16, 1, 8192, 8192, True)
    assert (cfg.nope_layer_interval, cfg.attention_chunk_size, cfg.use_qk_norm, cfg.attn_temperature_tuning) == (
        4, 8192, True, True)
    assert (cfg.floor_scale, cfg.attn_scale, cfg.router_aux_loss_coef, cfg.rope_theta) == (8192.0, 0.1, 0.001, 500000.0)


def test_presets_are_hashable_and_overridable():
    for name in presets.PRESETS:
        cfg = presets.get(name)
        hash(cfg)
    assert presets.get("scout", param_dtype="bfloat16", remat=True).remat
    with pytest.raises(ValueError, match="unknown model preset"):
        presets.get("llama-70b")
    assert count(presets.tiny()) > 0 and count(presets.tiny_moe()) > 0
