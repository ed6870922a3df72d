"""Weight delivery to the engine replicas: rollout.push_dtype (the cast on device, the float32 LM
head), the Orbax directory channel (exact round trips, local and gs://, into the reader's own
shardings and dtypes; named errors for a misshaped or missing leaf), no host copy of the whole
tree on the directory path, process 0 alone keeping the gathered bytes for a gRPC push, and
(slow) two trainer processes each writing only their own shards.

References are independent of the code under test: numpy copies of the params and bfloat16
casts done by ml_dtypes."""

import os
import socket
import subprocess
import sys
import time

import jax
import ml_dtypes
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.test_gcs import gcs  # noqa: E402, F401 - the GCS emulator fixture

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LM_HEAD, EMBED = "['lm_head']", "['embed']"


def _tiny(**kw):
    from tests.conftest import TINY

    return TINY if not kw else TINY.__class__(**{**TINY.__dict__, **kw})


def _init(cfg, mesh):
    """The params of `cfg` (key 0), sharded as the engine shards them on `mesh`."""
    from flax import linen as nn

    from rl_scaling.policy import model as model_lib
    from rl_scaling.rollout import engine as engine_lib

    shardings = engine_lib.param_shardings(cfg, mesh)
    return jax.jit(lambda: nn.unbox(model_lib.init_params(cfg, jax.random.key(0))), out_shardings=shardings)()


def _flat(tree) -> dict:
    return {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(tree)}


def _reference(host: dict, push_dtype: str, keep=(LM_HEAD,)) -> dict:
    """What the engine should hold: each float32 leaf through a numpy/ml_dtypes bfloat16 cast
    (and back to float32), those in `keep` untouched."""
    if not push_dtype:
        return dict(host)
    return {k: v if k in keep else v.astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in host.items()}


def _target(cfg, mesh, dtype=np.float32):
    """The avals a replica on `mesh` restores into (float32, as the server's own)."""
    from flax import linen as nn

    from rl_scaling.policy import model as model_lib
    from rl_scaling.rollout import engine as engine_lib

    abstract = jax.eval_shape(lambda: nn.unbox(model_lib.init_params(cfg, jax.random.key(0))))
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, dtype, sharding=s), abstract,
                        engine_lib.param_shardings(cfg, mesh))


@pytest.fixture(scope="module")
def mesh8():
    from rl_scaling import sharding

    return sharding.make_mesh({"fsdp": 8}, devices=jax.devices()[:8])


def _no_full_host_copy(monkeypatch, params):
    """Make a host copy of the whole params tree (jax.device_get / distributed.to_host of it) or
    any cross-process gather an error."""
    from jax.experimental import multihost_utils

    from rl_scaling import distributed

    treedef = jax.tree.structure(params)
    real_get = jax.device_get

    def guarded_get(x):
        if jax.tree.structure(x) == treedef:
            raise AssertionError("jax.device_get of the whole params tree")
        return real_get(x)

    def refuse(*a, **k):
        raise AssertionError("a host copy of the params")

    shapes = {tuple(x.shape) for x in jax.tree.leaves(params)}
    real_gather = multihost_utils.process_allgather

    def guarded_gather(x, *a, **k):  # Orbax's barriers gather a small hash: allowed
        if any(tuple(np.shape(leaf)) in shapes for leaf in jax.tree.leaves(x)):
            raise AssertionError("process_allgather of a params leaf")
        return real_gather(x, *a, **k)

    monkeypatch.setattr(jax, "device_get", guarded_get)
    monkeypatch.setattr(distributed, "to_host", refuse)
    monkeypatch.setattr(multihost_utils, "process_allgather", guarded_gather)


# ----------------------------------------------------------------------------- the cast

@pytest.mark.parametrize("fp32_lm_head, tie", [(True, False), (False, False), (True, True)])
def test_cast_for_push_casts_on_device_and_keeps_the_lm_head(mesh8, fp32_lm_head, tie):
    from rl_scaling.serving import wire

    cfg = _tiny(tie_embeddings=tie)
    params = _init(cfg, mesh8)
    host = {k: np.asarray(v) for k, v in _flat(params).items()}
    assert wire.cast_for_push(params, "", fp32_lm_head=fp32_lm_head, tie_embeddings=tie) is params
    cast = _flat(wire.cast_for_push(params, "bfloat16", fp32_lm_head=fp32_lm_head, tie_embeddings=tie))
    keep = {LM_HEAD} if fp32_lm_head and not tie else ({EMBED} if fp32_lm_head else set())
    assert (LM_HEAD in host) == (not tie)
    for k, v in cast.items():
        want = host[k] if k in keep else host[k].astype(ml_dtypes.bfloat16)
        assert v.dtype == want.dtype, k
        np.testing.assert_array_equal(np.asarray(v), want, err_msg=k)  # bit for bit: both round to nearest even
        assert v.sharding == _flat(params)[k].sharding, k  # cast where it lies: nothing moved
    # numpy leaves (a host tree) follow the same rule
    host_cast = _flat(wire.cast_for_push(jax.device_get(params), "bfloat16", fp32_lm_head=fp32_lm_head,
                                         tie_embeddings=tie))
    assert {k: v.dtype for k, v in host_cast.items()} == {k: v.dtype for k, v in cast.items()}


