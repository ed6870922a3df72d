"""Checkpoint integrity (rl_scaling/checkpoint.py): 64 flipped bytes in the newest checkpoint
are detected by its manifest, the resume falls back naming the file, replays the lost steps
exactly once and bit-exact, and the next save replaces the corrupt step; a disk-full error during
a save stops the run with a named error and a nonzero exit, the last good checkpoint intact."""

import errno
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from test_run import fast_config, overrides, read_jsonl  # noqa: E402


def _largest_file(directory):
    files = [os.path.join(r, f) for r, _, names in os.walk(directory) for f in names]
    return max(files, key=os.path.getsize)


def _flip_middle(path, n=64):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 2)
        block = f.read(n)
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in block))


def _tb_steps(logdir, tag):
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(str(logdir), size_guidance={ea.SCALARS: 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


@pytest.mark.slow
def test_flipped_bytes_fall_back_naming_the_file_and_the_next_save_replaces_it(tmp_path, caplog):
    from rl_scaling import checkpoint, train

    def config(steps):
        return fast_config(steps=steps, eval_every=100, checkpoint_every=3, log_every=1)

    train.train(config(8), str(tmp_path / "reference"))
    work = str(tmp_path / "work")
    train.train(config(6), work)  # checkpoints 3 and 6
    corrupt = _largest_file(os.path.join(work, "checkpoints", "6"))
    _flip_middle(corrupt)
    with caplog.at_level("WARNING"):
        result = train.train(config(8), work)
    assert result["step"] == 8
    assert any(corrupt in r.getMessage() and "SHA-256 differs" in r.getMessage() for r in caplog.records), caplog.text
    assert any("resumed from step 3" in r.getMessage() for r in caplog.records)
    assert checkpoint.verify(os.path.join(work, "checkpoints", "6"))  # step 6 written anew over the corrupt one
    assert sorted(int(d) for d in os.listdir(os.path.join(work, "checkpoints")) if d.isdigit()) == [3, 6, 8]

    ref = {r["step"]: r for r in read_jsonl(tmp_path / "reference" / "metrics.jsonl") if "loss" in r}
    got = [r for r in read_jsonl(os.path.join(work, "metrics.jsonl")) if "loss" in r]
    assert [r["step"] for r in got] == list(range(1, 9))  # steps 4-6 redone, once each
    for r in got:
        assert r["loss"] == ref[r["step"]]["loss"] and r["compute_flops"] == ref[r["step"]]["compute_flops"]
    # TensorBoard: the replayed steps are purged from the first session's events
    assert _tb_steps(os.path.join(work, "tb"), "train/loss") == _tb_steps(tmp_path / "reference" / "tb", "train/loss")


_DISK_FULL = """
import errno, runpy, sys
import orbax.checkpoint as ocp
save = ocp.CheckpointManager.save
def full(self, step, *a, **k):
    if step >= 4:
        raise OSError(errno.ENOSPC, "No space left on device")
    return save(self, step, *a, **k)
ocp.CheckpointManager.save = full
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_disk_full_during_a_save_is_a_named_error_and_keeps_the_last_checkpoint(tmp_path):
    from rl_scaling import checkpoint

    cmd = [sys.executable, "-c", _DISK_FULL, os.path.join(ROOT, "launch", "run.py"), f"--workdir={tmp_path}",
           *overrides(steps=6, eval_every=100, checkpoint_every=2)]
    res = subprocess.run(cmd, env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=""), capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 1, res.stderr[-3000:]
    assert (f"saving checkpoint 4 to {tmp_path / 'checkpoints' / '4'} failed: OSError: [Errno {errno.ENOSPC}] No space "
            "left on device. The last good checkpoint is 2") in res.stderr, res.stderr[-3000:]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2"]  # no step 4, no temporary directory
    assert checkpoint.verify(str(tmp_path / "checkpoints" / "2"))
    assert max(r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")) == 4  # stopped at the failed save


def test_manifest_on_gcs_names_the_changed_file():
    import gcs_emulator
    import pytest as pt

    from rl_scaling import checkpoint, paths

    with gcs_emulator.serving("bucket"):
        step = "gs://bucket/run/checkpoints/3"
        for name, text in (("state/d/abc", "x" * 1000), ("meta/metadata", "{}")):
            paths.write_text(paths.join(step, name), text)
        checkpoint.write_manifest(step)
        assert checkpoint.verify(step)
        paths.write_text(paths.join(step, "state/d/abc"), "x" * 500 + "y" + "x" * 499)
        with pt.raises(checkpoint.CorruptCheckpoint, match="gs://bucket/run/checkpoints/3/state/d/abc: SHA-256 differs"):
            checkpoint.verify(step)
