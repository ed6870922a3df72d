"""Preemption of one host of a multi-host run (rl_scaling/preemption.py), with two real
processes: two CPU processes joined by jax.distributed on localhost (gloo collectives) train
through launch/run.py; SIGTERM goes to process 1 only. Both must stop at the same step, save
that step, exit with EXIT_PREEMPTED, and the re-run of the same command must resume from it and
finish with the metrics of an uninterrupted two-process run, bit for bit.

Both two-process runs start RL from one supervised warm start, made once beforehand (one
process, as launch/sweep.py's shared base model) and long enough that rewards, losses and
gradients are not all zero: the comparison then covers real updates."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from test_preemption import TIMING  # noqa: E402
from test_run import overrides, read_jsonl  # noqa: E402

# checkpoint_every past the end: the only checkpoints are the preemption's and the last step's.
STEPS, EVAL_EVERY, CHECKPOINT_EVERY = 10, 5, 1000
DEVICES_PER_PROCESS = 2  # a mesh of 4 devices, 2 per process, as tests/test_distributed.py
TIMEOUT_S = 900
STOP_TIMEOUT_S = 180  # from the signal to both exits: config.preemption_grace_s (60) and the exit
WARM_START = dict(max_steps=400, eval_every=400, lr=3e-3)  # the tiny policy earns some reward
PREEMPTED = re.compile(r"preempted: stopped by SIGTERM after saving the checkpoint of step (\d+); "
                       r"re-run the same command to resume")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def warm_start(tmp_path_factory, code):
    """params of a supervised warm start (one process, one RL step), for config.init_checkpoint."""
    workdir = tmp_path_factory.mktemp("warm")
    cmd = [sys.executable, os.path.join(code, "launch", "run.py"), f"--workdir={workdir}",
           *overrides(steps=1, eval_every=1, checkpoint_every=1),
           *[f"--config.warmstart.{k}={v}" for k, v in WARM_START.items()]]
    res = subprocess.run(cmd, env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", PYTHONPATH=str(code)), cwd=code,
                         capture_output=True, text=True, timeout=TIMEOUT_S)
    assert res.returncode == 0, res.stderr[-3000:]
    return workdir / "warmstart" / "params"


class TwoProcesses:
    """launch/run.py as processes 0 and 1 of one job (the same command on both 'hosts'), each
    process's stdout and stderr in its own log file."""

    def __init__(self, code, workdir, logs, init):
        port = _free_port()
        cmd = [sys.executable, os.path.join(code, "launch", "run.py"), f"--workdir={workdir}",
               *overrides(steps=STEPS, eval_every=EVAL_EVERY, checkpoint_every=CHECKPOINT_EVERY, log_every=1),
               f"--config.init_checkpoint={init}"]
        os.makedirs(logs, exist_ok=True)
        self.logs = [os.path.join(logs, f"process{pid}.log") for pid in range(2)]
        self.procs = []
        for pid in range(2):
            env = dict(os.environ, JAX_PLATFORMS="cpu",
                       XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES_PER_PROCESS}",
                       RL_SCALING_COORDINATOR=f"127.0.0.1:{port}", RL_SCALING_NUM_PROCESSES="2",
                       RL_SCALING_PROCESS_ID=str(pid))
            env["PYTHONPATH"] = str(code)  # the copy ahead of the installed checkout
            with open(self.logs[pid], "w") as log:
                self.procs.append(subprocess.Popen(cmd, env=env, cwd=code, stdout=log, stderr=subprocess.STDOUT))

    def wait(self, timeout=TIMEOUT_S):
        """Both exit codes; a process still running at the deadline is killed and fails the test."""
        deadline = time.time() + timeout
        try:
            for p in self.procs:
                p.wait(timeout=max(deadline - time.time(), 1))
        except subprocess.TimeoutExpired:
            pytest.fail(f"a process hangs after {timeout} s; exit codes {[p.poll() for p in self.procs]}\n"
                        + self.tails())
        finally:
            self.kill()
        return [p.returncode for p in self.procs]

    def kill(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    def output(self, pid):
        with open(self.logs[pid]) as f:
            return f.read()

    def tails(self, n=3000):
        return "\n".join(f"--- process {pid}:\n{self.output(pid)[-n:]}" for pid in range(2))


def _rows(workdir):
    return {(r["step"], "eval/pass_rate" in r): r for r in read_jsonl(os.path.join(workdir, "metrics.jsonl"))}


def _train_steps(workdir):
    """Steps of the train rows process 0 has written so far (a line still being written is not one)."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.endswith("\n")]
    return [r["step"] for r in rows if "loss" in r]


def _checkpoint_steps(workdir):
    return sorted(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit())


@pytest.fixture(scope="module")
def reference(tmp_path_factory, code, warm_start):
    """The same config on two processes, never interrupted."""
    workdir = tmp_path_factory.mktemp("reference")
    run = TwoProcesses(code, workdir / "run", workdir / "logs", warm_start)
    assert run.wait() == [0, 0], run.tails()
    rows = read_jsonl(workdir / "run" / "metrics.jsonl")  # real updates, not a policy that never scores
    assert any(r.get("reward_mean", 0) > 0 for r in rows) and any(r.get("grad_norm", 0) > 0 for r in rows)
    return workdir / "run"


@pytest.mark.slow
def test_sigterm_to_one_host_stops_both_at_one_step_and_resumes_bit_exact(tmp_path, code, warm_start, reference):
    from rl_scaling import checkpoint, preemption

    work = tmp_path / "run"
    run = TwoProcesses(code, work, tmp_path / "logs1", warm_start)
    try:
        deadline = time.time() + TIMEOUT_S
        while not any(s >= 2 for s in _train_steps(work)):  # process 0 writes metrics.jsonl
            assert all(p.poll() is None for p in run.procs) and time.time() < deadline, \
                "the run ended before the signal\n" + run.tails()
            time.sleep(0.05)
        signalled_after = max(_train_steps(work))
        run.procs[1].send_signal(signal.SIGTERM)  # one host only
        t0 = time.time()
        codes = run.wait(STOP_TIMEOUT_S)
    finally:
        run.kill()
    elapsed = time.time() - t0
    out = [run.output(pid) for pid in range(2)]
    assert codes == [preemption.EXIT_PREEMPTED] * 2, (codes, run.tails())
    assert elapsed < 60, elapsed  # within config.preemption_grace_s, not by its timer
    assert "received SIGTERM" in out[1] and "received SIGTERM" not in out[0]  # process 0 learnt it from 1

    stopped = [[int(n) for n in PREEMPTED.findall(o)] for o in out]
    assert all(len(s) == 1 for s in stopped), run.tails()
    (n0,), (n1,) = stopped
    assert n0 == n1, (n0, n1)  # both hosts stopped at the same step
    step = n0
    assert signalled_after <= step < STEPS, (signalled_after, step)  # mid-run, not before the signal
    assert _checkpoint_steps(work) == [step]  # the preemption's checkpoint, nothing else
    assert checkpoint.verify(str(work / "checkpoints" / str(step)))
    assert max(_train_steps(work)) == step  # metrics flushed up to the saved step

    # The same two-process command again: resumes from `step` and finishes.
    resumed = TwoProcesses(code, work, tmp_path / "logs2", warm_start)
    assert resumed.wait() == [0, 0], resumed.tails()
    assert f"resumed from {work / 'checkpoints'} at step {step}" in resumed.output(0), resumed.tails()
    assert _checkpoint_steps(work) == [step, STEPS]

    got, want = _rows(work), _rows(reference)
    assert sorted(got) == sorted(want)  # every step (train and eval rows) once
    assert [s for s, is_eval in sorted(want) if is_eval] == [0, EVAL_EVERY, STEPS]
    for key, row in want.items():
        assert sorted(got[key]) == sorted(row), key
        for field, value in row.items():
            if not field.startswith(TIMING):
                assert got[key][field] == value, (key, field, got[key][field], value)
