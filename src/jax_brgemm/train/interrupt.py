"""Clean interruption: SIGINT / SIGTERM stop a run at the next step boundary.

The handler only records the signal; the training loop polls ``requested()`` between
steps (and between runs) and stops there: it saves a final checkpoint when
checkpointing is on, closes the MLPerf log with ``run_stop`` status ``aborted`` and
raises ``Interrupted``, which the command line turns into one line and the exit code
128 + signal (130 for SIGINT, 143 for SIGTERM). A second signal while stopping exits
at once, with no final checkpoint (an interrupted orbax save is never loaded).
"""

import contextlib
import os
import signal
import sys
from typing import Optional

SIGNALS = (signal.SIGINT, signal.SIGTERM)

_received: Optional[int] = None


class Interrupted(Exception):
    """A run stopped on a signal; ``message`` says where and what was saved."""

    def __init__(self, signum: int, message: str = ""):
        super().__init__(message)
        self.signum = signum
        self.message = message

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


def requested() -> Optional[int]:
    """The signal received since ``handling()`` began, or None."""
    return _received


def name() -> Optional[str]:
    """The name of the signal received (e.g. "SIGTERM"), or None."""
    return signal.Signals(_received).name if _received is not None else None


def _handler(signum, frame):
    global _received
    if _received is not None:  # a second signal: the user wants out now
        os.write(2, f"{signal.Signals(signum).name} again: exiting now, without a final "
                    f"checkpoint\n".encode())
        os._exit(128 + signum)
    _received = signum


@contextlib.contextmanager
def handling():
    """Installs the handlers for SIGINT and SIGTERM (main thread only; elsewhere a no-op)."""
    global _received
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _received = None
    previous = {s: signal.signal(s, _handler) for s in SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        _received = None


def report(e: Interrupted, stream=None) -> int:
    """Prints the one line of an interrupted invocation; returns its exit code."""
    print(f"interrupted by {e.name}: {e.message}", file=stream or sys.stderr)
    return e.exit_code
