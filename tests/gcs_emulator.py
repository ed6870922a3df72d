"""A real GCS emulator on loopback for tests: gcp-storage-emulator (pure Python, the JSON API
that gcsfs, google-cloud-storage and tensorstore's gcs driver speak), run as a subprocess on a
free port with an in-memory store and one bucket."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Emulator:
    def __init__(self, bucket: str = "bucket"):
        self.bucket, self.port = bucket, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = None

    def start(self, timeout_s: float = 30.0) -> "Emulator":
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gcp_storage_emulator", "start", "--host=127.0.0.1", f"--port={self.port}",
             "--in-memory", f"--default-bucket={self.bucket}", "--quiet"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gcp-storage-emulator exited with {self.proc.returncode}: "
                                   f"{self.proc.stderr.read().decode()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/storage/v1/b/{self.bucket}", timeout=2) as r:
                    if json.load(r).get("name") == self.bucket:
                        return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"gcp-storage-emulator did not serve {self.url} within {timeout_s} s")

    def env(self) -> dict:
        """The environment a subprocess needs to use the emulator."""
        return dict(os.environ, STORAGE_EMULATOR_HOST=self.url)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
