"""Several processes (hosts) in one run: start-up and per-host data.

Start-up: `initialize()` (launch/run.py calls it before anything touches a device) joins the
job's processes with `jax.distributed.initialize`:
  - Cloud TPU slices with several hosts: run the same command on every host
    (`gcloud compute tpus tpu-vm ssh NAME --worker=all --command=...`); with no settings JAX
    finds the coordinator, the process count and this host's id from the TPU metadata.
    It is tried when this is a Cloud TPU VM (or RL_SCALING_DISTRIBUTED=1).
  - Elsewhere (GPU clusters, CPU tests): RL_SCALING_COORDINATOR=host:port,
    RL_SCALING_NUM_PROCESSES=N, RL_SCALING_PROCESS_ID=i (and optionally
    RL_SCALING_LOCAL_DEVICE_IDS=0,1). On CPU, collectives across processes go through gloo
    (jax_cpu_collectives_implementation), set here when JAX_PLATFORMS=cpu.
  - RL_SCALING_DISTRIBUTED=0, or nothing set off a TPU VM: one process, nothing happens.

Data: every process runs the same host-side loop (same prompt stream, same seeds), so the
host state (No-Positive-Resampling history, counters, checkpoints' metadata) is identical
everywhere. Device inputs are split: a process feeds only the rows its own devices hold
(`local_rows`) and `global_batch` turns its process-local numpy rows into global jax.Arrays
(`jax.make_array_from_process_local_data`). Results come back to every host with `to_host`.
With one process each helper returns its input unchanged (the single-host path does no extra
work). Logging and metrics are written by process 0 only (metrics.py, `is_main`).
"""

from __future__ import annotations

import importlib.util
import logging
import os

import jax
import numpy as np

from rl_scaling import sharding

log = logging.getLogger(__name__)

ENV_COORDINATOR = "RL_SCALING_COORDINATOR"
ENV_NUM_PROCESSES = "RL_SCALING_NUM_PROCESSES"
ENV_PROCESS_ID = "RL_SCALING_PROCESS_ID"
ENV_LOCAL_DEVICES = "RL_SCALING_LOCAL_DEVICE_IDS"
ENV_SWITCH = "RL_SCALING_DISTRIBUTED"  # "1": always initialize, "0": never, unset: auto


# TPU chips on the PCI bus: Google's vendor id and the chips' device ids (v3, v4, v5p, v5e, v6e, 7x and
# one unnamed), as the kernel lists them; Google's other devices (the gVNIC network card) are not TPUs.
# A newer chip missing here: RL_SCALING_DISTRIBUTED=1.
GOOGLE_PCI_VENDOR = "0x1ae0"
TPU_PCI_DEVICES = ("0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076")


def _on_cloud_tpu_vm(pci_devices: str = "/sys/bus/pci/devices") -> bool:
    """A Cloud TPU VM: TPU chips attached and libtpu installed to drive them. Read from the kernel's
    PCI listing, as JAX's own TPU start-up does, before any backend exists."""
    if not (importlib.util.find_spec("libtpu") or os.environ.get("TPU_LIBRARY_PATH")):
        return False
    try:
        devices = os.listdir(pci_devices)
    except OSError:
        return False
    for d in devices:
        try:
            with open(os.path.join(pci_devices, d, "vendor")) as v, open(os.path.join(pci_devices, d, "device")) as i:
                if v.read().strip() == GOOGLE_PCI_VENDOR and i.read().strip() in TPU_PCI_DEVICES:
                    return True
        except OSError:
            continue
    return False


def initialize() -> bool:
    """Join the other processes of this run, if there are any; returns True when it did."""
    switch = os.environ.get(ENV_SWITCH, "").strip()
    coordinator = os.environ.get(ENV_COORDINATOR, "").strip()
    if switch == "0":
        return False
    if coordinator:
        missing = [v for v in (ENV_NUM_PROCESSES, ENV_PROCESS_ID) if not os.environ.get(v, "").strip()]
        if missing:
            raise ValueError(f"{ENV_COORDINATOR}={coordinator} is set but {', '.join(missing)} is not: "
                             "every process needs the process count and its own id")
        try:
            num, pid = int(os.environ[ENV_NUM_PROCESSES]), int(os.environ[ENV_PROCESS_ID])
        except ValueError as e:
            raise ValueError(f"{ENV_NUM_PROCESSES} and {ENV_PROCESS_ID} must be integers: {e}") from e
        if not 0 <= pid < num:
            raise ValueError(f"{ENV_PROCESS_ID}={pid} must be in [0, {ENV_NUM_PROCESSES}={num})")
        kwargs = dict(coordinator_address=coordinator, num_processes=num, process_id=pid)
        if os.environ.get(ENV_LOCAL_DEVICES, "").strip():
            kwargs["local_device_ids"] = [int(i) for i in os.environ[ENV_LOCAL_DEVICES].split(",")]
        if os.environ.get("JAX_PLATFORMS", "").strip() == "cpu":
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(**kwargs)
    elif switch == "1" or _on_cloud_tpu_vm():
        jax.distributed.initialize()  # Cloud TPU: coordinator and ids from the slice's metadata
    else:
        return False
    log.info("process %d of %d, %d local / %d global devices", jax.process_index(), jax.process_count(),
             jax.local_device_count(), jax.device_count())
    return True


