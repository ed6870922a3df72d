"""Orbax checkpoints of the train state plus a JSON sidecar (data iterator, counters, filter
history), with auto-resume, integrity checks and a fall-back when the newest one is unusable.
Directories are local paths or gs:// URLs (rl_scaling/paths.py); on gs:// tensorstore writes
the arrays.

Integrity: after each save, MANIFEST (inside the step's directory) lists the size and SHA-256
of every file of the step. A restore checks them first: a changed byte makes the step unusable,
with a message naming the file, and the previous step is tried. Steps newer than the one
restored (unusable, or from a rolled-back timeline) are deleted at the next save, so that
save's step replaces a corrupt one of the same number. Temporary directories of interrupted
saves are deleted when the manager opens; a failed save deletes its own and raises
CheckpointSaveError, leaving the earlier checkpoints as they were.
"""

from __future__ import annotations

import hashlib
import json
import logging

import jax
import orbax.checkpoint as ocp

from rl_scaling import paths

log = logging.getLogger(__name__)

MANIFEST = "manifest.sha256.json"
TMP_SUFFIX = ".orbax-checkpoint-tmp"


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written (disk full, storage unreachable, ...)."""


class CorruptCheckpoint(ValueError):
    """A checkpoint's files do not match its manifest."""


def _files(step_dir):
    """(relative path, epath.Path) of every file under `step_dir` but the manifest, sorted."""
    root, out, todo = paths.path(step_dir), [], [paths.path(step_dir)]
    while todo:  # a walk by listings (epath has no recursive glob on gs://)
        for p in todo.pop().iterdir():
            if p.is_dir():
                todo.append(p)
            elif p.name != MANIFEST or p.parent != root:
                out.append((str(p.relative_to(root)), p))
    return sorted(out)


def _digest(p) -> dict:
    h, size = hashlib.sha256(), 0
    with p.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
            size += len(block)
    return {"size": size, "sha256": h.hexdigest()}


def write_manifest(step_dir) -> None:
    files = {rel: _digest(p) for rel, p in _files(step_dir)}
    paths.write_text(paths.join(step_dir, MANIFEST), json.dumps({"files": files}, indent=0))


def verify(step_dir) -> bool:
    """True when the step's files match its manifest, False when it has none (written before
    manifests existed, or killed between the save and the manifest); CorruptCheckpoint names
    the first file that differs."""
    manifest = paths.join(step_dir, MANIFEST)
    if not paths.exists(manifest):
        return False
    try:
        expected = json.loads(paths.read_text(manifest))["files"]
    except (ValueError, KeyError) as e:
        raise CorruptCheckpoint(f"{manifest}: unreadable manifest ({e})") from e
    for rel, want in sorted(expected.items()):
        p = paths.path(paths.join(step_dir, rel))
        if not p.exists():
            raise CorruptCheckpoint(f"{p}: missing (listed in {MANIFEST})")
        got = _digest(p)
        if got["size"] != want["size"]:
            raise CorruptCheckpoint(f"{p}: {got['size']} bytes, the manifest says {want['size']}")
        if got["sha256"] != want["sha256"]:
            raise CorruptCheckpoint(f"{p}: SHA-256 differs from the manifest (the file changed after the save)")
    return True


