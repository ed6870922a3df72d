"""SIGTERM between checkpoints (rl_scaling/preemption.py): the trainer saves the step it is on
and exits with EXIT_PREEMPTED within the grace period; the resumed run is bit-exact with an
uninterrupted one, with every step once in metrics.jsonl and in TensorBoard, also when a torn
line was appended to metrics.jsonl before the resume."""

import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from test_run import overrides, read_jsonl  # noqa: E402

STEPS, EVAL_EVERY, CHECKPOINT_EVERY = 12, 6, 10
ENV = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
TIMING = ("accel_seconds", "time/")  # wall-clock measurements: the only fields that may differ


def _cmd(code, workdir):
    return [sys.executable, os.path.join(code, "launch", "run.py"), f"--workdir={workdir}",
            *overrides(steps=STEPS, eval_every=EVAL_EVERY, checkpoint_every=CHECKPOINT_EVERY, log_every=1)]


def _rows(workdir):
    return {(r["step"], "eval/pass_rate" in r): r for r in read_jsonl(os.path.join(workdir, "metrics.jsonl"))}


def _tb_steps(logdir):
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(str(logdir), size_guidance={ea.SCALARS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, code):
    workdir = tmp_path_factory.mktemp("reference")
    res = subprocess.run(_cmd(code, workdir), env=dict(ENV, PYTHONPATH=str(code)), capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    return workdir


def _same(got, want, where):
    assert sorted(got) == sorted(want), where  # no record lost or duplicated
    for key, row in want.items():
        for field, value in row.items():
            if not field.startswith(TIMING):
                assert got[key].get(field) == value, (where, key, field, got[key].get(field), value)


@pytest.mark.slow
@pytest.mark.parametrize("torn", [False, True])
def test_sigterm_saves_the_current_step_and_resumes_bit_exact(tmp_path, code, reference, torn):
    from rl_scaling import checkpoint, preemption

    work = tmp_path / "preempted"
    proc = subprocess.Popen(_cmd(code, work), env=dict(ENV, PYTHONPATH=str(code)), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 600
    while not any(r.get("step", 0) >= 2 and "loss" in r for r in
                  (read_jsonl(work / "metrics.jsonl") if (work / "metrics.jsonl").exists() else [])):
        assert proc.poll() is None and time.time() < deadline, "the run ended before the signal"
        time.sleep(0.05)
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    elapsed = time.time() - t0
    assert proc.returncode == preemption.EXIT_PREEMPTED, stderr[-3000:]
    assert elapsed < 60, elapsed
    assert "received SIGTERM" in stderr and "re-run the same command to resume" in stderr

    saved = sorted(int(d) for d in os.listdir(work / "checkpoints") if d.isdigit())
    logged = max(step for step, is_eval in _rows(work) if not is_eval)
    assert saved == [logged] and logged % CHECKPOINT_EVERY and logged < STEPS, (saved, logged)
    assert checkpoint.verify(str(work / "checkpoints" / str(logged)))  # with its manifest
    tb_before = _tb_steps(work / "tb")
    assert max(s for s, _ in tb_before["train/loss"]) == logged  # flushed before the exit

    if torn:  # a kill in the middle of a write
        with open(work / "metrics.jsonl", "a") as f:
            f.write('{"step": %d, "loss": 0.12' % (logged + 1))
    resumed = subprocess.run(_cmd(code, work), env=dict(ENV, PYTHONPATH=str(code)), capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {work / 'checkpoints'} at step {logged}" in resumed.stderr
    if torn:
        assert "dropping a torn last line" in resumed.stderr

    _same(_rows(work), _rows(reference), "metrics.jsonl")
    got, want = _tb_steps(work / "tb"), _tb_steps(reference / "tb")
    assert sorted(got) == sorted(want)
    for tag in want:  # every step once, with the uninterrupted run's values
        steps = [s for s, _ in got[tag]]
        assert steps == [s for s, _ in want[tag]], tag
        if not tag.startswith(("compute/accel", "time/")):
            assert got[tag] == want[tag], tag
    assert _tb_steps(work / "tb" / "compute_axis") == _tb_steps(reference / "tb" / "compute_axis")


def test_a_signal_during_the_flag_exchange_counts_at_the_next_step_on_every_process(monkeypatch):
    """Several processes decide on the exchanged flags only: a signal that lands while the
    allgather runs must not make this process stop alone (the others saw 0 and go on)."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    from rl_scaling import preemption

    p = preemption.Preemption(grace_s=3600)
    exchanged = []

    def fake_allgather(x):  # stands in for the other process: it was not signalled
        exchanged.append(int(x[0]))
        if len(exchanged) == 1:
            p._handle(signal.SIGTERM, None)  # the signal lands during the first exchange
        return np.array([[int(x[0])], [0]], np.int32)

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost_utils, "process_allgather", fake_allgather)
    try:
        assert p.agreed() is False  # this step: everyone exchanged 0, so everyone goes on
        assert p.agreed() is True  # the next step: the flag travels, so everyone stops
        assert exchanged == [0, int(signal.SIGTERM)] and p.signum == signal.SIGTERM
        other = preemption.Preemption(grace_s=3600)  # a process told by the exchange stops too
        monkeypatch.setattr(multihost_utils, "process_allgather",
                            lambda x: np.array([[int(x[0])], [int(signal.SIGTERM)]], np.int32))
        assert other.agreed() is True and other.signum == signal.SIGTERM
    finally:
        p.uninstall()
        if p._timer is not None:
            p._timer.cancel()
