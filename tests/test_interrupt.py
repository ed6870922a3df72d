"""Forced interruption on a real sampled batch: a sample over its thinking budget gets the
phrase injected token for token, then answers; the reward is computed on that answer; the
injected tokens carry zero loss weight. The budgets come from the config's [lo, hi]."""

import itertools

import jax
import numpy as np
import pytest

from configs import tiny
from rl_scaling import data, sharding, tasks
from rl_scaling.rl import train_step as ts
from rl_scaling.rollout import collect, length_control
from rl_scaling.tasks import arithmetic
from tests.conftest import TINY

PHRASE = "time is up</think>"
P, G, T = 4, 8, 32
LO, HI, ANSWER = 2, 4, 8


@pytest.fixture(scope="module")
def setup():
    task = tasks.ArithmeticTask(0)
    tok = task.tokenizer
    problem = arithmetic.make_problem(0, 45, 7)
    # Memorize one problem, in both formats: thinking closed by the model, and thinking cut
    # after 2-4 tokens by the phrase, then the answer.
    think = problem.answer
    completions = [task.reference_completion(problem)] + [f"{think[:k]}{PHRASE}{problem.answer}<eos>" for k in (2, 3, 4)]
    batch_c = (completions * 4)[:16]
    prompt, prompt_mask = data.encode_prompts(tok, [problem.prompt] * 16, 16)
    comp, comp_mask = data.encode_completions(tok, batch_c, T)
    tokens, token_mask = data.pack_sequences(prompt, prompt_mask, comp, comp_mask)
    loss_mask = np.concatenate([np.zeros_like(prompt_mask), comp_mask], 1).astype(np.float32)
    mesh = sharding.make_mesh({"fsdp": 1}, devices=jax.devices()[:1])
    cfg = tiny.get_config()
    cfg.optim.lr, cfg.optim.warmup_steps = 3e-3, 5
    opt = ts.make_optimizer(cfg.optim)
    sh = ts.state_shardings(TINY, opt, mesh)
    state = ts.init_state(TINY, opt, jax.random.key(0), mesh, sh)
    step = ts.jit_step(ts.sft_step, sh, mesh, ts.SFT_BATCH_KEYS, model_cfg=TINY, optimizer=opt)
    for _ in range(150):
        state, m = step(state, {"tokens": tokens, "token_mask": token_mask, "loss_mask": loss_mask})
    assert float(m["loss"]) < 0.3, float(m["loss"])

    cfg.rollout.length_control, cfg.rollout.interrupt_phrase = "interrupt", PHRASE
    cfg.rollout.think_budget_lo, cfg.rollout.think_budget_hi, cfg.rollout.answer_budget = LO, HI, ANSWER
    cfg.rollout.max_new_tokens = T
    length = length_control.LengthControl(cfg, tok)
    stream = itertools.repeat([problem] * P)
    ro = collect.sync_rollouts(state["params"], TINY, task, stream, P, G, jax.random.key(1), length=length,
                               max_prompt_len=16, max_new_tokens=T, temperature=1.0)
    return task, problem, ro


def test_budget_exceeded_phrase_injected_and_answer_produced(setup):
    task, problem, ro = setup
    tok = task.tokenizer
    phrase = tok.encode(PHRASE)
    out = ro.out
    starts = []
    for i in range(P * G):
        toks, forced, n = out.tokens_BT[i], out.forced_BT[i], out.lengths_B[i]
        if not out.interrupted_B[i]:  # the model closed its thinking itself, before its budget
            assert not forced.any() and tok.think_end_id in toks[:HI].tolist()
            continue
        start = int(np.argmax(forced))
        starts.append(start)
        assert LO <= start <= HI  # the budget, drawn from [lo, hi]
        assert tok.think_end_id not in toks[:start].tolist()  # the budget was exceeded while thinking
        np.testing.assert_array_equal(toks[start:start + len(phrase)], phrase)  # injected exactly
        assert forced[start:start + len(phrase)].all() and forced.sum() == len(phrase)
        assert (out.logprobs_BT[i][forced] == 0).all()
        answer = toks[start + len(phrase):n]
        assert 1 <= len(answer) <= ANSWER  # an answer was sampled, within its budget
        assert not out.truncated_B[i] or len(answer) == ANSWER
    assert len(starts) >= P * G * 3 // 4  # this model rarely closes its thinking within 4 tokens
    assert set(starts) == {2, 3, 4}  # budgets vary per sample


def test_reward_is_computed_on_the_answer_after_the_phrase(setup):
    task, problem, ro = setup
    tok = task.tokenizer
    n_phrase = len(tok.encode(PHRASE))
    correct = 0
    for i in range(P * G):
        toks, n = ro.out.tokens_BT[i], ro.out.lengths_B[i]
        if ro.out.interrupted_B[i]:  # the answer: what was sampled after the injected phrase
            answer_from = int(np.argmax(ro.out.forced_BT[i])) + n_phrase
        else:  # after the model's own (last) </think>
            answer_from = n - toks[:n][::-1].tolist().index(tok.think_end_id)
        answer = tok.decode(toks[answer_from:n]).replace("<eos>", "")
        if "</think>" in answer:  # the model closed its thinking once more: the last one counts
            continue
        expected = float(answer == problem.answer)
        assert ro.rewards[i] == expected == task.reward(tok.decode(toks[:n]), problem)
        assert ro.correct[i] == expected
        correct += expected
    assert correct >= P * G // 2, correct  # the memorized answer comes out after the phrase


def test_injected_tokens_have_zero_loss_weight(setup):
    _, _, ro = setup
    batch = collect.rl_batch(ro.prompt_tokens, ro.prompt_mask, ro.out, ro.rewards, P, G)
    L0 = ro.prompt_tokens.shape[1]
    loss_mask = batch["loss_mask"].reshape(P * G, -1)[:, L0:]
    old_logp = batch["old_logp"].reshape(P * G, -1)[:, L0:]
    sampled = (np.arange(T)[None] < ro.out.lengths_B[:, None]) & ~ro.out.forced_BT
    np.testing.assert_array_equal(loss_mask, sampled.astype(np.float32))
    assert (loss_mask[ro.out.forced_BT] == 0).all() and ro.out.forced_BT.sum() > 0
    assert (old_logp[ro.out.forced_BT] == 0).all()
    assert (batch["loss_mask"].reshape(P * G, -1)[:, :L0] == 0).all()  # nor the prompt


def test_phrase_and_budget_errors_name_the_fields():
    tok = tasks.ArithmeticTask(0).tokenizer
    cfg = tiny.get_config()
    cfg.rollout.interrupt_phrase = "time is up"
    with pytest.raises(ValueError, match="config.rollout.interrupt_phrase"):
        length_control.LengthControl(cfg, tok)
    cfg = tiny.get_config()
    cfg.rollout.interrupt_phrase = "time is up</think>"  # 11 tokens: 8 + 11 + 7 > 16
    with pytest.raises(ValueError, match="config.rollout.max_new_tokens=16"):
        length_control.LengthControl(cfg, tok)
    cfg = tiny.get_config()
    cfg.rollout.think_budget_lo, cfg.rollout.think_budget_hi = 9, 8
    with pytest.raises(ValueError, match="think_budget_lo=9"):
        length_control.LengthControl(cfg, tok)
