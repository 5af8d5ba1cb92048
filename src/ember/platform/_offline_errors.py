"""Errors of offline batch jobs (``ember.platform.offline``), part of :mod:`ember.errors`.

Bad rows are data, not exceptions: they go to the job's errors file and never stop it.
These classes are for the job itself::

    EmberError (500)
    ├── ConfigError (500)
    │   └── NoBatchHandler (500)     the target has no batch-form or tensor-form handler to map
    ├── RequestError (400)
    │   └── BadRequest (400)
    │       └── InputError (400)     an input is missing, unreadable or of an unknown format
    └── OfflineError (500)           the job cannot go on; finished shards stay committed
        ├── OutputExists (500)       the output already holds a job and resume was not asked
        ├── ResumeMismatch (500)     resume with other inputs or options than the manifest's
        ├── HandlerContract (500)    the handler returned the wrong number of results
        └── ShardIncomplete (500)    a shard's rows did not all come back

Example:
    >>> str(ShardIncomplete(shard=3, got=9, expected=10))
    'shard 3 returned 9 of 10 rows; run again with resume to redo it'
"""

from __future__ import annotations

from typing import ClassVar

from ember.errors import BadRequest, ConfigError, EmberError


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
