"""Query-blocked attention (model.attn_query_chunk, for 16k-token RL sequences) computes the same
log-probs and gradients as whole-sequence attention, padding included; dense and Llama-4 layers."""

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

    def value_and_grad(c):
        return jax.value_and_grad(lambda p: ts.token_logprobs(p, c, tokens, mask).sum())(params)

    want, want_g = value_and_grad(cfg)
    got, got_g = value_and_grad(dataclasses.replace(cfg, attn_query_chunk=4))  # 10 queries: 3 blocks, 2 padded
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
