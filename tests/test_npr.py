"""No-Positive-Resampling: a prompt whose pass rate reached the threshold is never sampled
again, also after a resume from a checkpoint (the history travels in the checkpoint's JSON
meta and is restored before the stream's iterator state)."""

import json
import os
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from rl_scaling import checkpoint, data
from rl_scaling.rl import filters
from rl_scaling.tasks import arithmetic
from rl_scaling.tasks.tokenizer import CharTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _few_problems(n=12):
    out, a = [], 10
    while len(out) < n:
        p = arithmetic.make_problem(1, a, 11)
        if not arithmetic.is_heldout(p.key):
            out.append(p)
        a += 1
    return out


class FewPromptsTask:
    """Twelve distinct training prompts, so prompts recur every few steps; four of them are
    always answered correctly (pass rate 1.0), the others never."""

    name = "fewprompts"
    PROBLEMS = _few_problems()
    EASY = {p.key for p in PROBLEMS[:4]}

    def __init__(self, seed=0):
        self.tokenizer = CharTokenizer()

    def train_problem(self, index):
        return self.PROBLEMS[index % len(self.PROBLEMS)]

    def eval_problems(self, n):
        return arithmetic.eval_problems(n)

    def reward(self, response, problem):
        if problem.key in self.EASY:
            return 1.0
        return arithmetic.reward(response, problem)

    reference_completion = staticmethod(arithmetic.reference_completion)


def _step(stream, npr, tok, G=4):
    problems = next(stream)
    prompts, mask = data.encode_prompts(tok, [p.prompt for p in problems], 16)
    correct = np.array([[1.0] * G if p.key in FewPromptsTask.EASY else [0.0, 1.0, 0.0, 0.0] for p in problems])
    npr.update(prompts, mask, correct)
    return [p.key for p in problems]


def test_removed_prompts_never_come_back_also_after_resume(tmp_path):
    task = FewPromptsTask()
    tok = task.tokenizer
    npr = filters.NoPositiveResampling(tok, 0.9)
    stream = data.prompt_stream(task, 0, 6, keep=npr.keep)
    ckpts = checkpoint.Checkpoints(str(tmp_path / "ckpt"))
    removed_at = {}
    for step in range(1, 9):
        keys = _step(stream, npr, tok)
        assert not set(keys) & set(removed_at), (step, keys)  # filtered from the very next batch on
        for k in keys:
            if k in FewPromptsTask.EASY:
                removed_at.setdefault(k, step)
    assert set(removed_at) == FewPromptsTask.EASY  # every easy prompt was seen, then removed
    assert npr.removed == {filters.prompt_key(tok.encode(p.prompt)) for p in FewPromptsTask.PROBLEMS[:4]}
    ckpts.save(8, {"x": jnp.zeros(2)}, {"data": stream.get_state(), "npr": npr.state()})  # saves are synchronous

    # Resume in a fresh "process": history first, then the iterator state.
    _, _, meta = ckpts.restore_latest({"x": jnp.zeros(2)})
    ckpts.close()
    json.dumps(meta)  # plain JSON
    npr2 = filters.NoPositiveResampling(tok, 0.9)
    npr2.load(meta["npr"])
    resumed = data.prompt_stream(task, 0, 6, keep=npr2.keep)
    resumed.set_state(meta["data"])
    assert npr2.history == npr.history and npr2.removed == npr.removed
    for _ in range(6):  # the resumed stream is the uninterrupted one, and never yields an easy prompt
        a, b = _step(stream, npr, tok), _step(resumed, npr2, tok)
        assert a == b and not set(b) & FewPromptsTask.EASY
    assert npr2.state() == npr.state()


def test_history_counts_and_threshold():
    tok = CharTokenizer()
    npr = filters.NoPositiveResampling(tok, 0.75)
    prompts, mask = data.encode_prompts(tok, ["<bos>01+01=<think>", "<bos>02+01=<think>"], 16)
    m = npr.update(prompts, mask, np.array([[1, 1, 1, 0], [1, 0, 0, 0]]))  # 0.75 reaches 0.75
    assert m["npr/removed"] == 1 and m["npr/removed_this_step"] == 1
    k0 = filters.prompt_key(tok.encode("<bos>01+01=<think>"))
    k1 = filters.prompt_key(tok.encode("<bos>02+01=<think>"))
    assert npr.removed == {k0} and npr.history == {k0: [3, 4], k1: [1, 4]}
    npr.update(prompts[1:], mask[1:], np.array([[1, 1, 0, 0]]))
    assert npr.history[k1] == [3, 8] and k1 not in npr.removed  # the latest sampling's rate decides
    with pytest.raises(ValueError, match="npr_threshold"):
        filters.NoPositiveResampling(tok, 1.5)


def _e2e_config(steps):
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_run import fast_config

    c = fast_config(steps=steps, eval_every=4, checkpoint_every=2, log_every=1)
    c.task.name = "fewprompts"
    return c


@pytest.mark.slow
def test_train_loop_npr_survives_resume(tmp_path, monkeypatch):
    from rl_scaling import tasks, train

    monkeypatch.setitem(tasks.TASKS, "fewprompts", lambda task_cfg, seed: FewPromptsTask(seed))
    seen = []  # (problem key) of every training sample's reward call, in order
    orig = FewPromptsTask.reward

    def reward(self, response, problem):
        if not arithmetic.is_heldout(problem.key):
            seen.append(problem.key)
        return orig(self, response, problem)

    monkeypatch.setattr(FewPromptsTask, "reward", reward)
    train.train(_e2e_config(4), str(tmp_path))
    first = list(seen)
    assert set(first) & FewPromptsTask.EASY  # easy prompts were sampled ...
    seen.clear()
    train.train(_e2e_config(8), str(tmp_path))  # resumes from the step-4 checkpoint
    assert seen and not set(seen) & FewPromptsTask.EASY  # ... and never again after the resume
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    steps = [r for r in rows if "npr/removed" in r]
    assert [r["step"] for r in steps] == list(range(1, 9))
    assert steps[-1]["npr/removed"] == 4
    assert all("interruption_rate" in r and "truncation_rate" in r for r in steps)
    meta = json.load(open(tmp_path / "checkpoints" / "8" / "meta" / "metadata"))
    assert len(meta["npr"]["removed"]) == 4
