"""The one module a local cluster's raylet preloads into its Python workers (the warm runtime).

Importing it imports the modules ``control/warm_env.py`` says this worker should: the warm
runtime's list in a worker that may become a replica, nothing in a light one (the edges,
the rollout driver). Like Ray's own preload, a module that fails to import is logged and
skipped. Nothing else should import this module.
"""

from __future__ import annotations

import importlib
import logging
import os

from ember.control.warm_env import modules_to_import

logger = logging.getLogger("ember.warm_imports")


def _import_all() -> list[str]:
    imported = []
    for name in modules_to_import(os.environ):
        try:
            importlib.import_module(name)
        except ImportError:
            logger.exception("warm runtime: preloading %s failed", name)
        else:
            imported.append(name)
    return imported


#: What this worker imported when it started.
IMPORTED = _import_all()
