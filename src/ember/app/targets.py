"""Import the app (or deployment) a command line names: ``module:attr`` or ``file.py:attr``.

``ember run``, ``ember batch`` and the tests all resolve targets here, so a target means the
same thing everywhere.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from types import ModuleType

from ember.app.app import App
from ember.errors import ConfigError


def load_app(target: str) -> App:
    """Import ``module:attr`` or ``path/to/file.py:attr`` from the current directory.

    Raises:
        ConfigError: when the target is malformed, missing, or not an ``ember.App``.
    """
    module_ref, sep, attr = target.rpartition(":")
    if not sep or not module_ref or not attr:
        raise ConfigError(f"target must look like 'module:app' or 'file.py:app', got {target!r}")
    module = import_module_ref(module_ref)
    try:
        app = getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"{module_ref} has no attribute {attr!r}") from None
    if not isinstance(app, App):
        raise ConfigError(f"{target} is a {type(app).__name__}, not an ember.App")
    return app


def import_module_ref(module_ref: str) -> ModuleType:
    """Import a dotted module name or a ``.py`` path, the current directory first on the path."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)  # as uvicorn and `serve run` do
    if module_ref.endswith(".py") or os.sep in module_ref:
        path = Path(module_ref).resolve()
        if not path.is_file():
            raise ConfigError(f"no such file: {module_ref}")
        # Import by module name from its directory so Ray workers can import it the same way.
        sys.path.insert(0, str(path.parent))
        module_ref = path.stem
    try:
        return importlib.import_module(module_ref)
    except ModuleNotFoundError as exc:
        raise ConfigError(f"cannot import {module_ref!r}: {exc}") from None
