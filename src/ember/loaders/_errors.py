"""Errors raised by the weights path.

Every class builds its message from keyword fields (see :mod:`ember.errors`)::

    WeightsError (503)                      ember.errors
    ├── UnsafeFormat                        pickle-based weights; convert to safetensors
    ├── HeaderInvalid                       the safetensors header lies or is malformed
    ├── RangeNotSupported                   the server ignored a Range request
    ├── ShortRead                           fewer bytes arrived than were asked for
    ├── ObjectChanged                       the object changed between two reads
    ├── IntegrityError                      size or checksum differs from what was expected
    ├── CacheFull                           no room for a blob under the cap or on disk
    ├── WeightsNotFound                     no safetensors weights at the URL
    └── SourceError                         the origin or a cache tier could not be read
    BadRequest (400)                        ember.errors
    └── UnsafePath                          a name that could escape the cache root
"""

from __future__ import annotations

from typing import Any, ClassVar

from ember.errors import BadRequest, EmberError, WeightsError


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


class UnsafePath(BadRequest):
    """A name that could resolve outside the cache root."""

    template: ClassVar[str] = "unsafe path {name!r}: {reason}"


#: Classes that may cross a process boundary through a fill's error record.
ERROR_TYPES: dict[str, type[EmberError]] = {
    cls.__name__: cls
    for cls in (
        UnsafeFormat,
        HeaderInvalid,
        RangeNotSupported,
        ShortRead,
        ObjectChanged,
        IntegrityError,
        CacheFull,
        WeightsNotFound,
        SourceError,
        UnsafePath,
        WeightsError,
    )
}


def rebuild_error(type_name: str, fields: dict[str, Any]) -> EmberError:
    """Re-create an error recorded by another process from its class name and fields."""
    cls = ERROR_TYPES.get(type_name, WeightsError)
    detail = str(fields.pop("detail", ""))
    return cls(detail, **fields)