def test_a_bad_push_dtype_is_a_named_error():
    from configs import dense_8b, scout_moe, tiny
    from rl_scaling.serving import client as client_lib
    from rl_scaling.serving import multihost
    from rl_scaling.rollout import topology
    from rl_scaling.serving import wire

    config = tiny.get_config()
    assert config.rollout.push_dtype == ""  # the tiny runs stay bit-exact
    assert dense_8b.get_config().rollout.push_dtype == scout_moe.get_config().rollout.push_dtype == "bfloat16"
    topology.check_config(config)
    for bad in ("float16", "bf16", "int8"):
        config.rollout.push_dtype = bad
        with pytest.raises(ValueError, match=f"config.rollout.push_dtype='{bad}' is not valid"):
            topology.check_config(config)
        with pytest.raises(ValueError, match="rollout.push_dtype"):
            client_lib.RemoteBackend("127.0.0.1:1", push_dtype=bad)
        with pytest.raises(ValueError, match="rollout.push_dtype"):
            multihost.BroadcastPipeline(object(), None, 2, push_dtype=bad)
        with pytest.raises(ValueError, match="rollout.push_dtype"):
            wire.cast_for_push({}, bad, fp32_lm_head=True)


# ----------------------------------------------------------------------------- the directory channel

@pytest.mark.parametrize("push_dtype", ["", "bfloat16"])
@pytest.mark.parametrize("where", ["local", "gs"])
def test_directory_round_trip_is_exact(mesh8, mesh1, tmp_path, where, push_dtype, request, monkeypatch):
    from rl_scaling import paths
    from rl_scaling.serving import weights_dir, wire

    directory = str(tmp_path / "weights")
    if where == "gs":
        request.getfixturevalue("gcs")
        directory = f"gs://bucket/delivery/{push_dtype or 'own'}"
    cfg = _tiny()
    params = _init(cfg, mesh8)
    host = {k: np.asarray(v).copy() for k, v in _flat(params).items()}
    with monkeypatch.context() as m:
        _no_full_host_copy(m, params)
        for v in range(3):
            scaled = jax.tree.map(lambda x: x * (v + 1), params)
            weights_dir.write(directory, wire.cast_for_push(scaled, push_dtype, fp32_lm_head=True), v, keep=2)
    assert weights_dir.latest(directory) == 2
    assert sorted(n for n in paths.listdir(directory) if n.startswith("v")) == ["v0000000001", "v0000000002"]
    want = _reference({k: x * 3 for k, x in host.items()}, push_dtype)
    # as saved (the dtype on the wire) ...
    _, saved = weights_dir.read(directory, 2)
    for k, x in saved.items():
        assert x.dtype == (np.float32 if not push_dtype or k == LM_HEAD else ml_dtypes.bfloat16), k
        np.testing.assert_array_equal(np.asarray(x).astype(np.float32), want[k], err_msg=k)
    # ... and as a replica restores it: its own avals (float32) on its own shardings
    for mesh in (mesh1, mesh8):
        _, got = weights_dir.read(directory, 2, _target(cfg, mesh))
        assert sorted(got) == sorted(want)
        for k, x in got.items():
            assert x.dtype == np.float32 and x.sharding == _flat(_target(cfg, mesh))[k].sharding, k
            np.testing.assert_array_equal(np.asarray(x), want[k], err_msg=k)


