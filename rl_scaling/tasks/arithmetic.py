"""Synthetic verifiable arithmetic with graded difficulty (the embedded default task).

Each problem is `a op b` at one of eight levels, from 2-digit + 1-digit addition to
3-digit x 3-digit multiplication. The multiplication levels are beyond a ~100k-parameter
model, so the pass rate saturates well below 1.0: the ceiling A is not trivial.

Format (char tokens; every number written least-significant digit first and
zero-padded, operands to 3 digits and the result to 6, so that the digits a small
model combines sit at fixed relative offsets; 45 + 7 = 52 reads):

    prompt:      <bos>540+700=<think>
    completion:  250000</think>250000<eos>
                 ^ thinking        ^ answer

The thinking part is scratch; the reward looks only at the answer after `</think>`.
Held-out problems are those whose canonical key hashes into one bucket of
`HELDOUT_BUCKETS`; training draws skip that bucket, so the sets are disjoint by
construction.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

# level -> (operation, digits of a, digits of b)
LEVELS = (
    ("+", 2, 1), ("+", 2, 2), ("+", 3, 3),
    ("-", 2, 1), ("-", 3, 2),
    ("*", 2, 1), ("*", 2, 2), ("*", 3, 3),
)
OPERAND_WIDTH, RESULT_WIDTH = 3, 6
HELDOUT_BUCKETS = 8  # one bucket in eight is held out
MAX_HELDOUT_PER_LEVEL = 128


@dataclasses.dataclass(frozen=True)
class Problem:
    key: str  # canonical identity, e.g. "45+7"; NPR history and the split use it
    prompt: str
    answer: str
    level: int


def _operand_range(digits):
    return (0 if digits == 1 else 10 ** (digits - 1)), 10**digits


def make_problem(level: int, a: int, b: int) -> Problem:
    op = LEVELS[level][0]
    if op == "-" and b > a:
        a, b = b, a
    result = {"+": a + b, "-": a - b, "*": a * b}[op]
    answer = str(result).zfill(RESULT_WIDTH)[::-1]
    prompt = f"<bos>{str(a).zfill(OPERAND_WIDTH)[::-1]}{op}{str(b).zfill(OPERAND_WIDTH)[::-1]}=<think>"
    return Problem(key=f"{a}{op}{b}", prompt=prompt, answer=answer, level=level)


def is_heldout(key: str) -> bool:
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % HELDOUT_BUCKETS == 0


def _draw(rng: np.random.Generator, level: int) -> Problem:
    _, da, db = LEVELS[level]
    return make_problem(level, int(rng.integers(*_operand_range(da))), int(rng.integers(*_operand_range(db))))


def train_problem(seed: int, index: int) -> Problem:
    """The training problem at `index` of the stream: deterministic, never held out."""
    rng = np.random.default_rng((seed, index))
    level = int(rng.integers(len(LEVELS)))
    while True:
        problem = _draw(rng, level)
        if not is_heldout(problem.key):
            return problem


def heldout_pool(seed: int = 0) -> list[Problem]:
    """Up to MAX_HELDOUT_PER_LEVEL distinct held-out problems per level, level-major."""
    pool = []
    for level in range(len(LEVELS)):
        rng = np.random.default_rng((seed, 10_000 + level))
        found: dict[str, Problem] = {}
        for _ in range(50 * MAX_HELDOUT_PER_LEVEL):
            problem = _draw(rng, level)
            if is_heldout(problem.key):
                found.setdefault(problem.key, problem)
                if len(found) == MAX_HELDOUT_PER_LEVEL:
                    break
        pool.extend(found.values())
    return pool


def eval_problems(num_prompts: int, seed: int = 0) -> list[Problem]:
    """A level-stratified eval set drawn from the held-out pool."""
    pool = heldout_pool(seed)
    if num_prompts > len(pool):
        raise ValueError(f"eval.num_prompts={num_prompts} is larger than the held-out pool ({len(pool)} problems)")
    by_level = [[p for p in pool if p.level == lvl] for lvl in range(len(LEVELS))]
    chosen, i = [], 0
    while len(chosen) < num_prompts:  # round-robin over levels keeps the mix even
        level_pool = by_level[i % len(LEVELS)]
        if i // len(LEVELS) < len(level_pool):
            chosen.append(level_pool[i // len(LEVELS)])
        i += 1
    return chosen


def extract_answer(response: str) -> str | None:
    """The answer after the end of thinking, up to <eos>; None if thinking never ended."""
    if "</think>" not in response:
        return None
    answer = response.rsplit("</think>", 1)[1]
    return answer.split("<eos>", 1)[0].strip()


def reward(response: str, problem: Problem) -> float:
    """Exact-answer verifier: 1.0 for the right digits after </think>, else 0.0."""
    return float(extract_answer(response) == problem.answer)


def reference_completion(problem: Problem) -> str:
    """A correct completion in the task's reasoning format (for the supervised warm start)."""
    return f"{problem.answer}</think>{problem.answer}<eos>"
