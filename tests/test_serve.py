"""The rollout server on loopback: wire format, a pipeline over gRPC with exact log-probs,
fault reports from the server, a lost server stopping the trainer with a clear error,
and (slow) trainer and `launch/serve.py` as two processes, the server killed mid-run."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from rl_scaling import data, tasks
from rl_scaling.rl import train_step as ts
from rl_scaling.rollout import engine as engine_lib
from rl_scaling.rollout import pipeline as pipeline_lib
from rl_scaling.serving import client as client_lib
from rl_scaling.serving import wire
from rl_scaling.serving import server as server_lib
from tests.conftest import TINY
from tests.test_engine import make_engine

P, G, T = 2, 2, 8
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _engine(mesh, cls=engine_lib.PolicyEngine):
    return make_engine(mesh, cls)  # (with forced interruption)


def _pipeline(backend, k=1):
    task = tasks.ArithmeticTask(0)
    return pipeline_lib.Pipeline(backend, task, data.prompt_stream(task, 0, P), prompts_per_step=P,
                                 samples_per_prompt=G, max_prompt_len=16, max_new_tokens=T, max_staleness=k)


def test_wire_format_roundtrip():
    meta, arrays = wire.unpack(wire.pack({"a": [1, 2], "s": "x"}, {"t": np.arange(6, dtype=np.int32)}))
    assert meta == {"a": [1, 2], "s": "x"} and arrays["t"].tolist() == list(range(6))
    params = {"w": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4).astype(ml_dtypes.bfloat16),
              "b": {"c": np.arange(5, dtype=np.float32)}}
    version, got = wire.read_weight_chunks(wire.weight_chunks(params, 7))
    assert version == 7 and got["['w']"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got["['w']"], params["w"])
    np.testing.assert_array_equal(got["['b']['c']"], params["b"]["c"])
    with pytest.raises(ValueError, match="incomplete|ended"):
        wire.read_weight_chunks(list(wire.weight_chunks(params, 7))[1:])


def test_pipeline_over_grpc_exact_logprobs_and_versions(mesh1, tiny_params):
    eng = _engine(mesh1)
    srv = server_lib.RolloutServer(eng, eng.load_params(), host="127.0.0.1", port=0).start()
    pipe = None
    try:
        pipe = _pipeline(client_lib.RemoteBackend(srv.address, reconnect_s=5))
        params = tiny_params
        pipe.push_weights(params, 0)
        seen = set()
        for step in range(1, 6):
            batch = pipe.next_batch()
            assert batch.staleness.max() <= 1
            seen.update(batch.sample_ids.tolist())
            if step == 1:  # all version 0: check the carried log-probs against a recompute
                seq = np.concatenate([batch.prompt_tokens, batch.out.tokens_BT], 1)
                mask = np.concatenate([batch.prompt_mask, np.arange(T)[None] < batch.out.lengths_B[:, None]], 1)
                lp = np.asarray(ts.token_logprobs(params, TINY, jnp.asarray(seq), jnp.asarray(mask)))[:, 15:]
                sampled = mask[:, 16:] & ~batch.out.forced_BT
                assert np.abs(np.where(sampled, lp - batch.out.logprobs_BT, 0)).max() < 1e-5
                assert np.all(batch.out.logprobs_BT[batch.out.forced_BT] == 0)
            params = jax.tree.map(lambda x: x * 0.99, params)
            pipe.push_weights(params, step)
        assert len(seen) == 5 * P * G
        assert srv.holder.version == 5
    finally:
        if pipe is not None:
            pipe.close()
        srv.stop()
    assert not srv.generator.alive


def test_fetch_replies_are_bounded_in_bytes_and_lose_no_group(mesh1, tiny_params):
    """reply_bytes=1: every Fetch reply carries exactly one group (a Scout group with its routing is
    ~16 MB, several would pass the client's message limit), and the rest follow in the next ones."""
    eng = _engine(mesh1)
    srv = server_lib.RolloutServer(eng, eng.load_params(), host="127.0.0.1", port=0, reply_bytes=1).start()
    pipe = None
    try:
        backend = client_lib.RemoteBackend(srv.address, reconnect_s=5)
        per_reply, poll = [], backend.poll
        backend.poll = lambda timeout: per_reply.append(poll(timeout)) or per_reply[-1]
        pipe = _pipeline(backend)
        pipe.push_weights(tiny_params, 0)
        seen = set()
        for _ in range(3):
            seen.update(pipe.next_batch().sample_ids.tolist())
        assert len(seen) == 3 * P * G
        assert max(len(r) for r in per_reply) == 1 and sum(len(r) for r in per_reply) >= 3 * P
    finally:
        if pipe is not None:
            pipe.close()
        srv.stop()


class _FailingEngine(engine_lib.PolicyEngine):
    def generate(self, params, decode_state):
        raise RuntimeError("injected: device lost")


def test_server_side_engine_failure_reaches_the_trainer(mesh1, tiny_params):
    eng = _engine(mesh1, _FailingEngine)
    srv = server_lib.RolloutServer(eng, eng.load_params(), host="127.0.0.1", port=0).start()
    try:
        pipe = _pipeline(client_lib.RemoteBackend(srv.address, reconnect_s=5))
        pipe.push_weights(tiny_params, 0)
        t = time.time()
        with pytest.raises(pipeline_lib.RolloutError, match="injected: device lost"):
            pipe.next_batch()
        assert time.time() - t < 10
        pipe.close()
    finally:
        srv.stop()


def test_lost_server_stops_the_trainer_with_a_clear_error(mesh1, tiny_params):
    eng = _engine(mesh1)
    srv = server_lib.RolloutServer(eng, eng.load_params(), host="127.0.0.1", port=0).start()
    pipe = _pipeline(client_lib.RemoteBackend(srv.address, reconnect_s=2))
    try:
        pipe.push_weights(tiny_params, 0)
        pipe.next_batch()
        srv.stop(grace=0)
        t = time.time()
        with pytest.raises(pipeline_lib.RolloutError, match=f"rollout server {srv.address} lost.*checkpoint is intact"):
            for _ in range(100):
                pipe.next_batch()
        assert time.time() - t < 10
    finally:
        pipe.close()
        srv.stop()


def _listening_addresses(port):
    """Local addresses of this machine's TCP sockets listening on `port` (Linux /proc/net)."""
    out = []
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with open(f"/proc/net/{name}") as f:
            rows = [line.split() for line in f.read().splitlines()[1:]]
        for row in rows:
            address, hex_port = row[1].split(":")
            if row[3] == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(address)  # 32-bit words in host (little-endian) order
                ip = socket.inet_ntop(family, b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))
                out.append(ip.removeprefix("::ffff:"))  # an IPv4 address on an IPv6 socket
    return sorted(out)


