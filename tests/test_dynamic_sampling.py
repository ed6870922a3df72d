"""DAPO's dynamic sampling (refill until the step has P groups with mixed rewards, bounded,
every generated sequence counted) and the overlong penalty, on a scripted generator."""

import itertools

import jax
import numpy as np
import pytest

from configs import tiny
from rl_scaling.rollout import collect, length_control, sampler
from rl_scaling.tasks import arithmetic
from rl_scaling.tasks.tokenizer import CharTokenizer

P, G, T = 4, 4, 16


class ScriptedTask:
    tokenizer = CharTokenizer()


def scripted_generate(outcomes, lengths=None):
    """collect.generate stand-in: problem.key -> per-sample rewards (all 1, all 0 or mixed)."""
    def generate(params, gen_cfg, task, problems, G, rng, *, interrupt=None, **kw):
        n = len(problems) * G
        prompt = np.array([[i // G + 1] for i in range(n)], np.int32)  # tells the rows apart
        out = sampler.Samples(np.zeros((n, T), np.int32), np.zeros((n, T), np.float32), np.zeros((n, T), bool),
                              np.full(n, 14 if lengths is None else lengths, np.int32), np.zeros(n, bool), np.zeros(n, bool))
        rewards = np.concatenate([outcomes[p.key] for p in problems]).astype(np.float32)
        return prompt, np.ones_like(prompt, bool), out, None, rewards
    return generate


def _problems(n):
    return [arithmetic.make_problem(0, 10 + i, 1) for i in range(n)]


def _length(**rollout):
    c = tiny.get_config()
    for k, v in rollout.items():
        c.rollout[k] = v
    c.rollout.length_control = rollout.get("length_control", "none")
    return length_control.LengthControl(c, CharTokenizer())


def test_refills_until_every_group_is_mixed(monkeypatch):
    probs = _problems(12)
    mixed, solved, failed = [1, 0, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]
    # round 1: 1 mixed of 4; round 2: 2 mixed; round 3: 3 mixed (only 1 needed)
    pattern = [solved, mixed, failed, solved, mixed, failed, mixed, solved, mixed, mixed, mixed, failed]
    outcomes = {p.key: np.array(o) for p, o in zip(probs, pattern)}
    monkeypatch.setattr(collect, "generate", scripted_generate(outcomes))
    stream = iter([probs[0:4], probs[4:8], probs[8:12]])
    ro = collect.sync_rollouts(None, None, ScriptedTask(), stream, P, G, jax.random.key(0), length=_length(),
                               dynamic_rounds=4, max_prompt_len=16, max_new_tokens=T, temperature=1.0)
    assert [p.key for p in ro.problems] == [probs[i].key for i in (1, 4, 6, 8)]  # the first 4 mixed, in order
    np.testing.assert_array_equal(ro.rewards.reshape(P, G), [mixed] * 4)
    assert ro.metrics == {"rollout/ds_rounds": 3.0, "rollout/ds_padded_groups": 0.0, "rollout/ds_generated_groups": 12.0}
    assert len(ro.generated[1]) == 12 * G  # every generated sequence is compute
    assert ro.prompt_tokens.shape == (P * G, 1) and ro.out.tokens_BT.shape == (P * G, T)


def test_bounded_rounds_pad_with_the_newest_uniform_groups(monkeypatch):
    probs = _problems(8)
    pattern = [[1, 1, 1, 1], [0, 1, 0, 0]] + [[0, 0, 0, 0]] * 6
    outcomes = {p.key: np.array(o) for p, o in zip(probs, pattern)}
    monkeypatch.setattr(collect, "generate", scripted_generate(outcomes))
    stream = iter([probs[0:4], probs[4:8]])
    ro = collect.sync_rollouts(None, None, ScriptedTask(), stream, P, G, jax.random.key(0), length=_length(),
                               dynamic_rounds=1, max_prompt_len=16, max_new_tokens=T, temperature=1.0)
    assert ro.problems[0].key == probs[1].key and [p.key for p in ro.problems[1:]] == [probs[i].key for i in (7, 6, 5)]
    assert ro.metrics["rollout/ds_padded_groups"] == 3.0 and ro.metrics["rollout/ds_rounds"] == 2.0


def test_without_dynamic_sampling_the_batch_is_the_stream_batch(monkeypatch):
    probs = _problems(4)
    outcomes = {p.key: np.array([1, 1, 1, 1]) for p in probs}
    monkeypatch.setattr(collect, "generate", scripted_generate(outcomes))
    ro = collect.sync_rollouts(None, None, ScriptedTask(), itertools.repeat(probs), P, G, jax.random.key(0),
                               length=_length(), max_prompt_len=16, max_new_tokens=T, temperature=1.0)
    assert [p.key for p in ro.problems] == [p.key for p in probs] and ro.metrics == {}
    assert (ro.correct == 1).all() and len(ro.generated[1]) == P * G


def test_overlong_penalty_dapo_formula():
    lengths = np.arange(0, 17)
    pen = length_control.overlong_penalty(lengths, max_len=16, cache=4)
    for n, p in zip(lengths, pen):  # 0 up to L_max - L_cache, linear to -1 at L_max
        assert p == pytest.approx(min(0.0, max(-1.0, (16 - n) / 4 - 1)))
    assert pen[12] == 0 and pen[14] == pytest.approx(-0.5) and pen[16] == -1


def test_overlong_penalty_reaches_correct_samples_only(monkeypatch):
    probs = _problems(4)
    outcomes = {p.key: np.array([1, 0, 1, 0]) for p in probs}
    lengths = np.tile([16, 16, 12, 12], P)
    monkeypatch.setattr(collect, "generate", scripted_generate(outcomes, lengths))
    length = _length(length_control="overlong")
    length.max_len, length.cache = 16, 4
    ro = collect.sync_rollouts(None, None, ScriptedTask(), itertools.repeat(probs), P, G, jax.random.key(0),
                               length=length, max_prompt_len=16, max_new_tokens=T, temperature=1.0)
    np.testing.assert_allclose(ro.rewards.reshape(P, G), [[0.0, 0.0, 1.0, 0.0]] * P)  # 1 - 1 at L_max
    np.testing.assert_array_equal(ro.correct.reshape(P, G), [[1, 0, 1, 0]] * P)  # the pass rate is untouched
