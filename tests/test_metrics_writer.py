"""metrics.MetricsWriter against tensorboard's own loaders: each step once after a resume and after
a re-run of a run killed before its first checkpoint (EventAccumulator and the Python data
loader behind `tensorboard --load_fast=false`), `flush()` meaning on disk (a SIGKILL right after
it loses nothing), and a full disk ending in one error naming the file and the last checkpoint."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _loaders(logdir):
    """{loader name: {tag: [steps]}} from both of tensorboard's Python event loaders."""
    from tensorboard.backend.event_processing import event_accumulator as ea
    from tensorboard.backend.event_processing import plugin_event_accumulator as pea

    acc = ea.EventAccumulator(str(logdir), size_guidance={ea.SCALARS: 0})
    acc.Reload()
    out = {"event_accumulator": {t: [e.step for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}}
    plug = pea.EventAccumulator(str(logdir), size_guidance={pea.TENSORS: 0})
    plug.Reload()
    out["plugin_event_accumulator"] = {t: [e.step for e in plug.Tensors(t)] for t in plug.Tags()["tensors"]}
    return out


def _values(logdir, tag):
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(str(logdir), size_guidance={ea.SCALARS: 0})
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)}


def _record(step):
    return {"loss": step / 100, "compute_flops": step * 2e9, "eval/pass_rate": step / 50}


def test_resume_shows_each_step_once_in_both_loaders(tmp_path):
    from rl_scaling import metrics

    w = metrics.MetricsWriter(str(tmp_path))
    for s in range(0, 7):
        w.write(s, _record(s))
    w.close()
    time.sleep(1.1)  # a later segment's file sorts after the first even with whole-second names
    w = metrics.MetricsWriter(str(tmp_path), resume_step=3, resume_flops=3 * 2e9)  # steps 4-6 are redone
    for s in range(4, 9):
        w.write(s, {**_record(s), "loss": -s})
    w.close()
    for logdir, tag, want in ((tmp_path / "tb", "train/loss", list(range(9))),
                              (tmp_path / "tb" / metrics.COMPUTE_AXIS_RUN, "eval_vs_compute/pass_rate",
                               [2 * s for s in range(9)])):
        for loader, tags in _loaders(logdir).items():
            assert tags[tag] == want, (loader, tag, tags[tag])
    assert _values(tmp_path / "tb", "train/loss")[5] == -5  # the redone step's value


_KILLED = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {root!r})
    from rl_scaling import metrics
    w = metrics.MetricsWriter({workdir!r})
    for s in range({steps}):
        extra = {{f"time/part{{i}}_s": i for i in range(200)}} if s == {steps} - 1 else {{}}
        w.write(s, {{"loss": s / 100, "compute_flops": s * 2e9, "samples": s, "accel_seconds": s / 10, **extra}})
    w.flush()
    os.kill(os.getpid(), signal.SIGKILL)  # right after the flush, before any checkpoint
""")


def _killed_run(workdir, steps):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, "-c", _KILLED.format(root=ROOT, workdir=str(workdir), steps=steps)],
                         env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == -9, res.stderr[-2000:]


def test_flush_means_on_disk_a_sigkill_right_after_it_loses_nothing(tmp_path):
    _killed_run(tmp_path, 6)
    for loader, tags in _loaders(tmp_path / "tb").items():
        for tag in ("train/loss", "compute/samples", "compute/accel_seconds", "compute/flops"):
            assert tags[tag] == list(range(6)), (loader, tag, tags[tag])
        assert all(tags.get(f"time/part{i}_s") == [5] for i in range(200)), loader  # the last step's every scalar


def test_a_rerun_after_a_kill_before_the_first_checkpoint_shows_each_step_once(tmp_path):
    from rl_scaling import metrics

    _killed_run(tmp_path, 6)
    time.sleep(1.1)
    w = metrics.MetricsWriter(str(tmp_path))  # no checkpoint: the re-run starts from step 0
    for s in range(0, 4):
        w.write(s, {"loss": -s})
    w.close()
    for loader, tags in _loaders(tmp_path / "tb").items():
        assert tags["train/loss"] == [0, 1, 2, 3], (loader, tags["train/loss"])
    assert _values(tmp_path / "tb", "train/loss") == {0: 0.0, 1: -1.0, 2: -2.0, 3: -3.0}


def test_full_disk_names_the_file_and_the_last_good_checkpoint(tmp_path):
    """metrics.jsonl on a full device (/dev/full: every write fails with ENOSPC)."""
    from rl_scaling import metrics

    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    (tmp_path / "checkpoints" / "5").mkdir(parents=True)
    (tmp_path / "checkpoints" / "10").mkdir()
    (tmp_path / "checkpoints" / "15.orbax-checkpoint-tmp-1").mkdir()  # an interrupted save: not good
    w = metrics.MetricsWriter(str(tmp_path), resume_step=10)
    os.symlink("/dev/full", tmp_path / "metrics.jsonl")
    with pytest.raises(metrics.MetricsWriteError) as e:
        w.write(11, {"loss": 0.5})
    msg = str(e.value)
    assert str(tmp_path / "metrics.jsonl") in msg and "No space left on device" in msg, msg
    assert f"step 10 in {tmp_path / 'checkpoints'}" in msg and "re-run the same command" in msg, msg


_FULL_TB = textwrap.dedent("""
    import os, resource, signal, sys
    sys.path.insert(0, {root!r})
    from rl_scaling import metrics
    w = metrics.MetricsWriter({workdir!r}, resume_step=10)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails with EFBIG, as on a full disk
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
    try:
        for s in range(11, 2000):
            w.write(s, {{"loss": s / 100, "reward_mean": 0.5}})
            if s % 50 == 0:
                w.flush()
    except metrics.MetricsWriteError as e:
        print("ERROR", e)
        sys.exit(1)
""")


def test_full_disk_while_writing_events_names_the_file_and_the_checkpoint(tmp_path):
    (tmp_path / "checkpoints" / "10").mkdir(parents=True)  # the event file (~90 bytes a step) fills first
    res = subprocess.run([sys.executable, "-c", _FULL_TB.format(root=ROOT, workdir=str(tmp_path))],
                         env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=120)
    assert res.returncode == 1, res.stderr[-2000:]
    assert "ERROR writing " + str(tmp_path / "tb") in res.stdout, res.stdout
    assert "File too large" in res.stdout and f"step 10 in {tmp_path / 'checkpoints'}" in res.stdout, res.stdout