def is_main() -> bool:
    return jax.process_index() == 0


def multiprocess() -> bool:
    return jax.process_count() > 1


def local_rows(array_sharding, shape) -> tuple[int, int]:
    """[start, stop) of the leading-axis rows this process's devices hold of an array of this
    shape split by `array_sharding` (one contiguous block per process)."""
    n = shape[0]
    idx = array_sharding.addressable_devices_indices_map(tuple(shape))
    starts = sorted({(s[0].start or 0, n if s[0].stop is None else s[0].stop) for s in idx.values()})
    start, stop = starts[0][0], starts[0][1]
    for a, b in starts[1:]:
        if a > stop:
            raise ValueError(f"this process's devices hold rows {starts} of {n}: not one contiguous block; "
                             "order the mesh's devices by process (sharding.make_mesh over jax.devices() does)")
        stop = max(stop, b)
    return start, stop


def global_batch(batch: dict, mesh, replicated_keys=("rewards",), rows_given: str = "global") -> dict:
    """Host numpy arrays -> global jax.Arrays on `mesh`: per-row arrays split over the mesh's
    data axes along their leading axis, `replicated_keys` on every device.

    rows_given="global": every process passes the whole batch (identical everywhere) and each
    feeds its own rows; "local": each process passes only its rows (`local_rows`) and the
    replicated arrays' own rows, which are gathered from all processes. One process: the
    batch is returned unchanged."""
    if not multiprocess():
        return batch
    from jax.experimental import multihost_utils

    out = {}
    for k, x in batch.items():
        x = np.asarray(x)
        if k in replicated_keys:
            full = multihost_utils.process_allgather(x, tiled=True) if rows_given == "local" else x
            out[k] = jax.make_array_from_process_local_data(sharding.replicated(mesh), np.asarray(full))
            continue
        sh = sharding.batch_sharding(mesh, x.ndim)
        if rows_given == "local":
            n = x.shape[0] * jax.process_count()
            local = x
        else:
            n = x.shape[0]
            start, stop = local_rows(sh, x.shape)
            local = x[start:stop]
        out[k] = jax.make_array_from_process_local_data(sh, local, (n,) + x.shape[1:])
    return out


def _mesh_of(like, required: bool = True):
    for leaf in jax.tree.leaves(like):
        mesh = getattr(getattr(leaf, "sharding", None), "mesh", None)
        if mesh is not None:
            return mesh
    if required:
        raise ValueError("no array with a NamedSharding to take the mesh from")
    return None


def row_mesh(like, rows: int):
    """The mesh of `like` when `rows` sequences split evenly over its data axes and it has
    several devices (then a jitted sampler traces under it and each device decodes its own
    rows); None on one device or for rows that do not split (they are computed replicated)."""
    mesh = _mesh_of(like, required=multiprocess())
    if mesh is None or mesh.devices.size == 1:
        return None
    spec = sharding.batch_sharding(mesh, 1).spec[0]
    shards = int(np.prod([mesh.shape[a] for a in (spec if isinstance(spec, tuple) else (spec,)) if a]))
    if rows % shards:
        if multiprocess():
            raise ValueError(f"{rows} rows do not split over the {shards} data shards of the mesh {dict(mesh.shape)}")
        return None
    return mesh


def shard_rows(tree, mesh):
    """Host arrays that every process holds whole (same values) -> global arrays on `mesh`
    (from `row_mesh`): arrays with rows split over the data axes, each process feeding its own
    rows; PRNG keys and scalars replicated; anything else (Python ints, tuples of ids)
    untouched. No mesh: returned unchanged."""
    if mesh is None:
        return tree

    def put(x):
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            data = np.asarray(jax.random.key_data(x))
            rep = jax.make_array_from_process_local_data(sharding.replicated(mesh), data)
            return jax.random.wrap_key_data(rep, impl=jax.random.key_impl(x))
        if not isinstance(x, (np.ndarray, jax.Array)):
            return x
        x = np.asarray(x)
        if x.ndim == 0:
            return jax.make_array_from_process_local_data(sharding.replicated(mesh), x)
        sh = sharding.batch_sharding(mesh, x.ndim)
        start, stop = local_rows(sh, x.shape)
        return jax.make_array_from_process_local_data(sh, x[start:stop], x.shape)

    return jax.tree.map(put, tree)


def to_host(tree):
    """Device arrays -> numpy on every process (gathered across processes when needed)."""
    if not multiprocess():
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    def get(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return jax.device_get(x)

    return jax.tree.map(get, tree)