class Checkpoints:
    def __init__(self, directory: str, keep: int = 3):
        self.directory = paths.resolve(directory)
        self.manager = ocp.CheckpointManager(
            paths.path(self.directory),
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, cleanup_tmp_directories=True),
            item_names=("state", "meta"),
        )
        self.restored_step = None  # steps above it are deleted at the next save

    def step_dir(self, step: int) -> str:
        return paths.join(self.directory, str(step))

    def save(self, step: int, state, meta: dict) -> None:
        """Write step `step` and its manifest, and wait for both (the manifest hashes the final
        files). Any failure raises CheckpointSaveError; earlier steps are left as they were."""
        stale = [s for s in self.manager.all_steps() if s >= step or
                 (self.restored_step is not None and s > self.restored_step)]
        for s in sorted(stale):
            log.warning("deleting checkpoint %s: it is newer than the resumed step %s and step %d replaces it",
                        self.step_dir(s), self.restored_step, step)
            self.manager.delete(s)
        self.restored_step = None
        try:
            self.manager.save(step, force=True, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
            self.manager.wait_until_finished()
            write_manifest(self.step_dir(step))
        except Exception as e:  # noqa: BLE001 - OSError locally, client errors on gs://: all fatal here
            self._remove_partial(step)
            good = [s for s in self.manager.all_steps() if s != step]
            raise CheckpointSaveError(
                f"saving checkpoint {step} to {self.step_dir(step)} failed: {type(e).__name__}: {str(e)[:300]}. "
                f"The last good checkpoint is {max(good) if good else 'none'}; re-run to resume from it") from e

    def _remove_partial(self, step: int) -> None:
        for p in paths.glob(paths.join(self.directory, f"{step}{TMP_SUFFIX}*")) + [self.step_dir(step)]:
            try:
                if paths.exists(p):
                    paths.path(p).rmtree()
            except Exception as e:  # noqa: BLE001 - best effort: the save error is what matters
                log.warning("could not delete %s: %s", p, e)
        try:
            self.manager.reload()
        except Exception:  # noqa: BLE001
            pass

    def restore_latest(self, abstract_state):
        """(step, state, meta) of the newest usable checkpoint, or None when there is none.

        A checkpoint whose files differ from its manifest, or that fails to load, is skipped
        with a warning naming it (and the file), and the previous one is tried; if none loads,
        the error says which were tried.
        """
        steps = sorted(self.manager.all_steps(), reverse=True)
        errors = []
        for step in steps:
            try:
                if not verify(self.step_dir(step)):
                    log.warning("checkpoint %s has no %s: restoring it unverified", self.step_dir(step), MANIFEST)
                restored = self.manager.restore(
                    step,
                    args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()),
                )
                if errors:
                    log.warning("resumed from step %d; newer checkpoints were unusable: %s", step, "; ".join(errors))
                self.restored_step = step
                return step, restored["state"], dict(restored["meta"])
            except Exception as e:  # noqa: BLE001 - any failure means this step is unusable
                msg = f"{self.step_dir(step)}: {type(e).__name__}: {str(e)[:300]}"
                log.warning("checkpoint unusable, trying the previous one: %s", msg)
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


def _shape_differences(path: str, abstract_params) -> list[str]:
    """Leaves of the checkpoint at `path` whose shape differs from `abstract_params`', or that
    only one of them has (empty when its metadata cannot be read: restore then says why)."""
    try:
        meta = ocp.StandardCheckpointer().metadata(paths.path(path))
        saved = getattr(meta, "item_metadata", meta)
        saved = {jax.tree_util.keystr(k): tuple(v.shape) for k, v in jax.tree_util.tree_flatten_with_path(saved)[0]
                 if hasattr(v, "shape")}
    except Exception:  # noqa: BLE001
        return []
    want = {jax.tree_util.keystr(k): tuple(v.shape) for k, v in jax.tree_util.tree_flatten_with_path(abstract_params)[0]}
    out = [f"{k}: checkpoint {saved[k]}, config {want[k]}" for k in sorted(want) if k in saved and saved[k] != want[k]]
    out += [f"{k}: missing from the checkpoint (config {want[k]})" for k in sorted(want) if k not in saved]
    out += [f"{k}: in the checkpoint only ({saved[k]})" for k in sorted(saved) if k not in want]
    return out


def load_params(path: str, abstract_params):
    if not paths.isdir(path):
        raise FileNotFoundError(f"params checkpoint {path!r} does not exist")
    diffs = _shape_differences(path, abstract_params)
    if diffs:
        raise ValueError(f"params checkpoint {path} does not match config.model ({len(diffs)} differing leaves):\n  "
                         + "\n  ".join(diffs[:20]) + ("\n  ..." if len(diffs) > 20 else ""))
    return ocp.StandardCheckpointer().restore(paths.path(path), abstract_params)
