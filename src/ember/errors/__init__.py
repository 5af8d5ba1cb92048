"""Ember's one exception hierarchy.

Every error Ember raises on purpose derives from :class:`EmberError` and is importable from
here (a test walks the tree and fails on a class that is not). Each class carries the HTTP
status the edge answers with, and builds its message from keyword fields so that the same
facts reach logs, callers and tests::

    EmberError (500)
    ├── ConfigError (500)              bad decorator options or app wiring; raised at import
    │   ├── ModelFilesMissing          a ready-made model's files are not installed
    │   ├── NoBatchHandler             an offline target has no batch handler to map
    │   └── RayInternalsChanged        the installed Ray moved a private part Ember relies on
    ├── RequestError (400)             the caller's fault; nothing was touched
    │   ├── BadRequest (400)           unsafe names, unreadable input
    │   │   ├── MalformedJSON (400)
    │   │   │   └── JSONTooDeep (400)  nesting over the parser's limit
    │   │   ├── UnsafePath (400)       a name that could escape the cache root
    │   │   └── InputError (400)       an offline input is missing, unreadable or unknown
    │   ├── Unauthorized (401)         no valid ``Authorization: Bearer <key>``
    │   ├── Forbidden (403)            an invoke key (or a remote client) on an admin route
    │   ├── NotFound (404)
    │   │   └── ModelNotFound (404)    an OpenAI ``model`` (or LoRA adapter) this app does not serve
    │   ├── Conflict (409)             fits, but not the state it meets (a rollout already runs)
    │   ├── MethodNotAllowed (405)
    │   ├── BodyTimeout (408)          the body did not arrive within the edge's deadline
    │   ├── PayloadTooLarge (413)      body over max_request_bytes, with or without Content-Length
    │   ├── UnsupportedMediaType (415) a compressed body
    │   ├── InvalidBody (422)          valid JSON of the wrong shape
    │   ├── RateLimited (429)          the key is over its request rate
    │   └── HeadersTooLarge (431)
    ├── ServiceError (503)             the server's state, not the caller's input
    │   ├── QueueFull (503)            over max_queue: rejected at once with Retry-After
    │   ├── DeploymentUnavailable (503)
    │   │   └── WaitingForResources    no node has room for a replica; with the reason
    │   ├── ShuttingDown (503)         the server is draining before it stops; Retry-After
    │   ├── UserCodeError (500)        the handler raised; the replica keeps serving
    │   └── RequestTimeout (504)       over request_timeout_s; the work is cancelled
    │       └── DeadlineExceeded (504) past the caller's X-Ember-Timeout-S, waiting or running
    ├── WeightsError (503)             weights that cannot be trusted or fetched
    │   ├── UnsafeFormat               pickle-based weights; convert to safetensors
    │   ├── HeaderInvalid              the safetensors header lies or is malformed
    │   ├── RangeNotSupported          the server ignored a Range request
    │   ├── ShortRead                  fewer bytes arrived than were asked for
    │   ├── ObjectChanged              the object changed between two reads
    │   ├── IntegrityError             size or checksum differs from what was expected
    │   ├── CacheFull                  no room for a blob under the cap or on disk
    │   ├── InsufficientMemory         the weights do not fit in the node's free memory
    │   ├── WeightsNotFound (404)      no safetensors weights at the URL
    │   ├── SourceError                the origin or a cache tier could not be read
    │   ├── StateDictMismatch          weights that do not fit the model built from its config
    │   └── SnapshotError              a node snapshot could not be used
    │       └── SnapshotInvalid        a record failed a check; the load falls back to streaming
    ├── OfflineError (500)             a batch job cannot go on; finished shards stay committed
    │   ├── OutputExists               the output already holds a job and resume was not asked
    │   ├── ResumeMismatch             resume with other inputs or options than the manifest's
    │   ├── HandlerContract            the handler returned the wrong number of results
    │   └── ShardIncomplete            a shard's rows did not all come back
    └── StatusError                    a status Starlette chose (405 and the like), in Ember's shape

Example:
    >>> err = QueueFull(deployment="mlp", queued=64, limit=64)
    >>> err.status_code, str(err)
    (503, "deployment 'mlp' has 64 queued requests (limit 64); retry shortly")
"""

from __future__ import annotations

from ember.errors._base import (
    BadRequest,
    BodyTimeout,
    ConfigError,
    Conflict,
    DeadlineExceeded,
    DeploymentUnavailable,
    EmberError,
    InvalidBody,
    MalformedJSON,
    MethodNotAllowed,
    ModelNotFound,
    NotFound,
    PayloadTooLarge,
    QueueFull,
    RayInternalsChanged,
    RequestError,
    RequestTimeout,
    ServiceError,
    ShuttingDown,
    UserCodeError,
    WaitingForResources,
    WeightsError,
)
from ember.errors._edge import (
    Forbidden,
    HeadersTooLarge,
    JSONTooDeep,
    RateLimited,
    StatusError,
    Unauthorized,
    UnsupportedMediaType,
)
from ember.errors._offline import (
    HandlerContract,
    InputError,
    NoBatchHandler,
    OfflineError,
    OutputExists,
    ResumeMismatch,
    ShardIncomplete,
)
from ember.errors._weights import (
    CacheFull,
    HeaderInvalid,
    InsufficientMemory,
    IntegrityError,
    ModelFilesMissing,
    ObjectChanged,
    RangeNotSupported,
    ShortRead,
    SnapshotError,
    SnapshotInvalid,
    SourceError,
    StateDictMismatch,
    UnsafeFormat,
    UnsafePath,
    WeightsNotFound,
)

__all__ = [
    "BadRequest",
    "BodyTimeout",
    "CacheFull",
    "ConfigError",
    "Conflict",
    "DeadlineExceeded",
    "DeploymentUnavailable",
    "EmberError",
    "Forbidden",
    "HandlerContract",
    "HeaderInvalid",
    "HeadersTooLarge",
    "InputError",
    "InsufficientMemory",
    "IntegrityError",
    "InvalidBody",
    "JSONTooDeep",
    "MalformedJSON",
    "MethodNotAllowed",
    "ModelFilesMissing",
    "ModelNotFound",
    "NoBatchHandler",
    "NotFound",
    "ObjectChanged",
    "OfflineError",
    "OutputExists",
    "PayloadTooLarge",
    "QueueFull",
    "RangeNotSupported",
    "RateLimited",
    "RayInternalsChanged",
    "RequestError",
    "RequestTimeout",
    "ResumeMismatch",
    "ServiceError",
    "ShardIncomplete",
    "ShortRead",
    "ShuttingDown",
    "SnapshotError",
    "SnapshotInvalid",
    "SourceError",
    "StateDictMismatch",
    "StatusError",
    "Unauthorized",
    "UnsafeFormat",
    "UnsafePath",
    "UnsupportedMediaType",
    "UserCodeError",
    "WaitingForResources",
    "WeightsError",
    "WeightsNotFound",
]
