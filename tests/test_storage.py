"""gs:// deadlines and appends (rl_scaling/paths.py, rl_scaling/metrics.py): an endpoint that
accepts connections and never answers ends each call within storage.timeout_s with an error
naming the operation, the path and the endpoint (in-process, and from fit.py, convert.py and
serve.py --params); 200 steps of metrics on the GCS emulator upload a volume linear in the steps,
counted by a TCP proxy in front of the emulator."""

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import gcs_emulator  # noqa: E402
from rl_scaling import paths  # noqa: E402


class SilentEndpoint:
    """Accepts TCP connections and never sends a byte (a storage endpoint that hangs)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)

    def close(self):
        self.sock.close()
        for c in self.conns:
            c.close()


class CountingProxy:
    """A TCP proxy to `upstream` that counts the bytes clients send (request lines, headers, bodies)."""

    def __init__(self, upstream_port: int):
        self.upstream = upstream_port
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.sent, self._lock = 0, threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream))
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src, dst, count):
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if count:
                    with self._lock:
                        self.sent += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self):
        self.sock.close()


@contextlib.contextmanager
def _endpoint(url, timeout_s=None):
    old = os.environ.get("STORAGE_EMULATOR_HOST")
    old_timeout = paths._storage["timeout_s"]
    os.environ["STORAGE_EMULATOR_HOST"] = url
    paths._configured = False
    paths.configure_storage(timeout_s=timeout_s)
    try:
        yield
    finally:
        paths._storage["timeout_s"] = old_timeout
        if old is None:
            os.environ.pop("STORAGE_EMULATOR_HOST", None)
        else:
            os.environ["STORAGE_EMULATOR_HOST"] = old
        paths._configured = False


@pytest.fixture
def silent():
    s = SilentEndpoint()
    yield s
    s.close()


TIMEOUT_S, MARGIN_S = 2.0, 3.0


@pytest.mark.parametrize("op, call", [
    ("write", lambda p: paths.write_text(p, "x")),
    ("read", paths.read_text),
    ("stat", paths.exists),
    ("stat", paths.isdir),
    ("list", paths.listdir),
    ("list", paths.find),
    ("delete", paths.remove),
    ("stat", lambda p: paths.append_bytes(p, b"line\n")),
])
def test_a_silent_endpoint_fails_each_call_within_the_deadline_naming_path_and_endpoint(silent, op, call):
    target = "gs://bucket/hung/run/metrics.jsonl"
    with _endpoint(silent.url, timeout_s=TIMEOUT_S):
        t0 = time.monotonic()
        with pytest.raises(paths.StorageError) as e:
            call(target)
        took = time.monotonic() - t0
    assert took < TIMEOUT_S + MARGIN_S, took
    assert f"gs:// {op} {target}" in str(e.value) and silent.url in str(e.value), str(e.value)
    assert "within 2 s (storage.timeout_s)" in str(e.value)
    assert silent.conns  # the call really went to the endpoint and waited on it


def test_metrics_writer_on_a_silent_endpoint_names_the_file_and_the_checkpoints(silent):
    from rl_scaling import metrics

    with _endpoint(silent.url, timeout_s=TIMEOUT_S):
        t0 = time.monotonic()
        with pytest.raises(metrics.MetricsWriteError) as e:
            metrics.MetricsWriter("gs://bucket/hung/run")
        took = time.monotonic() - t0
    assert took < TIMEOUT_S + MARGIN_S, took
    msg = str(e.value)
    assert "gs://bucket/hung/run/metrics.jsonl" in msg and silent.url in msg, msg
    assert "gs://bucket/hung/run/checkpoints" in msg and "re-run the same command" in msg, msg


def _cli(args, url, timeout_s=3):
    env = dict(os.environ, STORAGE_EMULATOR_HOST=url, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)
    env.pop("RL_SCALING_STORAGE_TIMEOUT_S", None)
    if timeout_s is not None:
        env["RL_SCALING_STORAGE_TIMEOUT_S"] = str(timeout_s)
    with tempfile.TemporaryDirectory() as cwd:
        t0 = time.monotonic()
        res = subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=240)
        return res, time.monotonic() - t0, os.listdir(cwd)


@pytest.mark.slow
def test_cli_tools_name_the_gs_path_and_the_endpoint_when_storage_hangs(silent):
    """fit.py, convert.py and serve.py --params end with one line naming the path and the endpoint
    (each run is a fresh interpreter: ~10-30 s of imports on a loaded machine, hence slow)."""
    run = "gs://bucket/hung/run"
    for args in ([os.path.join(ROOT, "launch", "fit.py"), run, "--out=/tmp/unused-fit-out"],
                 [os.path.join(ROOT, "launch", "convert.py"), "export", run, "hf_out"],
                 [os.path.join(ROOT, "launch", "serve.py"), "--port=0", f"--params={run}/warmstart/params"]):
        res, took, left = _cli(args, silent.url)
        name = os.path.basename(args[0])
        assert res.returncode != 0, (name, res.stderr[-2000:])
        assert silent.url in res.stderr and "gs://bucket/hung/run" in res.stderr, (name, res.stderr[-2000:])
        assert "no answer within 3 s" in res.stderr, (name, res.stderr[-2000:])
        assert "Traceback" not in res.stderr, (name, res.stderr[-3000:])
        assert left == [], (name, left)  # nothing degraded to a local folder


@pytest.mark.slow
def test_a_tiny_run_on_a_silent_endpoint_exits_within_the_deadline_naming_the_path(silent):
    """The whole launcher, not one call: `run.py --workdir=gs://...` with storage.timeout_s=5 on an
    endpoint that accepts and never answers exits non-zero well within timeout_s + 60 s, naming the
    path and the endpoint in one line, and leaves nothing local behind."""
    args = [os.path.join(ROOT, "launch", "run.py"), "--config=" + os.path.join(ROOT, "configs", "tiny.py"),
            "--workdir=gs://bucket/hung/run", "--config.storage.timeout_s=5"]
    env_timeout = None  # the config field, not $RL_SCALING_STORAGE_TIMEOUT_S, sets the deadline here
    res, took, left = _cli(args, silent.url, timeout_s=env_timeout)
    assert res.returncode != 0, res.stderr[-2000:]
    assert took < 5 + 60, took
    assert silent.url in res.stderr and "gs://bucket/hung/run" in res.stderr, res.stderr[-2000:]
    assert "no answer within 5 s" in res.stderr and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert left == [], left
    assert silent.conns


def test_metrics_on_gcs_upload_only_what_is_new_over_200_steps():
    """Every write flushed to the bucket (flush_s=0): the bytes sent to the emulator for steps
    101-200 are about those for steps 1-100 (linear), not three times as many (a whole rewrite
    of each file per write). The files read back whole with the project's loaders."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    from rl_scaling import metrics
    from rl_scaling.scaling import io

    emu = gcs_emulator.Emulator("bucket").start()
    proxy = CountingProxy(emu.port)
    run = "gs://bucket/linear/run"
    try:
        with _endpoint(proxy.url):
            w = metrics.MetricsWriter(run)
            w.flush_s = 0.0  # each write goes out at once: the worst case for the step path
            sent = {}
            for step in range(1, 201):
                rec = {"loss": 1.0 / step, "reward_mean": 0.5, "grad_norm": 0.1 * step, "compute_flops": step * 1e12,
                       "accel_seconds": 0.01 * step, "samples": 16 * step}
                if step % 10 == 0:
                    rec["eval/pass_rate"] = step / 400
                w.write(step, rec)
                if step in (100, 200):
                    sent[step] = proxy.sent
            w.close()
            first, second = sent[100], sent[200] - sent[100]
            assert second < 1.3 * first, (first, second)  # quadratic growth would make it ~3x
            size = len(paths.read_bytes(run + "/metrics.jsonl")) + sum(
                len(paths.read_bytes(f)) for f in paths.find(run + "/tb"))
            assert sent[200] < 30 * size, (sent[200], size)  # each byte once, plus per-request headers
            assert not [f for f in paths.find(run) if ".append-" in f]  # the parts were composed and deleted
            [loaded] = io.load_jsonl(run + "/metrics.jsonl", axis="steps")
            assert list(loaded.compute) == list(range(10, 201, 10))
            local = tempfile.mkdtemp()
            try:
                for f in paths.find(run + "/tb"):
                    dest = os.path.join(local, f[len(run) + 1:])
                    os.makedirs(os.path.dirname(dest), exist_ok=True)
                    with open(dest, "wb") as out:
                        out.write(paths.read_bytes(f))
                acc = ea.EventAccumulator(os.path.join(local, "tb"), size_guidance={ea.SCALARS: 0})
                acc.Reload()
                assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, 201))
            finally:
                shutil.rmtree(local)
    finally:
        proxy.close()
        emu.stop()


def test_storage_settings_are_checked():
    with pytest.raises(ValueError, match="storage.timeout_s"):
        paths.configure_storage(timeout_s=0)
    with pytest.raises(ValueError, match="storage.retries"):
        paths.configure_storage(retries=-1)
    from configs import common

    assert common.base_config().storage.timeout_s == 120.0
    json.dumps(common.base_config().storage.to_dict())
