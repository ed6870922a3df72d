"""PipelineRL at pod shape on loopback: 2 trainer processes (jax.distributed) and 2 engine
replicas (launch/serve.py processes). Every group id and prompt of the stream is trained on
exactly once by both processes, staleness <= k; a replica killed at step 20 is failed over;
both killed: a named error within reconnect_s + 30 s and the last checkpoint intact."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import jax
import pytest

from rl_scaling import data, tasks
from tests.test_serve import _start_serve

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
P, G, K = 4, 2, 1  # tests/test_pipeline.py::_tiny_run_config


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_trainers(tmp_path, workdir, servers, steps, init_checkpoint=""):
    port = _free_port()
    procs = []
    for pid in range(2):
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one device per process
        env.update(JAX_PLATFORMS="cpu", RL_SCALING_COORDINATOR=f"127.0.0.1:{port}", RL_SCALING_NUM_PROCESSES="2",
                   RL_SCALING_PROCESS_ID=str(pid), PYTHONPATH=ROOT)
        log = open(tmp_path / f"trainer{pid}_{os.path.basename(workdir)}.log", "w")
        procs.append(subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "pod_pipeline_worker.py"),
                                       str(workdir), servers, str(steps), init_checkpoint],
                                      env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
    return procs


def _ledger(workdir, pid):
    path = workdir / "rollout_ledger" / f"from_step0.p{pid}.jsonl"
    return [json.loads(line) for line in open(path)] if path.exists() else []


def _wait_for(predicate, timeout, procs=()):
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, "timed out"
        for p in procs:
            assert p.poll() is None or p.returncode == 0, f"a process exited with {p.returncode}"
        time.sleep(0.2)


@pytest.mark.slow
def test_two_trainers_two_replicas_failover_then_both_lost(tmp_path):
    serves = [_start_serve(tmp_path, f"replica{i}") for i in range(2)]
    servers = ",".join(address for _, address in serves)
    trainers = []
    try:
        # 1. 60 steps; replica 1 SIGKILLed at step 20
        run1 = tmp_path / "run1"
        trainers = _start_trainers(tmp_path, run1, servers, 60)
        _wait_for(lambda: len(_ledger(run1, 0)) >= 20, 600, trainers)
        serves[1][0].send_signal(signal.SIGKILL)
        for p in trainers:
            assert p.wait(600) == 0, open(tmp_path / "trainer0_run1.log").read()[-3000:]
        task = tasks.ArithmeticTask(0)
        stream = data.prompt_stream(task, 0, P)  # the reference: the stream every run draws from (seed 0)
        reference = [p.prompt for _ in range(60) for p in next(stream)]
        ledgers = [_ledger(run1, pid) for pid in range(2)]
        assert ledgers[0] == ledgers[1] and len(ledgers[0]) == 60  # both processes trained on the same batches
        groups = [g for row in ledgers[0] for g in row["groups"]]
        prompts = [p for row in ledgers[0] for p in row["prompts"]]
        assert groups == list(range(60 * P))  # every group id once, in stream order: none lost or duplicated
        assert prompts == reference  # and they are the stream's prompts
        assert all(row["staleness_max"] <= K for row in ledgers[0])
        assert [row["version"] for row in ledgers[0]] == list(range(60))
        rows = [json.loads(line) for line in open(run1 / "metrics.jsonl")]
        steps = [r for r in rows if "rollout/failovers" in r]
        assert len(steps) == 60 and steps[-1]["step"] == 60
        assert steps[10]["rollout/failovers"] == 0 and steps[-1]["rollout/failovers"] >= 1
        assert steps[-1]["rollout/replicas_live"] == 1 and all(r["rollout/staleness_max"] <= K for r in steps)
        assert rows[-1]["samples"] == 60 * P * G

        # 2. a longer run against a restarted replica 1 and replica 0; both killed once a checkpoint exists
        serves[1] = _start_serve(tmp_path, "replica1b")
        servers = ",".join(address for _, address in serves)
        run2 = tmp_path / "run2"
        trainers = _start_trainers(tmp_path, run2, servers, 1000, str(run1 / "warmstart" / "params"))
        _wait_for(lambda: (run2 / "checkpoints" / "10").exists(), 600, trainers)
        for proc, _ in serves:
            proc.send_signal(signal.SIGKILL)
        killed = time.time()
        for p in trainers:
            assert p.wait(5.0 + 30 + 60) != 0
        took = time.time() - killed
        for pid in range(2):
            log = open(tmp_path / f"trainer{pid}_run2.log").read()
            assert "RolloutError" in log and "lost for 5 s" in log and "checkpoint is intact" in log, log[-3000:]
        assert took < 5.0 + 30, f"{took:.0f} s to stop"
    finally:
        for p in trainers:
            p.kill()
        for proc, _ in serves:
            proc.kill()
            proc.wait(30)

    # 3. the last checkpoint is intact and restores
    from rl_scaling import checkpoint, config as config_lib, sharding
    from rl_scaling.rl import train_step as ts
    from tests.pod_pipeline_worker import config

    c = config(servers, 1000)
    train_cfg = config_lib.model_config(c, c.rl.fp32_lm_head)
    optimizer = ts.make_optimizer(c.optim)
    mesh = sharding.make_mesh(dict(c.mesh), jax.devices()[:1])
    state_sh = ts.state_shardings(train_cfg, optimizer, mesh)
    abstract = checkpoint.abstract_like(
        jax.eval_shape(lambda: ts.init_state(train_cfg, optimizer, jax.random.key(0), mesh, state_sh)), state_sh)
    step, state, meta = checkpoint.Checkpoints(str(run2 / "checkpoints")).restore_latest(abstract)
    assert step >= 10 and int(state["step"]) == step and meta["samples"] == step * P * G
    assert meta["pipeline"]["stream"] is not None  # groups in flight are regenerated on resume
