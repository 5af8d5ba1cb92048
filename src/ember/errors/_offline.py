"""Errors of offline batch jobs.

Bad rows are data, not exceptions: they go to the job's errors file and never stop it. These
classes are for the job itself.
"""

from __future__ import annotations

from typing import ClassVar

from ember.errors._base import BadRequest, ConfigError, EmberError


class NoBatchHandler(ConfigError):
    """The target deployment has no handler that takes a batch."""

    template: ClassVar[str] = "{detail}"


class InputError(BadRequest):
    """An input cannot be listed, opened or read."""

    template: ClassVar[str] = "cannot read input {path}: {detail}"


class OfflineError(EmberError):
    """A batch job cannot go on; shards already committed stay valid."""

    template: ClassVar[str] = "batch job failed: {detail}"


class OutputExists(OfflineError):
    template: ClassVar[str] = (
        "{output} already holds a batch job; pass resume=True (--resume) to finish it,"
        " or write to another output"
    )


class ResumeMismatch(OfflineError):
    template: ClassVar[str] = (
        "cannot resume {output}: {field} was {before!r} and is now {now!r}; resume with the"
        " same inputs and options, or write to another output"
    )


class HandlerContract(OfflineError):
    template: ClassVar[str] = (
        "{deployment}.{attr} returned {got} results for {expected} inputs; a batch handler"
        " must return one result per input, in order"
    )


class ShardIncomplete(OfflineError):
    template: ClassVar[str] = (
        "shard {shard} returned {got} of {expected} rows; run again with resume to redo it"
    )
