"""Names and paths that cannot escape the cache root."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from ember.errors import UnsafePath

_SAFE_COMPONENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=+-]{0,199}$")
SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


def check_relative(name: str) -> str:
    """Refuse a relative file name that could leave its directory.

    Args:
        name: a name such as ``model-00001-of-00002.safetensors`` or ``sub/model.safetensors``.

    Returns:
        The name, unchanged.

    Raises:
        UnsafePath: the name is empty, absolute, has ``..``, a backslash or a NUL byte.
    """
    if not name:
        raise UnsafePath(name=name, reason="empty name")
    if "\x00" in name:
        raise UnsafePath(name=name, reason="NUL byte")
    if "\\" in name:
        raise UnsafePath(name=name, reason="backslash")
    if name.startswith("/") or os.path.isabs(name):
        raise UnsafePath(name=name, reason="absolute path")
    parts = name.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise UnsafePath(name=name, reason="'..', '.' or empty path component")
    return name


def component(text: str) -> str:
    """Turn an arbitrary string into one safe path component (hashed when it is not one)."""
    if _SAFE_COMPONENT.match(text) and ".." not in text:
        return text
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip(".-")[:48]
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{cleaned}-{digest}" if cleaned else digest


def within(root: Path, path: Path) -> Path:
    """Resolve ``path`` (following symlinks) and refuse it if it lies outside ``root``.

    Raises:
        UnsafePath: the resolved path is not under the resolved root.
    """
    real_root = root.resolve()
    real = path.resolve()
    if real != real_root and real_root not in real.parents:
        raise UnsafePath(name=str(path), reason=f"resolves outside the cache root {real_root}")
    return real
