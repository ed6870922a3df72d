"""Weights through a directory (local or gs://, through rl_scaling/paths.py): the trainer writes
each version, replicas poll for the newest. For a pod whose generator slice reads the same
bucket as the trainer: the trainer writes each version once instead of pushing it to M
replicas, and a replica that starts or restarts finds the current weights there by itself.

    DIR/v0000000012/part-00000 ... part-000NN   the PushWeights message stream of version 12
                                                 (wire.weight_chunks: leaf by leaf, <= 64 MiB each)
    DIR/LATEST                                   "12", written after the version's last part

A reader takes LATEST, then reads that version's parts and checks them exactly as a gRPC push
(wire.read_weight_chunks). The writer keeps the newest `keep` versions, so a reader that has
just seen LATEST finds its parts even while a newer version is being written.
"""

from __future__ import annotations

import logging

from rl_scaling import paths
from rl_scaling.rollout import wire

log = logging.getLogger(__name__)

LATEST = "LATEST"


def _version_dir(directory: str, version: int) -> str:
    return paths.join(directory, f"v{version:010d}")


def write(directory: str, host_params, version: int, keep: int = 3) -> str:
    """Write `host_params` (numpy leaves) as `version`, then point LATEST at it; drop old versions."""
    vdir = _version_dir(directory, version)
    paths.makedirs(vdir)
    for i, blob in enumerate(wire.weight_chunks(host_params, version)):
        with paths.open_file(paths.join(vdir, f"part-{i:05d}"), "wb") as f:
            f.write(blob)
    paths.write_text(paths.join(directory, LATEST), str(version))
    old = sorted(n for n in paths.listdir(directory) if n.startswith("v") and n[1:].isdigit())[:-keep]
    for name in old:
        _remove_tree(paths.join(directory, name))
    return vdir


def _remove_tree(directory: str) -> None:
    try:
        for name in paths.listdir(directory):
            paths.remove(paths.join(directory, name))
        paths.path(directory).rmdir()
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


def read(directory: str, version: int, expected: dict | None = None):
    """(version, {key: array}) of one version, checked like a gRPC push (BadRequest if not whole)."""
    vdir = _version_dir(directory, version)
    names = sorted(n for n in paths.listdir(vdir) if n.startswith("part-"))
    got, arrays = wire.read_weight_chunks((paths.read_bytes(paths.join(vdir, n)) for n in names), expected)
    if got != version:
        raise wire.BadRequest(f"{vdir} holds version {got}, not {version}")
    return got, arrays