def _non_loopback_address():
    """This machine's address on its default route, if it has one (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
        except OSError:
            return None
        address = s.getsockname()[0]
    return None if address.startswith("127.") or address == "0.0.0.0" else address


def _accepts(address, port) -> bool:
    try:
        socket.create_connection((address, port), timeout=2).close()
        return True
    except OSError:
        return False


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads the listening sockets from Linux /proc/net")
def test_server_listens_on_loopback_only_by_default(mesh1):
    eng = _engine(mesh1)
    srv = server_lib.RolloutServer(eng, eng.load_params(), port=0).start()  # the default host
    wide = server_lib.RolloutServer(eng, eng.load_params(), host="0.0.0.0", port=0).start()  # the check tells them apart
    try:
        assert _listening_addresses(srv.port) == ["127.0.0.1"]
        assert _listening_addresses(wide.port) in (["0.0.0.0"], ["::"])  # IPv4 or dual-stack wildcard
        assert _accepts("127.0.0.1", srv.port)
        other = _non_loopback_address()
        if other is not None:  # reachable from the machine's network address only when asked for
            assert not _accepts(other, srv.port) and _accepts(other, wide.port)
    finally:
        srv.stop()
        wide.stop()


# ---- two processes ---------------------------------------------------------------------------


def _start_serve(tmp_path, name="serve"):
    port_file = tmp_path / f"{name}.port"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one device in the server
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "launch", "serve.py"), "--port=0",
                             f"--port_file={port_file}", "--config.rollout.max_new_tokens=8",
                             "--config.rollout.engine_slots=8", "--config.rollout.length_control=none"],
                            env=env, stdout=open(tmp_path / f"{name}.log", "w"), stderr=subprocess.STDOUT)
    deadline = time.time() + 120
    while not port_file.exists():
        assert proc.poll() is None, (tmp_path / f"{name}.log").read_text()
        assert time.time() < deadline, "launch/serve.py did not start"
        time.sleep(0.2)
    port = int(port_file.read_text())
    if os.path.exists("/proc/net/tcp"):  # the launcher's default: loopback only
        assert _listening_addresses(port) == ["127.0.0.1"]
    return proc, f"127.0.0.1:{port}"


@pytest.mark.slow
def test_two_processes_run_then_server_killed_stops_with_checkpoint_intact(tmp_path):
    from rl_scaling import checkpoint, config as config_lib, sharding, train
    from tests.test_pipeline import _tiny_run_config

    proc, address = _start_serve(tmp_path)
    try:
        # 1. a short run completes with the rollouts served by the other process
        config = _tiny_run_config("pipeline", steps=3)
        config.rollout.server = address
        result = train.train(config, str(tmp_path / "run1"))
        assert result["step"] == 3 and result["samples"] == 3 * 4 * 2

        # 2. a longer run; the server is SIGKILLed once a checkpoint exists
        config = _tiny_run_config("pipeline", steps=500)
        config.rollout.server, config.rollout.reconnect_s = address, 5.0
        config.init_checkpoint = str(tmp_path / "run1" / "warmstart" / "params")
        ckpt_dir = tmp_path / "run2" / "checkpoints"
        killed = {}

        def killer():
            deadline = time.time() + 300
            while time.time() < deadline and not any(p.name.isdigit() and int(p.name) >= 4
                                                     for p in (ckpt_dir.iterdir() if ckpt_dir.exists() else [])):
                time.sleep(0.1)
            killed["t"] = time.time()
            proc.send_signal(signal.SIGKILL)

        threading.Thread(target=killer, daemon=True).start()
        with pytest.raises(pipeline_lib.RolloutError, match="lost.*checkpoint is intact") as err:
            train.train(config, str(tmp_path / "run2"))
        assert "t" in killed, "the run ended before the server was killed"
        assert time.time() - killed["t"] < 30, f"took {time.time() - killed['t']:.1f} s to notice: {err.value}"
    finally:
        proc.kill()
        proc.wait(30)
        pipeline_lib.close_all()

    # 3. the last checkpoint is intact and restores
    train_cfg = config_lib.model_config(config, config.rl.fp32_lm_head)
    optimizer = ts.make_optimizer(config.optim)
    mesh = sharding.make_mesh(dict(config.mesh))
    state_sh = ts.state_shardings(train_cfg, optimizer, mesh)
    abstract = checkpoint.abstract_like(
        jax.eval_shape(lambda: ts.init_state(train_cfg, optimizer, jax.random.key(0), mesh, state_sh)), state_sh)
    time.sleep(1.0)  # an async save may still be finishing in this process
    step, state, meta = checkpoint.Checkpoints(str(ckpt_dir)).restore_latest(abstract)
    assert step >= 4 and int(state["step"]) == step and meta["samples"] == step * 4 * 2


@pytest.mark.slow
def test_ctrl_c_stops_server_and_trainer_cleanly(tmp_path):
    proc, _ = _start_serve(tmp_path, "serve_sigint")
    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 0, (tmp_path / "serve_sigint.log").read_text()[-2000:]

    # A trainer-side embedded pipeline, interrupted while it waits for rollouts.
    script = tmp_path / "trainer.py"
    script.write_text(
        "import sys, jax\n"
        "from configs import tiny\n"
        "from flax import linen as nn\n"
        "from rl_scaling import config as config_lib, data, tasks\n"
        "from rl_scaling.policy import model as model_lib\n"
        "from rl_scaling.rollout import topology\n"
        "c = tiny.get_config()\n"
        "c.rollout.mode, c.rollout.length_control = 'pipeline', 'none'\n"
        "c.rollout.prompts_per_step, c.rollout.samples_per_prompt, c.rollout.max_new_tokens = 2, 2, 8\n"
        "task = tasks.make_task(c.task, 0)\n"
        "cfg = config_lib.model_config(c, True)\n"
        "params = nn.unbox(model_lib.init_params(cfg, jax.random.key(0)))\n"
        "pipe = topology.from_config(c, task, data.prompt_stream(task, 0, 2), cfg, params, 0)\n"
        "print('ready', flush=True)\n"
        "while True:\n"
        "    pipe.next_batch()\n")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    trainer = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    assert trainer.stdout.readline().strip() == "ready"
    time.sleep(2.0)
    trainer.send_signal(signal.SIGINT)
    # No hang: atexit closes the pipeline and joins its thread. SIGINT lands once the main thread
    # is back in Python, which under a loaded CI machine can wait for an engine compile (>30 s seen).
    _, err = trainer.communicate(timeout=120)
    assert "KeyboardInterrupt" in err and "Fatal Python error" not in err, err[-2000:]
