"""The rollout server's edges, on loopback with real grpc: an exclusive bind, loopback decided on
the resolved address, pushes without a session / beyond the version range / with non-finite
leaves refused by name while the replica keeps serving, one trainer session per replica, and
`serve.py --host=::1` without a grpc abort."""

import os
import subprocess
import sys
import time

import grpc
import jax
import numpy as np
import pytest

from rl_scaling.serving import client as client_lib
from rl_scaling.serving import rpc as rpc_lib
from rl_scaling.serving import server as server_lib
from rl_scaling.serving import wire
from rl_scaling.rollout.errors import RolloutError
from tests.test_engine import make_engine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN = "s3cret-for-tests"


def _server(mesh, **kw):
    eng = make_engine(mesh)
    return server_lib.RolloutServer(eng, eng.load_params(), host="127.0.0.1", **kw).start()


def test_a_second_server_on_a_taken_port_fails_naming_it(mesh1):
    first = _server(mesh1, port=0)
    try:
        with pytest.raises(OSError, match=f"cannot bind 127.0.0.1:{first.port}: the port is in use"):
            _server(mesh1, port=first.port)
    finally:
        first.stop()


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("localhost", True), ("::1", True), ("[::1]", True),
                                            ("127.evil.example", False), ("0.0.0.0", False), ("::", False),
                                            ("no-such-host.invalid", False)])
def test_loopback_is_decided_on_the_resolved_address(host, loopback):
    assert rpc_lib.is_loopback(host) is loopback


def test_pushes_without_session_out_of_range_or_non_finite_are_refused_and_the_replica_keeps_serving(
        mesh1, tiny_params):
    srv = _server(mesh1, port=0, token=TOKEN)
    channel = grpc.insecure_channel(srv.address)
    push = channel.stream_unary("/rl_scaling.Rollout/PushWeights")
    health = channel.unary_unary("/rl_scaling.Rollout/Health")
    md = ((wire.TOKEN_METADATA, TOKEN),)
    session = md + ((server_lib.SESSION_METADATA, "trainer-a"),)
    host = jax.device_get(tiny_params)

    def refused(chunks, metadata):
        with pytest.raises(grpc.RpcError) as e:
            push(chunks, timeout=30, metadata=metadata)
        return e.value.code(), e.value.details()

    try:
        code, details = refused(wire.weight_chunks(host, 1), md)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "session id (x-rl-scaling-session" in details, details
        push(wire.weight_chunks(host, 3), timeout=30, metadata=session)
        code, details = refused(wire.weight_chunks(host, 2**31), session)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "version 2147483648 is out of range" in details, details
        bad = jax.tree_util.tree_map_with_path(
            lambda path, x: np.where(np.arange(x.size).reshape(x.shape) == 0, np.nan, x).astype(x.dtype)
            if "embed" in jax.tree_util.keystr(path) else x, host)
        code, details = refused(wire.weight_chunks(bad, 4), session)
        leaf = next(k for k in srv._keys if "embed" in k)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and f"leaf {leaf} has 1 non-finite" in details, details
        inf = jax.tree.map(lambda x: np.full_like(x, np.inf) if x.dtype.kind == "f" else x, host)
        assert refused(wire.weight_chunks(inf, 5), session)[0] == grpc.StatusCode.INVALID_ARGUMENT
        meta, _ = wire.unpack(health(wire.pack({}), timeout=10, metadata=md))
        assert meta["live"] and not meta["error"] and meta["version"] == 3  # still serving version 3
        assert srv.generator.alive
        served = jax.device_get(srv.holder.get()[0])
        assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in jax.tree.leaves(served))
    finally:
        channel.close()
        srv.stop()


def test_two_trainer_sessions_one_replica_the_second_is_refused_naming_the_first(mesh1, tiny_params):
    srv = _server(mesh1, port=0)
    first = second = None
    try:
        first = client_lib.RemoteBackend(srv.address, reconnect_s=5)
        first.push_weights(tiny_params, 0)
        t0 = time.monotonic()
        with pytest.raises(RolloutError) as e:
            client_lib.RemoteBackend(srv.address, reconnect_s=5)
        assert time.monotonic() - t0 < 5  # refused at connect, not after a wait
        assert "FAILED_PRECONDITION" in str(e.value) and f"trainer session {first.session}" in str(e.value)
        assert srv.holder.version == 0 and srv._holder == first.session  # the first keeps its replica
        first.close()  # a clean exit hands the replica back: the next trainer (a resume) takes it at once
        first = None
        second = client_lib.RemoteBackend(srv.address, reconnect_s=5)
        second.push_weights(tiny_params, 0)
        assert srv._holder == second.session
    finally:
        for b in (first, second):
            if b is not None:
                b.close()
        srv.stop()


def test_a_silent_holder_loses_the_replica_after_the_lease(mesh1, tiny_params):
    srv = _server(mesh1, port=0, session_lease_s=1.0)
    try:
        crashed = client_lib.RemoteBackend(srv.address, reconnect_s=5)  # never closed: a SIGKILLed trainer
        crashed.push_weights(tiny_params, 7)
        time.sleep(1.2)
        resumed = client_lib.RemoteBackend(srv.address, reconnect_s=5)
        resumed.push_weights(tiny_params, 2)  # a new session: its versions start afresh
        assert srv._holder == resumed.session and srv.holder.version == 2
        resumed.close()
        crashed._pool.shutdown(wait=False)
    finally:
        srv.stop()


@pytest.mark.slow
def test_serve_on_ipv6_loopback_port_0_serves_or_names_the_error(tmp_path):
    port_file = tmp_path / "port"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "launch", "serve.py"), "--host=::1", "--port=0",
                             f"--port_file={port_file}", "--config.rollout.max_new_tokens=8",
                             "--config.rollout.engine_slots=8", "--config.rollout.length_control=none"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 180
    while proc.poll() is None and not port_file.exists() and time.time() < deadline:
        time.sleep(0.2)
    if port_file.exists():  # IPv6 loopback available: it serves there
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out[-2000:]
        assert "listening on [::1]:" in out, out[-2000:]
    else:
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 1, (proc.returncode, out[-2000:])  # never 134 (a grpc abort)
        assert "launch/serve.py: --host=::1 --port=0: rollout server: cannot bind [::1]:0" in out, out[-2000:]
