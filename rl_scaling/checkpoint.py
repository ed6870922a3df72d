"""Orbax checkpoints of the train state plus a JSON sidecar (data iterator, counters,
filter history), with auto-resume and a fall-back when the latest one is corrupt. Directories
are local paths or gs:// URLs (rl_scaling/paths.py); on gs:// tensorstore writes the arrays."""

from __future__ import annotations

import logging

import jax
import orbax.checkpoint as ocp

from rl_scaling import paths

log = logging.getLogger(__name__)


class Checkpoints:
    def __init__(self, directory: str, keep: int = 3):
        self.directory = paths.resolve(directory)
        self.manager = ocp.CheckpointManager(
            paths.path(self.directory),
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
            item_names=("state", "meta"),
        )

    def save(self, step: int, state, meta: dict, wait: bool = False) -> None:
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
        if wait:
            self.manager.wait_until_finished()

    def restore_latest(self, abstract_state):
        """(step, state, meta) of the newest readable checkpoint, or None when there is none.

        A checkpoint that fails to load is skipped with a warning naming it, and the
        previous one is tried; if none loads, the error says which were tried.
        """
        steps = sorted(self.manager.all_steps(), reverse=True)
        errors = []
        for step in steps:
            try:
                restored = self.manager.restore(
                    step,
                    args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()),
                )
                if errors:
                    log.warning("resumed from step %d; newer checkpoints were unreadable: %s", step, "; ".join(errors))
                return step, restored["state"], dict(restored["meta"])
            except Exception as e:  # noqa: BLE001 - any failure means this step is unusable
                msg = f"{paths.join(self.directory, str(step))}: {type(e).__name__}: {str(e)[:200]}"
                log.warning("checkpoint unreadable, trying the previous one: %s", msg)
                errors.append(msg)
        if errors:
            raise RuntimeError("no readable checkpoint in " + self.directory + ":\n  " + "\n  ".join(errors))
        return None

    def wait(self):
        self.manager.wait_until_finished()

    def close(self):
        self.manager.wait_until_finished()
        self.manager.close()


def abstract_like(state, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)


def save_params(path: str, params) -> None:
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(paths.path(path), params, force=True)
    ckptr.wait_until_finished()


def load_params(path: str, abstract_params):
    if not paths.isdir(path):
        raise FileNotFoundError(f"params checkpoint {path!r} does not exist")
    return ocp.StandardCheckpointer().restore(paths.path(path), abstract_params)
