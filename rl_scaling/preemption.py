"""Preemption: SIGTERM or SIGINT during RL finishes the current step, saves a checkpoint of it,
flushes the metrics, and ends the run with `Preempted`; `launch/run.py` exits with
EXIT_PREEMPTED (75, EX_TEMPFAIL: "try again": re-run the same command to resume).

Bounds: if the step and the save take longer than `grace_s` (config.preemption_grace_s) after
the signal, or a second signal comes, the process exits at once with 128 + the signal number
(the shell's convention for a signal death), saving nothing more.

Several processes (hosts): a scheduler may signal one host only, or the hosts at slightly
different steps. After each step every process contributes its flag to a
`multihost_utils.process_allgather` (one tiny collective through jax.distributed), so all stop
at the first step at which any one of them was signalled and save that same step. (Orbax's
and JAX's `reached_preemption_sync_point` serve the TPU maintenance notices of the coordination
service; the flag exchange also covers SIGTERM from any scheduler, on CPU and GPU too.)
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import jax
import numpy as np

EXIT_PREEMPTED = 75
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(Exception):
    """The run stopped on a signal after saving the checkpoint of `step`."""

    def __init__(self, step: int, signum: int):
        self.step, self.signum = step, signum
        super().__init__(f"stopped by {signal.Signals(signum).name} after saving the checkpoint of step {step}; "
                         "re-run the same command to resume")


class Preemption:
    def __init__(self, grace_s: float):
        self.grace_s = float(grace_s)
        self.signum = None  # the first signal received
        self._previous, self._timer = {}, None

    def install(self) -> "Preemption":
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _handle(self, signum, frame):
        del frame
        name = signal.Signals(signum).name
        if self.signum is not None:
            print(f"second signal ({name}): exiting now, without saving", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.signum = signum
        print(f"received {name}: finishing this step, saving a checkpoint and stopping (within "
              f"{self.grace_s:.0f} s; a second signal exits at once)", file=sys.stderr, flush=True)
        self._timer = threading.Timer(self.grace_s, self._expire, args=(signum,))
        self._timer.daemon = True
        self._timer.start()

    def _expire(self, signum):
        print(f"config.preemption_grace_s={self.grace_s:.0f} s passed before the checkpoint was saved: exiting now",
              file=sys.stderr, flush=True)
        os._exit(128 + signum)

    def agreed(self) -> bool:
        """True when this process or any other of the run has been signalled (a collective with
        several processes: every process calls it once per step)."""
        if jax.process_count() == 1:
            return self.signum is not None
        from jax.experimental import multihost_utils

        # Decide on what was exchanged, never on self.signum after the exchange: a signal landing
        # during the allgather would make this process stop while the others, which saw 0, go on
        # (and meet it in different collectives). Such a signal counts at the next step.
        mine = self.signum or 0
        agreed = int(np.max(multihost_utils.process_allgather(np.array([mine], np.int32))))
        if agreed and not mine and self.signum is None:
            self.signum = agreed  # stop (and report) as the signalled process does
        return agreed > 0
