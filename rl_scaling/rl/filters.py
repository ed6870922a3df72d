"""Prompt filters that act on the data stream (the zero-variance filter acts on the loss:
`losses.advantages`).

No-Positive-Resampling (ScaleRL, after Polaris): every prompt's pass rate is recorded each
time it is sampled; a prompt whose pass rate in one sampling (its G samples) reaches
`threshold` (0.9) is removed from the stream for good. The paper keeps a pass-rate history
and removes prompts with pass rate >= 0.9 from later epochs; we read "pass rate" as the
latest sampling's, and keep the cumulative counts too (logged, and checkpointed).

Prompts are identified by a hash of their token ids, so the same rule works in both
rollout modes (the pipeline hands back prompt tokens, not problems). The state is a small
JSON dict saved in every checkpoint's meta; on resume it must be loaded before the
stream's iterator state is restored, since the stream's filter reads it lazily.

DAPO's dynamic sampling ("refill until groups have mixed rewards") needs the same
per-group test: `mixed_groups`.
"""

from __future__ import annotations

import hashlib

import numpy as np


def prompt_key(ids) -> str:
    """A stable 16-hex-digit id of a prompt's token ids (padding excluded)."""
    return hashlib.blake2b(np.asarray(ids, np.int32).tobytes(), digest_size=8).hexdigest()


def mixed_groups(correct_PG) -> np.ndarray:
    """True for prompt groups whose samples did not all get the same outcome."""
    correct_PG = np.asarray(correct_PG)
    return correct_PG.max(1) > correct_PG.min(1)


class NoPositiveResampling:
    def __init__(self, tokenizer, threshold: float = 0.9):
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"config.rl.npr_threshold={threshold} must be in (0, 1]")
        self.tok, self.threshold = tokenizer, float(threshold)
        self.history: dict[str, list[int]] = {}  # key -> [n_correct, n_samples], all samplings
        self.removed: set[str] = set()

    # The stream's filter predicate: data.prompt_stream(..., keep=npr.keep).
    def keep(self, problem) -> bool:
        return not self.removed or prompt_key(self.tok.encode(problem.prompt)) not in self.removed

    def update(self, prompt_tokens_PL, prompt_mask_PL, correct_PG) -> dict:
        """Record one step's outcomes (one row of prompt tokens per group); returns metrics."""
        correct_PG = np.asarray(correct_PG, np.float64)
        newly = 0
        for ids, m, c in zip(np.asarray(prompt_tokens_PL), np.asarray(prompt_mask_PL, bool), correct_PG):
            key = prompt_key(ids[m])
            h = self.history.setdefault(key, [0, 0])
            h[0] += int(round(c.sum()))
            h[1] += c.size
            if c.mean() >= self.threshold and key not in self.removed:
                self.removed.add(key)
                newly += 1
        return {"npr/removed": float(len(self.removed)), "npr/removed_this_step": float(newly),
                "npr/prompts_seen": float(len(self.history))}

    def state(self) -> dict:
        return {"threshold": self.threshold, "removed": sorted(self.removed),
                "history": {k: list(v) for k, v in self.history.items()}}

    def load(self, state: dict) -> None:
        # mutate in place: the stream's filter holds a reference to this object
        self.removed.clear()
        self.removed.update(state.get("removed", ()))
        self.history.clear()
        self.history.update({k: [int(a), int(b)] for k, (a, b) in state.get("history", {}).items()})
