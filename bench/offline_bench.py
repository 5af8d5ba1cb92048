"""The offline benchmark under its former name: ``bench/offline.py``.

Kept because ``tests/integration/test_offline.py`` imports ``offline_bench`` and calls
``main(argv)``; remove it once that test imports ``offline``. ``offline.py`` is loaded from
beside this file, so another module named ``offline`` on ``sys.path`` cannot stand in.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location("bench_offline",
                                               Path(__file__).with_name("offline.py"))
assert _spec is not None and _spec.loader is not None  # the file sits beside this one
_offline = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _offline  # dataclasses look their module up while it executes
_spec.loader.exec_module(_offline)
main = _offline.main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
