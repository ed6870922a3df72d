"""Blocked attention computes what one whole [T, S] score block does: query chunks
(model.attn_query_chunk, for 16k-token RL sequences; dense and Llama-4 layers, padding included)
and the causal blocks of training attention (model.causal_blocks)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from rl_scaling.policy import model as M
from rl_scaling.policy import presets
from rl_scaling.rl import train_step as ts


@pytest.mark.parametrize("cfg", [presets.tiny(), presets.tiny_moe(moe_impl="dense")], ids=["dense", "llama4"])
def test_query_chunks_match_whole_attention(cfg):
    params = nn.unbox(M.init_params(cfg, jax.random.key(0)))
    tokens = jax.random.randint(jax.random.key(1), (3, 11), 0, 100)
    mask = jnp.ones((3, 11), bool).at[0, :3].set(False)  # a left-padded row

    # Log-probs of real tokens read by real tokens (what the loss sees): a pad query sees no key,
    # and its output (a mean over masked keys) depends on how many keys its block holds.
    real = mask[:, :-1] & mask[:, 1:]

    def value_and_grad(c):
        return jax.value_and_grad(lambda p: jnp.sum(ts.token_logprobs(p, c, tokens, mask) * real))(params)

    want, want_g = value_and_grad(cfg)
    got, got_g = value_and_grad(dataclasses.replace(cfg, attn_query_chunk=4))  # 10 queries: 3 blocks, 2 padded
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_causal_blocks_equal_one_full_score_block(monkeypatch):
    """Training attention in causal blocks (each block of queries over the keys up to its last)
    equals one [T, T] block per head under the same causal and padding mask, values and grads, for
    every query that sees a key."""
    rng = np.random.default_rng(0)
    B, T, K, G, H = 2, 11, 2, 2, 8
    q = jnp.asarray(rng.standard_normal((B, T, K, G, H)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((B, K, T, H)), jnp.float32) for _ in range(2))
    valid = np.ones((B, T), bool)
    valid[1, :3] = False  # left padding
    mask = jnp.asarray(np.tril(np.ones((T, T), bool))[None] & valid[:, None, :])
    assert M.causal_blocks(31) == [(0, 31)] and len(M.causal_blocks(79)) == 4  # the tiny run's; the bench's
    monkeypatch.setattr(M, "MIN_CAUSAL_BLOCK", 2)
    assert M.causal_blocks(T) == [(0, 2), (2, 5), (5, 8), (8, 11)]

    sees_a_key = mask.any(-1)[:, :, None, None, None]  # pad queries see none: their output is undefined

    def blocked(q, k, v):
        return jnp.sum(jnp.sin(M._attend(q, k, v, mask, jnp.float32)) * sees_a_key)

    def one_block(q, k, v):
        return jnp.sum(jnp.sin(M._attend_block(q, k, v, mask, jnp.float32)) * sees_a_key)

    np.testing.assert_allclose(blocked(q, k, v), one_block(q, k, v), rtol=1e-6)
    for a, b in zip(jax.grad(blocked, (0, 1, 2))(q, k, v), jax.grad(one_block, (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(a, b, atol=1e-6)
