"""One trainer per workdir (rl_scaling/lock.py): a local flock held by a real trainer process,
and the generation-matched lock object on gs:// against the GCS emulator."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import gcs_emulator  # noqa: E402
from rl_scaling import lock, paths  # noqa: E402
from test_run import overrides  # noqa: E402


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_local_lock_names_the_holder_and_frees_on_exit(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.path.insert(0, sys.argv[1]); "
                               "from rl_scaling import lock; lock.acquire(sys.argv[2]); print('held', flush=True); "
                               "time.sleep(60)", ROOT, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(lock.LockHeld, match=f"pid {holder.pid} on host '{socket.gethostname()}'"):
            lock.acquire(str(tmp_path))
        assert not lock.held(str(tmp_path))
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    taken = lock.acquire(str(tmp_path))  # the kernel dropped the dead holder's flock
    assert json.loads((tmp_path / lock.LOCK_NAME).read_text())["pid"] == os.getpid()
    taken.release()


@pytest.fixture(scope="module")
def gcs():
    with gcs_emulator.serving("bucket") as emu:
        yield emu


def _put_holder(url, **holder):
    paths.write_text(paths.join(url, lock.LOCK_NAME), json.dumps(holder))


def test_gcs_lock_refuses_a_live_holder_and_takes_over_stale_ones(gcs, caplog):
    url = "gs://bucket/locked"
    mine = lock.acquire(url)
    record = json.loads(paths.read_text(paths.join(url, lock.LOCK_NAME)))
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    with pytest.raises(lock.LockHeld, match=f"pid {os.getpid()} on host"):
        lock._GCSLock(url).acquire()  # a second trainer (another lock object) while this one lives
    mine.release()
    assert not paths.exists(paths.join(url, lock.LOCK_NAME))

    # Another host whose heartbeat is fresh holds it; the same host's dead pid, or an old heartbeat, do not.
    _put_holder(url, host="other-host", pid=1, started=time.time(), heartbeat=time.time())
    with pytest.raises(lock.LockHeld, match="pid 1 on host 'other-host'"):
        lock._GCSLock(url).acquire()
    for stale, why in ((dict(host=socket.gethostname(), pid=_dead_pid(), heartbeat=time.time()), "is not running"),
                       (dict(host="other-host", pid=1, heartbeat=time.time() - lock.STALE_S - 5), "heartbeat")):
        _put_holder(url, started=0, **stale)
        with caplog.at_level("WARNING", logger="rl_scaling.lock"):
            taken = lock._GCSLock(url)
            taken.acquire()
        assert why in caplog.text
        assert json.loads(paths.read_text(paths.join(url, lock.LOCK_NAME)))["token"] == taken.holder["token"]
        taken.release()


def test_gcs_lock_holder_stops_when_taken_over(gcs, monkeypatch):
    url = "gs://bucket/taken"
    mine = lock._GCSLock(url)
    mine.acquire()
    _put_holder(url, host="other-host", pid=7, started=0, heartbeat=time.time())  # a new generation
    monkeypatch.setattr(lock, "HEARTBEAT_S", 0.0)
    with pytest.raises(lock.LockHeld, match="lost the lock .* pid 7 on host 'other-host'"):
        mine.refresh()


@pytest.mark.slow
def test_second_trainer_exits_naming_the_holder_and_takes_over_after_sigkill(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    run = [sys.executable, os.path.join(ROOT, "launch", "run.py"), f"--workdir={tmp_path}"]
    holder = subprocess.Popen(run + overrides(steps=100000, eval_every=100000, checkpoint_every=100000),
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while not (tmp_path / "metrics.jsonl").exists():  # training: the lock is held
            assert holder.poll() is None and time.time() < deadline, "the holder did not start"
            time.sleep(0.1)
        t0 = time.time()
        second = subprocess.run(run + overrides(steps=2), env=env, capture_output=True, text=True, timeout=60)
        elapsed = time.time() - t0
        assert second.returncode == 1, second.stderr[-2000:]
        assert f"pid {holder.pid} on host '{socket.gethostname()}'" in second.stderr, second.stderr[-2000:]
        assert elapsed < 10, elapsed
        assert holder.poll() is None  # the holder is untouched
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    third = subprocess.run(run + overrides(steps=2, eval_every=2, checkpoint_every=2), env=env, capture_output=True,
                           text=True, timeout=600)
    assert third.returncode == 0, third.stderr[-3000:]
    assert (tmp_path / "checkpoints" / "2").is_dir()
