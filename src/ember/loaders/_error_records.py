"""Weights errors across processes: a fill records its error, a waiting process re-raises it."""

from __future__ import annotations

from typing import Any

from ember.errors import (
    CacheFull,
    EmberError,
    HeaderInvalid,
    IntegrityError,
    ObjectChanged,
    RangeNotSupported,
    ShortRead,
    SourceError,
    UnsafeFormat,
    UnsafePath,
    WeightsError,
    WeightsNotFound,
)

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
