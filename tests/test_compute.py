"""The compute axis: FLOPs against a token-by-token count, shared prefill per group, the tied
LM head, and compilation left out of accelerator-seconds."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from rl_scaling import compute
from rl_scaling.policy import model as M
from tests.conftest import TINY


def loop_flops(cfg, prompt_lens, gen_lens, group_size=1):
    """Every token's forward cost, 2 N_matmul + 4 L c n_heads d_head at context c, counted
    one by one; N_matmul written out from the shapes."""
    D, V = cfg.d_model, cfg.vocab_size
    n = cfg.n_layers * (D * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) + 3 * D * cfg.mlp_dim + 2 * D) + D + D * V
    per_token = lambda pos: 2 * n + 4 * cfg.n_layers * (pos + 1) * cfg.n_heads * cfg.head_dim  # noqa: E731
    gen = train = 0
    for row, (p, g) in enumerate(zip(prompt_lens, gen_lens)):
        for pos in range(p + g):
            train += 3 * per_token(pos)
            if pos >= p or row % group_size == 0:  # a group's prompt is prefilled by its first row
                gen += per_token(pos)
    return gen, train


def test_sequence_flops_equal_a_token_by_token_count():
    prompts, gens = [5, 5, 5, 5, 9, 9, 9, 9], [0, 3, 7, 12, 1, 1, 4, 30]
    for G in (1, 4):
        gen, train = compute.sequence_flops(TINY, prompts, gens, group_size=G)
        ref_gen, ref_train = loop_flops(TINY, prompts, gens, G)
        np.testing.assert_allclose([gen, train], [ref_gen, ref_train], rtol=1e-12)
    shared, _ = compute.sequence_flops(TINY, prompts, gens, group_size=4)
    each, _ = compute.sequence_flops(TINY, prompts, gens)
    assert shared < each  # six prompts fewer prefilled


def test_tied_lm_head_is_counted():
    tied = dataclasses.replace(TINY, tie_embeddings=True)
    assert M.compute_params(tied) == M.compute_params(TINY)  # the head's matmul runs either way


def test_compile_clock_counts_compilation_only():
    clock = compute.CompileClock()
    clock.take()
    f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())
    x = jnp.ones((64, 64))
    f(x).block_until_ready()
    first = clock.take()
    f(x).block_until_ready()
    assert first > 0.0 and clock.take() == 0.0  # a cached call compiles nothing
