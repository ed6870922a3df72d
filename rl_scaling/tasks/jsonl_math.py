"""Math problems from a JSONL file (e.g. Polaris-53K): one {"problem": ..., "answer": ...} per
line, field names configurable. Rewards come from `math_verify.verify`.

Rows are checked on load; a malformed one (bad JSON, not an object, a missing or empty field)
is an error naming the file and the line. Blank lines are skipped; a problem seen twice keeps
its first answer.

The train/held-out split hashes each problem's text (whitespace-normalised) into 2^64
buckets, so it is deterministic, independent of the file's order and stable when rows are
added: a problem is held out iff its hash falls in the first `heldout_fraction` of the range.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json

import numpy as np

from rl_scaling import paths
from rl_scaling.tasks import math_verify

DEFAULT_TEMPLATE = (
    "{bos}{problem}\nPlease reason step by step, and put your final answer within \\boxed{}.<think>"
)


@dataclasses.dataclass(frozen=True)
class MathProblem:
    key: str  # stable identity (hash of the problem text): NPR history and the split use it
    prompt: str
    answer: str
    problem: str
    level: int = 0


def problem_key(problem: str) -> str:
    return hashlib.blake2b(" ".join(problem.split()).encode(), digest_size=8).hexdigest()


def is_heldout(problem: str, heldout_fraction: float) -> bool:
    return int(problem_key(problem), 16) < heldout_fraction * 2**64


def load_jsonl(path: str, problem_field: str = "problem", answer_field: str = "answer") -> list[tuple[str, str]]:
    """(problem, answer) pairs, in file order, first occurrence of each problem."""
    rows, seen = [], set()
    with paths.open_file(path, "r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
            for field in (problem_field, answer_field):
                if field not in row:
                    raise ValueError(f"{where}: missing field {field!r} (fields present: {sorted(row)})")
            problem, answer = row[problem_field], row[answer_field]
            if not isinstance(problem, str) or not problem.strip():
                raise ValueError(f"{where}: field {problem_field!r} must be a non-empty string, got {problem!r}")
            if isinstance(answer, (int, float)) and not isinstance(answer, bool):
                answer = str(answer)
            if not isinstance(answer, str) or not answer.strip():
                raise ValueError(f"{where}: field {answer_field!r} is empty or not a string/number: {answer!r}")
            if problem not in seen:
                seen.add(problem)
                rows.append((problem, answer.strip()))
    if not rows:
        raise ValueError(f"{path}: no problems")
    return rows


def split(rows, heldout_fraction: float):
    """(train, heldout) lists of (problem, answer); held-out ones sorted by key (a fixed order)."""
    train = [r for r in rows if not is_heldout(r[0], heldout_fraction)]
    heldout = sorted((r for r in rows if is_heldout(r[0], heldout_fraction)), key=lambda r: problem_key(r[0]))
    return train, heldout


class JsonlMathTask:
    """The task interface of rl_scaling.tasks (train_problem / eval_problems / reward)."""

    name = "jsonl_math"

    def __init__(self, path: str, tokenizer, seed: int = 0, heldout_fraction: float = 0.02,
                 problem_field: str = "problem", answer_field: str = "answer", template: str = DEFAULT_TEMPLATE):
        if not 0.0 <= heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
        self.seed, self.tokenizer, self.template = seed, tokenizer, template
        self.train, self.heldout = split(load_jsonl(path, problem_field, answer_field), heldout_fraction)
        if not self.train:
            raise ValueError(f"{path}: every problem is held out (heldout_fraction={heldout_fraction})")
        tok = getattr(tokenizer, "tok", None)  # HFTokenizer: the BOS token's text
        self.bos_text = tok.id_to_token(tokenizer.bos_id) if tok is not None else "<bos>"

    def _problem(self, row) -> MathProblem:
        problem, answer = row
        prompt = self.template.replace("{bos}", self.bos_text).replace("{problem}", problem)
        return MathProblem(key=problem_key(problem), prompt=prompt, answer=answer, problem=problem)

    @functools.lru_cache(maxsize=4)  # noqa: B019 (one task per run: the cache lives as long as it)
    def _order(self, epoch: int):
        return np.random.default_rng((self.seed, epoch)).permutation(len(self.train))

    def train_problem(self, index: int) -> MathProblem:
        """Epoch-wise reshuffled pass over the training problems (deterministic in seed, index)."""
        epoch, i = divmod(int(index), len(self.train))
        return self._problem(self.train[int(self._order(epoch)[i])])

    def eval_problems(self, n: int) -> list[MathProblem]:
        if n > len(self.heldout):
            raise ValueError(f"eval.num_prompts={n} is larger than the held-out set ({len(self.heldout)} problems)")
        return [self._problem(r) for r in self.heldout[:n]]

    @staticmethod
    def reward(response: str, problem: MathProblem) -> float:
        return math_verify.verify(response, problem.answer)

    @staticmethod
    def reference_completion(problem: MathProblem) -> str:
        """A minimal correct completion (there are no worked solutions in the data)."""
        return f"</think>The answer is \\boxed{{{problem.answer}}}."
