"""Length control: ScaleRL's forced interruption, or DAPO's overlong penalty.

config.rollout.length_control:
  "none"       a completion that hits rollout.max_new_tokens is truncated (no answer, reward 0)
  "interrupt"  ScaleRL: each sample gets a thinking budget drawn uniformly from
               [rollout.think_budget_lo, rollout.think_budget_hi]; a sample still thinking at
               its budget gets rollout.interrupt_phrase (which ends with </think>) injected as
               tokens, then rollout.answer_budget more sampled tokens to answer. The injected
               tokens carry zero loss weight (collect.rl_batch); the reward reads the answer
               after the last </think> as usual. (Paper: budget U[10k, 12k], answer 2k,
               "Okay, time is up. Let me stop thinking and formulate a final answer now. </think>".)
  "overlong"   DAPO's soft overlong punishment, added to the reward of correct samples
               (as docs/paper.md reads the ScaleRL paper; DAPO itself adds it to every sample):
               clip((L_max - len) / L_cache - 1, -1, 0), L_max = rl.overlong_max_len
               (0: rollout.max_new_tokens), L_cache = rl.overlong_cache; len = generated tokens.
"""

from __future__ import annotations

import jax
import numpy as np

MODES = ("none", "interrupt", "overlong")
THINK_END = "</think>"


def check(config) -> None:
    """Checks that need no tokenizer; each error names the fields at fault."""
    rc, rl = config.rollout, config.rl
    if rc.length_control not in MODES:
        raise ValueError(f"config.rollout.length_control={rc.length_control!r} is not valid; choose one of {list(MODES)}")
    if rc.length_control == "interrupt":
        if not isinstance(rc.interrupt_phrase, str) or not rc.interrupt_phrase.rstrip().endswith(THINK_END):
            raise ValueError(f"config.rollout.interrupt_phrase={rc.interrupt_phrase!r} must end with {THINK_END!r}: "
                             "the model answers after the end of its thinking")
        if not 1 <= rc.think_budget_lo <= rc.think_budget_hi:
            raise ValueError(f"config.rollout.think_budget_lo={rc.think_budget_lo} and think_budget_hi="
                             f"{rc.think_budget_hi} must satisfy 1 <= lo <= hi")
        if rc.answer_budget < 1:
            raise ValueError(f"config.rollout.answer_budget={rc.answer_budget} must be >= 1")
    if rc.length_control == "overlong":
        max_len = rl.overlong_max_len or rc.max_new_tokens
        if not 1 <= rl.overlong_cache < max_len <= rc.max_new_tokens:
            raise ValueError(f"config.rl.overlong_cache={rl.overlong_cache} and config.rl.overlong_max_len="
                             f"{rl.overlong_max_len} (0 = rollout.max_new_tokens) must satisfy 1 <= cache < max_len "
                             f"<= config.rollout.max_new_tokens={rc.max_new_tokens}")


def phrase_ids(tokenizer, phrase: str) -> tuple[int, ...]:
    ids = tuple(int(i) for i in tokenizer.encode(phrase.rstrip()))
    if not ids or ids[-1] != tokenizer.think_end_id:
        raise ValueError(f"config.rollout.interrupt_phrase={phrase!r} does not tokenize to a sequence ending with the "
                         f"tokenizer's {THINK_END} token (id {tokenizer.think_end_id}): got {list(ids)}")
    return ids


def overlong_penalty(lengths, max_len: int, cache: int) -> np.ndarray:
    """DAPO: 0 up to max_len - cache tokens, then linearly down to -1 at max_len."""
    lengths = np.asarray(lengths, np.float64)
    return np.clip((max_len - lengths) / cache - 1.0, -1.0, 0.0).astype(np.float32)


class LengthControl:
    """The run's length control, built once from the config and the task's tokenizer."""

    def __init__(self, config, tokenizer):
        check(config)
        rc, rl = config.rollout, config.rl
        self.mode = rc.length_control
        self.lo, self.hi, self.answer_budget = int(rc.think_budget_lo), int(rc.think_budget_hi), int(rc.answer_budget)
        self.max_len, self.cache = int(rl.overlong_max_len or rc.max_new_tokens), int(rl.overlong_cache)
        self.phrase = ()
        if self.mode == "interrupt":
            self.phrase = phrase_ids(tokenizer, rc.interrupt_phrase)
            need = self.hi + len(self.phrase) + self.answer_budget
            if need > rc.max_new_tokens:
                raise ValueError(
                    f"config.rollout.think_budget_hi={self.hi} + the interrupt phrase's {len(self.phrase)} tokens + "
                    f"config.rollout.answer_budget={self.answer_budget} = {need} exceeds config.rollout.max_new_tokens="
                    f"{rc.max_new_tokens}: an interrupted sample could not finish its answer")

    def interrupt_args(self, rng, n: int):
        """(think_budget_B, phrase ids, answer budget) for collect.generate, or None."""
        if self.mode != "interrupt":
            return None
        budgets = jax.random.randint(jax.random.fold_in(rng, 0x1e57), (n,), self.lo, self.hi + 1)
        return budgets, self.phrase, self.answer_budget

    def shape_rewards(self, rewards, lengths) -> np.ndarray:
        """The training reward: the verifier's, plus the overlong penalty on correct samples."""
        rewards = np.asarray(rewards, np.float32)
        if self.mode != "overlong":
            return rewards
        return rewards + np.where(rewards > 0, overlong_penalty(lengths, self.max_len, self.cache), 0.0).astype(np.float32)
