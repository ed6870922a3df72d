"""The synthetic task: disjoint splits, the verifier, the tokenizer, the grain stream."""

import numpy as np
import pytest

from rl_scaling import data
from rl_scaling.tasks import ArithmeticTask, arithmetic
from rl_scaling.tasks.tokenizer import CharTokenizer


def test_heldout_problems_never_appear_in_training():
    task = ArithmeticTask(seed=0)
    heldout = {p.key for p in arithmetic.heldout_pool()}
    assert len(heldout) >= 8 * 100
    stream = data.prompt_stream(task, seed=0, prompts_per_step=64)
    seen = set()
    for _ in range(150):  # ~10k training prompts through the real grain pipeline
        seen.update(p.key for p in next(stream))
    assert not (seen & heldout)
    # The split really is a split of one distribution: training covers every level.
    assert {arithmetic.train_problem(0, i).level for i in range(200)} == set(range(len(arithmetic.LEVELS)))


def test_reward_checks_the_answer_after_thinking():
    p = arithmetic.make_problem(0, 45, 7)
    assert p.answer == "250000" and p.prompt == "<bos>540+700=<think>"
    assert arithmetic.reward("250000</think>250000<eos>", p) == 1.0
    assert arithmetic.reward("999999</think>250000<eos>", p) == 1.0  # thinking is not graded
    assert arithmetic.reward("250000</think>250001<eos>", p) == 0.0
    assert arithmetic.reward("250000250000<eos>", p) == 0.0  # thinking never ended
    for i in range(200):
        q = arithmetic.train_problem(3, i)
        op = arithmetic.LEVELS[q.level][0]
        a, b = q.key.split(op)
        expected = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert int(q.answer[::-1]) == expected and expected >= 0


def test_eval_set_is_stratified_and_bounded():
    probs = arithmetic.eval_problems(64)
    assert np.bincount([p.level for p in probs]).tolist() == [8] * 8
    with pytest.raises(ValueError, match="eval.num_prompts"):
        arithmetic.eval_problems(len(arithmetic.heldout_pool()) + 1)


def test_tokenizer_round_trip_and_errors():
    tok = CharTokenizer()
    text = "<bos>540+700=<think>250000</think>250000<eos>"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and ids[0] == tok.bos_id and tok.think_end_id in ids
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tok.encode("12#")


def test_stream_resumes_from_its_state():
    task = ArithmeticTask(seed=1)
    it = data.prompt_stream(task, seed=1, prompts_per_step=8)
    next(it)
    state = it.get_state()
    expected = [next(it) for _ in range(3)]
    resumed = data.prompt_stream(task, seed=1, prompts_per_step=8)
    resumed.set_state(state)
    assert [next(resumed) for _ in range(3)] == expected


def test_stream_reads_in_the_calling_thread():
    """No prefetch threads: they competed with XLA for the 2 cores (the tiny run 1.8x slower)."""
    import threading

    it = data.prompt_stream(ArithmeticTask(seed=0), seed=0, prompts_per_step=8)
    for _ in range(3):
        next(it)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("grain")]


def test_jsonl_math_task_runs_end_to_end(tmp_path):
    """A JSONL dataset + a tokenizer.json made here, through the real run loop for 2 steps."""
    import json
    import re

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from rl_scaling import tasks, train
    from tests.test_run import fast_config

    rows = [{"problem": f"What is {a} + {b}?", "answer": str(a + b)} for a in range(12) for b in range(12)]
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([r["problem"] + " \\boxed{" + r["answer"] + "}" for r in rows],
                            trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<s>", "</s>", "<think>", "</think>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    config = fast_config(steps=2, eval_every=2, checkpoint_every=2)
    config.task.name, config.task.path = "jsonl_math", str(tmp_path / "data.jsonl")
    config.task.tokenizer, config.task.heldout_fraction = str(tmp_path / "tokenizer.json"), 0.2
    config.task.max_prompt_len, config.model.vocab_size = 96, 320
    config.rollout.max_new_tokens = 24
    result = train.train(config, str(tmp_path / "run"))
    assert result["step"] == 2
    # 5 warm-start steps teach a 0.1M-parameter policy no sums: none of the 16 x 2 held-out
    # samples ends in the right \boxed{} answer.
    assert result["eval/pass_rate"] == 0.0
    # ... and the zero is the policy's: the run's verifier passes a completion with the sum
    # worked out here for each of the same 16 held-out problems, and none off by one.
    task = tasks.make_task(config.task, config.seed)
    problems = task.eval_problems(config.eval.num_prompts)
    assert len(problems) == 16
    sums = [sum(int(n) for n in re.fullmatch(r"What is (\d+) \+ (\d+)\?", p.problem).groups()) for p in problems]
    right = [task.reward(f"</think>The answer is \\boxed{{{s}}}.", p) for s, p in zip(sums, problems)]
    wrong = [task.reward(f"</think>The answer is \\boxed{{{s + 1}}}.", p) for s, p in zip(sums, problems)]
    assert sum(right) == 16 and sum(wrong) == 0
