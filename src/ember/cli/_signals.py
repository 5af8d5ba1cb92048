"""SIGTERM and SIGINT for ``ember run``: the first starts a drain, a second stops at once.

Installed before the rest of the command line is imported (importing torch and Ray takes
seconds), so a signal at any moment of start-up is a request to stop, never a traceback or a
half-started cluster. Standard library only, for the same reason.

Exit codes of ``ember run`` (also in docs/operations.md):

- 0: stopped by SIGTERM or SIGINT after a clean drain (or before anything was started);
- 1: failed: Ember could not start, or stopped for a reason other than a signal;
- 2: bad command line, app target or configuration;
- 3: stopped, but requests were still in flight when the drain's time ran out;
- 4: stopped at once by a second signal during the drain.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import TextIO

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_DRAIN_TIMEOUT, EXIT_FORCED = 0, 1, 2, 3, 4


class StopSignals:
    """The process's SIGTERM/SIGINT handler: ``stop`` on the first, :attr:`on_second` after.

    ``on_second`` runs in the handler and must not return normally; it defaults to leaving
    at once with :data:`EXIT_FORCED`.
    """

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.received: list[str] = []
        self.on_second: Callable[[], None] = lambda: os._exit(EXIT_FORCED)

    def install(self) -> StopSignals:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        self.received.append(name)
        # os.write, not print: the handler may run while the main thread is inside a print
        # to the same stream, and a buffered stream refuses that reentrant call.
        if len(self.received) == 1:
            _say(sys.stdout, f"{name}: draining (a second signal stops at once)")
            self.stop.set()
            return
        _say(sys.stderr, f"{name} again: stopping now")
        self.on_second()


def _say(stream: TextIO, line: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        os.write(stream.fileno(), f"{line}\n".encode())


#: The one handler of this process, installed by ``ember.cli`` for ``ember run``.
STOP = StopSignals()
