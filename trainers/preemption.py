"""Preemption: SIGTERM (a scheduler's notice) or SIGINT (Ctrl-C) stops training after a step, with a checkpoint.

While :class:`StopSignals` is entered, the first SIGTERM or SIGINT is only
recorded; the training loop asks :meth:`StopSignals.agreed` after each step
whether to stop, saves a checkpoint of that step, and raises :class:`Preempted`
(``multimesh-train`` prints it in one line and exits 128 + the signal: 143
for SIGTERM, 130 for SIGINT). A second signal ends the process at once, by
the signal's default action. Leaving the context restores the previous handlers.

With several processes, a signal may reach some processes only, or each at a
different step: they agree on the step to stop at by exchanging their flags
(``multihost_utils.process_allgather``, a collective every process makes at the
same steps: the loop's sync points), so every process saves the same step.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any, Self

import jax
import numpy as np

__all__ = ["SIGNALS", "Preempted", "StopSignals"]

#: The signals that ask for a stop with a checkpoint.
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(Exception):
    """Training stopped on ``signum`` after ``step``, whose checkpoint (``checkpoint``) is committed.

    ``exit_code``: 128 + the signal (143 for SIGTERM, 130 for SIGINT), as a shell reports a
    process ended by that signal.
    """

    def __init__(self, signum: int, step: int, checkpoint: str, by: str = ""):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        self.exit_code = 128 + signum
        super().__init__(f"{signal.Signals(signum).name} received{by}: stopped after step {step} and saved "
                         f"checkpoint {checkpoint}; run the same command to resume from it")


class StopSignals:
    """Records the first SIGTERM/SIGINT instead of ending the process (see the module doc).

    Python handles signals in the main thread only: entered from another thread it
    installs nothing, and the signals keep their usual effect.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        #: Who received the agreed signal, for messages: "" (this process, alone), " by process 1 of 2".
        self.by = ""
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            # None: the handler was not installed from Python (nothing we can put back)
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum
        for s in SIGNALS:  # another one ends the process at once
            signal.signal(s, signal.SIG_DFL)

    def agreed(self, at_sync: bool) -> int | None:
        """The signal to stop on after the current step (None: go on).

        One process: the signal it received. Several: at a sync point (``at_sync``, the
        same steps on every process), the signal of the lowest-numbered process that received
        one, the same answer on all; elsewhere None.
        """
        if jax.process_count() == 1:
            return self.received
        if not at_sync:
            return None
        from jax.experimental import multihost_utils

        got = np.asarray(multihost_utils.process_allgather(np.int32(self.received or 0))).ravel()
        senders = np.flatnonzero(got)
        if not senders.size:
            return None
        self.by = f" by process {senders[0]} of {got.size}"
        return int(got[senders[0]])
