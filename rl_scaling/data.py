"""Prompt pipelines (grain) and token packing.

The training stream is a grain dataset over problem indices, reshuffled every epoch,
mapped to problems, optionally filtered (No-Positive-Resampling), batched into steps.
Its iterator state is a small dict that goes into every checkpoint, so a resumed run
sees exactly the prompts an uninterrupted one would.
"""

from __future__ import annotations

import grain
import numpy as np

TRAIN_POOL = 1 << 20  # distinct indices per epoch of the training stream


def prompt_stream(task, seed: int, prompts_per_step: int, keep=None):
    """An iterator of lists of problems; `keep(problem) -> bool` filters the stream."""
    ds = grain.MapDataset.range(TRAIN_POOL).shuffle(seed=seed).repeat().map(task.train_problem)
    # In the calling thread: a problem is a cheap lookup, and grain's default prefetch (16 threads,
    # 500 buffered elements scanned on every next) cost ~6 ms a step and competed with XLA for the cores.
    it_ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=0))
    if keep is not None:
        it_ds = it_ds.filter(keep)
    return iter(it_ds.batch(prompts_per_step, batch_fn=list))


def encode_prompts(tokenizer, prompts, max_len: int):
    """Left-padded prompt tokens [N, max_len] and mask; an over-long prompt is an error."""
    out = np.full((len(prompts), max_len), tokenizer.pad_id, np.int32)
    mask = np.zeros((len(prompts), max_len), bool)
    for i, text in enumerate(prompts):
        ids = tokenizer.encode(text)
        if len(ids) > max_len:
            raise ValueError(f"prompt {i} has {len(ids)} tokens, more than config.task.max_prompt_len={max_len}: {text[:80]!r}")
        out[i, max_len - len(ids):] = ids
        mask[i, max_len - len(ids):] = True
    return out, mask


def pack_sequences(prompt_NP, prompt_mask_NP, completion_NT, completion_mask_NT):
    """Concatenate left-padded prompts with right-padded completions: [N, P+T]."""
    tokens = np.concatenate([prompt_NP, completion_NT], axis=1)
    mask = np.concatenate([prompt_mask_NP, completion_mask_NT], axis=1)
    return tokens, mask


def encode_completions(tokenizer, completions, max_len: int):
    """Right-padded completion tokens [N, max_len] and mask (for the warm start)."""
    out = np.full((len(completions), max_len), tokenizer.pad_id, np.int32)
    mask = np.zeros((len(completions), max_len), bool)
    for i, text in enumerate(completions):
        ids = tokenizer.encode(text)[:max_len]
        out[i, : len(ids)] = ids
        mask[i, : len(ids)] = True
    return out, mask
