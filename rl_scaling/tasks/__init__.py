"""Tasks: problems, a tokenizer and a reward function behind one small interface.

A task provides
  tokenizer                      with encode/decode and pad/bos/eos ids
  train_problem(index)           the index-th problem of the training stream (deterministic)
  eval_problems(n)               n held-out problems, disjoint from training
  reward(response, problem)      a float; response is the decoded completion
  reference_completion(problem)  a correct completion, for the supervised warm start
"""

from __future__ import annotations

from rl_scaling.tasks import arithmetic
from rl_scaling.tasks.tokenizer import CharTokenizer


class ArithmeticTask:
    name = "arithmetic"

    def __init__(self, seed: int):
        self.seed = seed
        self.tokenizer = CharTokenizer()

    def train_problem(self, index: int) -> arithmetic.Problem:
        return arithmetic.train_problem(self.seed, index)

    def eval_problems(self, n: int):
        return arithmetic.eval_problems(n)

    reward = staticmethod(arithmetic.reward)
    reference_completion = staticmethod(arithmetic.reference_completion)


def _jsonl_math(task_cfg, seed):
    """Math word problems from a JSONL file (`task.path`), a tokenizer.json (`task.tokenizer`)."""
    from rl_scaling.tasks import hf_tokenizer, jsonl_math

    for field in ("path", "tokenizer"):
        if not task_cfg.get(field):
            raise ValueError(f"config.task.{field} must name a file for task.name='jsonl_math'")
    return jsonl_math.JsonlMathTask(task_cfg.path, hf_tokenizer.HFTokenizer(task_cfg.tokenizer), seed=seed,
                                    heldout_fraction=task_cfg.get("heldout_fraction", 0.02))


TASKS = {"arithmetic": lambda task_cfg, seed: ArithmeticTask(seed), "jsonl_math": _jsonl_math}


def make_task(task_cfg, seed: int):
    if task_cfg.name not in TASKS:
        raise ValueError(f"config.task.name={task_cfg.name!r} is not valid; choose one of {sorted(TASKS)}")
    return TASKS[task_cfg.name](task_cfg, seed)