def test_a_version_that_does_not_fit_the_model_is_a_named_error(mesh1, tmp_path):
    from rl_scaling.serving import weights_dir, wire

    cfg = _tiny()
    host = {k: np.asarray(v) for k, v in _flat(jax.device_get(_init(cfg, mesh1))).items()}
    tree = jax.device_get(_init(cfg, mesh1))
    tree["lm_head"] = np.zeros((32, 65), np.float32)  # another vocab
    del tree["final_norm"]
    weights_dir.write(str(tmp_path), tree, 7)
    with pytest.raises(wire.BadRequest, match=r"\['lm_head'\]: shape \(32, 65\), the model expects \(32, 64\)") as e:
        weights_dir.read(str(tmp_path), 7, _target(cfg, mesh1))
    assert "['final_norm']['scale']: missing" in str(e.value)
    tree = jax.device_get(_init(cfg, mesh1))
    tree["embed"] = np.zeros(host[EMBED].shape, np.int32)
    weights_dir.write(str(tmp_path), tree, 8)
    with pytest.raises(wire.BadRequest, match=r"\['embed'\]: dtype int32, weights are floating point"):
        weights_dir.read(str(tmp_path), 8, _target(cfg, mesh1))
    with pytest.raises(wire.BadRequest, match="v0000000009 does not exist"):
        weights_dir.read(str(tmp_path), 9, _target(cfg, mesh1))


class _Recorder:
    """Process 0's pipeline, as BroadcastPipeline sees it: records what it is handed."""

    def __init__(self):
        self.pushed = []

    def push_weights(self, params, version):
        self.pushed.append((params, version))


def test_broadcast_pipeline_writes_shards_and_gathers_only_for_the_grpc_push(mesh8, tmp_path, monkeypatch):
    """The several-process branch of BroadcastPipeline.push_weights, in one process: the directory
    write never copies the tree to host; the gRPC branch assembles process 0's host copy piece
    by piece, equal to the reference."""
    from rl_scaling import distributed
    from rl_scaling.serving import multihost, weights_dir

    cfg = _tiny()
    params = _init(cfg, mesh8)
    host = {k: np.asarray(v).copy() for k, v in _flat(params).items()}
    want = _reference(host, "bfloat16")
    monkeypatch.setattr(distributed, "multiprocess", lambda: True)
    rec = _Recorder()
    pipe = multihost.BroadcastPipeline(rec, None, 2, weights_dir=str(tmp_path), push_dtype="bfloat16")
    with monkeypatch.context() as m:
        _no_full_host_copy(m, params)
        pipe.push_weights(params, 4)
    assert rec.pushed == [(weights_dir.Written(4), 4)] and weights_dir.latest(str(tmp_path)) == 4
    _, got = weights_dir.read(str(tmp_path), 4, _target(cfg, mesh8))
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), want[k], err_msg=k)

    monkeypatch.setattr(multihost, "_GATHER_BYTES", 1000)  # several pieces per leaf
    pipe = multihost.BroadcastPipeline(rec, None, 2, push_dtype="bfloat16")
    pipe.push_weights(params, 5)
    gathered, version = rec.pushed[-1]
    assert version == 5
    for k, x in _flat(gathered).items():
        assert isinstance(x, np.ndarray) and x.dtype == (np.float32 if k == LM_HEAD else ml_dtypes.bfloat16), k
        np.testing.assert_array_equal(x.astype(np.float32), want[k], err_msg=k)


# ----------------------------------------------------------------------------- trainer to replica

@pytest.mark.parametrize("channel", ["push", "dir"])
def test_bfloat16_weights_reach_the_replica(mesh1, mesh8, tmp_path, channel, monkeypatch):
    """A trainer's RemoteBackend with push_dtype=bfloat16 and a real server: the engine holds
    the bfloat16 values (in its own float32) and the float32 LM head, by gRPC push or directory."""
    from rl_scaling.serving import client as client_lib
    from rl_scaling.serving import server as server_lib
    from tests.test_engine import make_engine

    cfg = _tiny()
    params = _init(cfg, mesh8)
    host = {k: np.asarray(v).copy() for k, v in _flat(params).items()}
    directory = str(tmp_path / "w") if channel == "dir" else ""
    eng = make_engine(mesh1)
    srv = server_lib.RolloutServer(eng, eng.load_params(), host="127.0.0.1", port=0, weights_dir=directory,
                                   poll_s=0.1).start()
    backend = client_lib.RemoteBackend(srv.address, reconnect_s=5, weights_dir=directory, push_dtype="bfloat16")
    try:
        for version in (1, 2):
            scaled = jax.tree.map(lambda x: x * version, params)
            if channel == "dir":
                with monkeypatch.context() as m:
                    _no_full_host_copy(m, params)
                    backend.push_weights(scaled, version)
            else:
                backend.push_weights(scaled, version)
        deadline = time.time() + 20
        while srv.holder.version != 2 and time.time() < deadline:
            time.sleep(0.05)
        assert srv.holder.version == 2
        held = _flat(jax.device_get(srv.holder.get()[0]))  # the engine holds the layers split (split_layers)
        want = _reference({k: x * 2 for k, x in host.items()}, "bfloat16")
        want = {k: want[k] for k in (LM_HEAD, EMBED, "['final_norm']['scale']")} | {
            k.replace("['layers']", f"['layers'][{i}]"): x[i] for k, x in want.items() if k.startswith("['layers']")
            for i in range(cfg.n_layers)}
        assert sorted(held) == sorted(want)
        for k, x in held.items():
            assert x.dtype == np.float32, k
            np.testing.assert_array_equal(x, want[k], err_msg=k)
        up = "['layers']['mlp']['up']['kernel']"
        assert not np.array_equal(held[up.replace("['layers']", "['layers'][0]")], host[up][0] * 2)  # it was rounded
    finally:
        backend.close()
        srv.stop()


