"""Weights through a directory (local or gs://, through rl_scaling/paths.py): the trainer writes
each version, replicas poll for the newest. For a pod whose generator slice reads the same
bucket as the trainer: the trainer writes each version once instead of pushing it to M
replicas, and a replica that starts or restarts finds the current weights there by itself.

    DIR/v0000000012/   an Orbax checkpoint (StandardCheckpointHandler, OCDBT) of the params tree
                       of version 12, in rollout.push_dtype (wire.cast_for_push)
    DIR/LATEST         "12", written by trainer process 0 once version 12 is complete

Who writes what: `write` is called by every trainer process with the same tree of (global,
sharded) jax.Arrays. Orbax's save is collective: each process writes only the shards its own
devices hold (host memory per process: its own shards, never the whole model; no
`jax.device_get` or process_allgather of the tree), Orbax's primary process (0) finalizes the
checkpoint after every process has written, then process 0 alone writes LATEST and removes the
versions beyond the newest `keep`. A numpy tree (one process, tests) is written as it is.

A reader (server.py `_poll_weights`) takes LATEST, checks the version's metadata against its own
model (a missing, extra, misshaped or non-floating leaf is a BadRequest naming it, before any
array is read) and restores straight into its own avals and shardings: Orbax reads only the
slices each of the reader's devices holds and casts to the reader's dtype. The writer keeps the
newest `keep` versions, so a reader that has just seen LATEST finds its files even while a
newer version is being written.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import numpy as np
import orbax.checkpoint as ocp

from rl_scaling import paths
from rl_scaling.serving import wire

log = logging.getLogger(__name__)

LATEST = "LATEST"


@dataclasses.dataclass(frozen=True)
class Written:
    """Passed as the params to a backend's push_weights: every trainer process has already
    written this version to the directory (multihost.BroadcastPipeline), nothing to write."""

    version: int


def _version_dir(directory: str, version: int) -> str:
    return paths.join(directory, f"v{version:010d}")


def _checkpointer():
    return ocp.Checkpointer(ocp.StandardCheckpointHandler())  # synchronous: LATEST follows a complete save


def write(directory: str, params, version: int, keep: int = 3) -> str:
    """Write `params` as `version` (on every trainer process: collective), then process 0 points
    LATEST at it and drops old versions. Returns the version's directory."""
    vdir = _version_dir(directory, version)
    paths.makedirs(directory)
    ckptr = _checkpointer()
    try:
        ckptr.save(paths.path(vdir), args=ocp.args.StandardSave(params), force=True)
    finally:
        ckptr.close()
    if jax.process_index() == 0:
        paths.write_text(paths.join(directory, LATEST), str(version))
        _prune(directory, version, keep)
    return vdir


def _prune(directory: str, version: int, keep: int) -> None:
    names = paths.listdir(directory)
    old = sorted(n for n in names if n.startswith("v") and n[1:].isdigit())[:-keep]
    # the temporary directories of saves that never finished (a trainer killed mid-write)
    old += [n for n in names if n.startswith("v") and ".orbax-checkpoint-tmp" in n
            and n[1:11].isdigit() and int(n[1:11]) < version]
    for name in old:
        _remove_tree(paths.join(directory, name))


def _remove_tree(directory: str) -> None:
    try:
        paths.path(directory).rmtree()
    except Exception as e:  # noqa: BLE001 - a reader may still hold it; the next write retries
        log.debug("could not remove %s: %s", directory, e)


def latest(directory: str) -> int:
    """The newest complete version in `directory`, or -1 if there is none yet."""
    p = paths.join(directory, LATEST)
    if not paths.exists(p):
        return -1
    text = paths.read_text(p).strip()
    if not text:  # caught between the writer's truncate and write
        return -1
    if not text.isdigit():
        raise wire.BadRequest(f"{p}: {text[:40]!r} is not a version number")
    return int(text)


def _metadata(vdir: str):
    """The tree of Orbax ArrayMetadata (shape, dtype) of a version's leaves."""
    if not paths.isdir(vdir):
        raise wire.BadRequest(f"{vdir} does not exist (removed as older than the newest versions, or not written)")
    ckptr = _checkpointer()
    try:
        meta = ckptr.metadata(paths.path(vdir))
    except Exception as e:  # noqa: BLE001 - a pruned or half-copied version: the reader retries
        raise wire.BadRequest(f"{vdir}: not a readable weights version: {type(e).__name__}: {e}") from None
    finally:
        ckptr.close()
    tree = getattr(meta, "item_metadata", meta)
    return getattr(tree, "tree", tree)


def read(directory: str, version: int, target=None):
    """(version, {key: jax.Array}) of one version, restored into `target` (a tree of
    jax.ShapeDtypeStruct with shardings: the reader's own avals; None: the saved shapes and
    dtypes on the first device). BadRequest naming the leaves if the version does not match."""
    vdir = _version_dir(directory, version)
    tree = _metadata(vdir)
    saved = {jax.tree_util.keystr(k): (tuple(v.shape), np.dtype(v.dtype))
             for k, v in jax.tree_util.tree_flatten_with_path(tree)[0] if hasattr(v, "shape")}
    if target is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target = jax.tree.map(lambda v: jax.ShapeDtypeStruct(tuple(v.shape), v.dtype, sharding=device), tree)
    want = {jax.tree_util.keystr(k): tuple(v.shape) for k, v in jax.tree_util.tree_flatten_with_path(target)[0]}
    faults = [f"{k}: shape {saved[k][0]}, the model expects {want[k]}" for k in want if k in saved
              and saved[k][0] != want[k]]
    faults += [f"{k}: missing (the model expects {want[k]})" for k in want if k not in saved]
    faults += [f"{k}: the model has no such weight" for k in saved if k not in want]
    faults += [f"{k}: dtype {saved[k][1]}, weights are floating point" for k in saved
               if not jax.numpy.issubdtype(saved[k][1], jax.numpy.floating)]
    if faults:
        raise wire.BadRequest(f"weights {vdir} do not match the model ({len(faults)} leaves): " + "; ".join(faults[:8])
                              + (" ..." if len(faults) > 8 else ""))
    ckptr = _checkpointer()
    try:
        restored = ckptr.restore(paths.path(vdir), args=ocp.args.StandardRestore(target))
    finally:
        ckptr.close()
    return version, {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(restored)[0]}
