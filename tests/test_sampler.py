"""The KV-cache sampler against full recomputes of the same model. The "h16" variants have a head dim
the CPU attention kernel accepts (policy/cpu_kernels.py), so on XLA:CPU their decode steps run the
kernels and are checked against XLA's recompute."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_scaling.policy import model as model_lib
from rl_scaling.rl import train_step as ts
from rl_scaling.rollout import sampler
from tests.conftest import TINY

H16 = dataclasses.replace(TINY, head_dim=16)


@pytest.fixture(scope="module", params=["tiny", "h16"])
def model(request, tiny_params):
    """(cfg, params): TINY, and TINY with head_dim 16."""
    if request.param == "tiny":
        return TINY, tiny_params
    from flax import linen as nn

    return H16, nn.unbox(model_lib.init_params(H16, jax.random.key(0)))


def _prompts(B=6, P=5, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(5, 60, size=(B, P)).astype(np.int32)
    mask = np.ones((B, P), bool)
    for i in range(B):  # left padding of varied length
        mask[i, : i % P] = False
    tokens[~mask] = 0
    return tokens, mask


def test_kv_cache_decode_matches_full_recompute(tiny_params):
    tokens, mask = _prompts()
    B, P = tokens.shape
    extra = np.random.default_rng(1).integers(5, 60, size=(B, 4)).astype(np.int32)
    full_tokens = np.concatenate([tokens, extra], 1)
    full_mask = np.concatenate([mask, np.ones_like(extra, bool)], 1)
    dec = model_lib.Decoder(TINY)
    pos = model_lib.positions_from_mask(full_mask)
    full, _ = dec.apply({"params": tiny_params}, full_tokens, pos, full_mask)
    cache = model_lib.init_cache(TINY, B, P + 4)
    logits, cache = dec.apply({"params": tiny_params}, tokens, pos[:, :P], mask, cache)
    steps = [logits]
    for t in range(4):
        lg, cache = dec.apply({"params": tiny_params}, extra[:, t:t + 1], pos[:, P + t:P + t + 1],
                              np.ones((B, 1), bool), cache)
        steps.append(lg)
    inc = np.concatenate(steps, 1)
    err = np.abs(np.where(full_mask[..., None], inc - np.asarray(full), 0)).max()
    assert err < 1e-4, err


def test_sampler_logprobs_match_teacher_forced_recompute(model):
    cfg, tiny_params = model
    tokens, mask = _prompts(B=8)
    out = sampler.sample(tiny_params, tokens, mask, jax.random.key(3), cfg=cfg, max_new_tokens=12,
                         stop_tokens=(2,), pad_id=0, temperature=1.0)
    B, P = tokens.shape
    comp_mask = np.arange(12)[None] < np.asarray(out.lengths_B)[:, None]
    seq = np.concatenate([tokens, np.asarray(out.tokens_BT)], 1)
    seq_mask = np.concatenate([mask, comp_mask], 1)
    recomputed = ts.token_logprobs(tiny_params, cfg, jnp.asarray(seq), jnp.asarray(seq_mask))[:, P - 1:]
    err = np.abs(np.where(comp_mask, np.asarray(recomputed) - np.asarray(out.logprobs_BT), 0)).max()
    assert err <= 1e-4, err
    assert comp_mask.sum() > B  # something was actually generated


def test_sampler_stops_lengths_and_truncation(tiny_params):
    tokens, mask = _prompts(B=16)
    # Make token 7 the stop token: with a random model some rows hit it, others don't.
    out = jax.device_get(sampler.sample(tiny_params, tokens, mask, jax.random.key(0), cfg=TINY, max_new_tokens=10,
                                        stop_tokens=(7, 9, 11, 13), pad_id=0))
    for row, n, trunc in zip(out.tokens_BT, out.lengths_B, out.truncated_B):
        stops = np.isin(row[:n], (7, 9, 11, 13))
        if trunc:
            assert n == 10 and not stops.any()
        else:
            assert stops[n - 1] and not stops[: n - 1].any()
        assert (row[n:] == 0).all()
    assert out.truncated_B.any() and (~out.truncated_B).any()


def test_low_temperature_is_greedy(model):
    cfg, tiny_params = model
    tokens, mask = _prompts(B=4)
    out = sampler.sample(tiny_params, tokens, mask, jax.random.key(0), cfg=cfg, max_new_tokens=6, temperature=1e-4)
    seq, seq_mask = tokens, mask
    for _ in range(6):  # greedy decode by full recompute
        pos = model_lib.positions_from_mask(seq_mask)
        logits, _ = model_lib.Decoder(cfg).apply({"params": tiny_params}, seq, pos, seq_mask)
        nxt = np.asarray(logits[:, -1].argmax(-1))[:, None].astype(np.int32)
        seq, seq_mask = np.concatenate([seq, nxt], 1), np.concatenate([seq_mask, np.ones_like(nxt, bool)], 1)
    np.testing.assert_array_equal(np.asarray(out.tokens_BT), seq[:, tokens.shape[1]:])


def test_sharded_sampling_equals_single_device(monkeypatch):
    """collect.generate with MoE params on an 8-device mesh (rows over data/fsdp/expert, heads and
    expert hidden over tensor, traced under the mesh) gives the single-device tokens and log-probs."""
    from flax import linen as nn

    from rl_scaling import sharding
    from rl_scaling.policy import presets
    from rl_scaling import distributed, tasks
    from rl_scaling.rollout import collect, engine

    task = tasks.ArithmeticTask(seed=0)
    cfg = presets.tiny_moe(vocab_size=task.tokenizer.vocab_size)
    problems = [task.train_problem(i) for i in range(4)]
    kw = dict(max_prompt_len=24, max_new_tokens=12, temperature=1.0)
    rng = jax.random.key(3)
    mesh1 = sharding.make_mesh(devices=jax.devices()[:1])
    with jax.set_mesh(mesh1):
        params = nn.unbox(model_lib.init_params(cfg, jax.random.key(0)))
    single = collect.generate(params, cfg, task, problems, 4, rng, **kw)
    mesh8 = sharding.make_mesh({"fsdp": 2, "tensor": 2, "expert": 2})
    sharded_params = jax.device_put(params, engine.param_shardings(cfg, mesh8))
    assert distributed.row_mesh(sharded_params, 16) is mesh8 and distributed.row_mesh(params, 16) is None
    seen, to_host = [], distributed.to_host
    monkeypatch.setattr(distributed, "to_host", lambda out: (seen.append(out.tokens_BT.sharding), to_host(out))[1])
    sharded = collect.generate(sharded_params, cfg, task, problems, 4, rng, **kw)
    assert seen[0].is_equivalent_to(sharding.batch_sharding(mesh8, 2), 2)  # each device decoded its own rows
    np.testing.assert_array_equal(sharded[2].tokens_BT, single[2].tokens_BT)
    np.testing.assert_allclose(sharded[2].logprobs_BT, single[2].logprobs_BT, atol=1e-5)
    np.testing.assert_array_equal(sharded[4], single[4])



def test_group_prefill_equals_repeated_prompts(model):
    """group_size=G prefills each prompt once and shares its cache: the same tokens and log-probs
    as G copies of every prompt."""
    cfg, tiny_params = model
    tokens, mask = _prompts(B=3)
    kw = dict(cfg=cfg, max_new_tokens=8, stop_tokens=(2,), pad_id=0)
    rep = sampler.sample(tiny_params, np.repeat(tokens, 4, 0), np.repeat(mask, 4, 0), jax.random.key(5), **kw)
    shared = sampler.sample(tiny_params, tokens, mask, jax.random.key(5), group_size=4, **kw)
    np.testing.assert_array_equal(np.asarray(shared.tokens_BT), np.asarray(rep.tokens_BT))
    np.testing.assert_array_equal(np.asarray(shared.lengths_B), np.asarray(rep.lengths_B))
    np.testing.assert_allclose(np.asarray(shared.logprobs_BT), np.asarray(rep.logprobs_BT), atol=1e-5)


def test_growing_cache_segments_equal_one_full_length_loop(model):
    """cache_segments=2 decodes 32 steps as two loops over a cache grown in between: the tokens,
    lengths and interruptions of one loop over the full-length cache, log-probs to float32
    rounding. Stop tokens end some rows in each segment; thinking budgets run across the boundary."""
    cfg, tiny_params = model
    tokens, mask = _prompts(B=12)
    think_budget = np.array([3, 14, 15, 16, 17, 40] * 2, np.int32)
    kw = dict(cfg=cfg, max_new_tokens=32, stop_tokens=(7, 9), pad_id=0, think_budget_B=think_budget,
              interrupt_tokens=(11, 12), think_end_id=12, answer_budget=3)
    one = jax.device_get(sampler.sample(tiny_params, tokens, mask, jax.random.key(4), cache_segments=1, **kw))
    two = jax.device_get(sampler.sample(tiny_params, tokens, mask, jax.random.key(4), cache_segments=2, **kw))
    for a, b in zip(one, two):
        np.testing.assert_allclose(b, a, atol=1e-5)
    ended = one.lengths_B[~one.truncated_B]
    assert (ended <= 16).any() and (ended > 16).any()  # rows stopped in both segments
    assert one.interrupted_B.any()
    with pytest.raises(ValueError, match="cache_segments"):
        sampler.sample(tiny_params, tokens, mask, jax.random.key(4), cache_segments=0, **kw)