# ----------------------------------------------------------------------------- two trainer processes

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_trainer_processes_write_only_their_own_shards(tmp_path, mesh1):
    """Two processes (2 CPU devices each, gloo) push params sharded over all 4 devices through
    BroadcastPipeline: each writes its own shards (Orbax leaves one OCDBT store per process), no
    process copies the whole tree to host, LATEST comes from process 0; the version read back
    here in one process equals the reference, and the gRPC branch's host copy exists on process 0
    only, equal to it too."""
    from rl_scaling import paths
    from rl_scaling.serving import weights_dir

    port = _free_port()
    procs = []
    for pid in range(2):
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2",
                   RL_SCALING_COORDINATOR=f"127.0.0.1:{port}", RL_SCALING_NUM_PROCESSES="2",
                   RL_SCALING_PROCESS_ID=str(pid), PYTHONPATH=ROOT)
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), str(tmp_path)], env=env, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    directory = str(tmp_path / "weights")
    assert weights_dir.latest(directory) == 3
    stores = sorted(n for n in paths.listdir(paths.join(directory, "v0000000003")) if n.startswith("ocdbt.process_"))
    assert stores == ["ocdbt.process_0", "ocdbt.process_1"], stores  # each process wrote its own shards
    cfg = _tiny()
    host = {k: np.asarray(v) for k, v in _flat(jax.device_get(_init(cfg, mesh1))).items()}
    want = _reference(host, "bfloat16")
    _, got = weights_dir.read(directory, 3, _target(cfg, mesh1))
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), want[k], err_msg=k)
    gathered = np.load(tmp_path / "gathered.p0.npz")
    assert not (tmp_path / "gathered.p1.npz").exists()
    for k in want:
        np.testing.assert_array_equal(gathered[k].astype(np.float32), want[k], err_msg=k)


def _worker(out: str) -> None:
    """One trainer process of the test above."""
    from rl_scaling import distributed, sharding

    assert distributed.initialize() and jax.process_count() == 2
    from jax.experimental import multihost_utils

    from rl_scaling.serving import multihost

    mesh = sharding.make_mesh({"fsdp": 4})
    params = _init(_tiny(), mesh)
    assert not _flat(params)["['layers']['mlp']['up']['kernel']"].is_fully_addressable
    main = jax.process_index() == 0
    rec = _Recorder() if main else None
    real_gather = multihost_utils.process_allgather

    class Patch:  # _no_full_host_copy without pytest's monkeypatch
        def __init__(self):
            self.undo = []

        def setattr(self, obj, name, value):
            self.undo.append((obj, name, getattr(obj, name)))
            setattr(obj, name, value)

    patch = Patch()
    _no_full_host_copy(patch, params)
    multihost.BroadcastPipeline(rec, None, 2, weights_dir=os.path.join(out, "weights"),
                                push_dtype="bfloat16").push_weights(params, 3)
    for obj, name, value in reversed(patch.undo):
        setattr(obj, name, value)
    assert multihost_utils.process_allgather is real_gather
    if main:
        assert rec.pushed[0][1] == 3 and type(rec.pushed[0][0]).__name__ == "Written"
    multihost._GATHER_BYTES = 1000
    multihost.BroadcastPipeline(rec, None, 2, push_dtype="bfloat16").push_weights(params, 4)
    if main:
        np.savez(os.path.join(out, "gathered.p0.npz"),
                 **{k: np.asarray(v).astype(np.float32) for k, v in _flat(rec.pushed[-1][0]).items()})
    jax.distributed.shutdown()


if __name__ == "__main__":
    _worker(sys.argv[1])
