"""``ember run`` ends its process once everything is down, without the interpreter's teardown,
keeping its exit code and its last output."""

from __future__ import annotations

import os
import subprocess
import sys

# A thread that never ends and is not a daemon: a normal exit joins it, so the process would
# only end at the test's timeout. Output is left in the buffer (a pipe is block-buffered).
SCRIPT = """
import threading
from ember.cli._run import leave
threading.Thread(target=threading.Event().wait).start()
print("last words")
leave(3)
"""


def test_leave_exits_at_once_with_the_code_and_the_output_flushed() -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=60, env=env)
    assert done.returncode == 3, done.stderr
    assert done.stdout == "last words\n"
