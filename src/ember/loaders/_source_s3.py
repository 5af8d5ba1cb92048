"""Weights in S3 (or any S3-protocol store) read with botocore's thread-safe client.

s3fs runs every request of a process on one asyncio thread, which caps a load at what
that thread can parse; botocore's client is used from the reader's thread pool instead,
one pooled connection per range in flight, and each ranged GET's body is read straight
into the reader's buffer (no intermediate ``bytes``).

The prefix is listed once (``ListObjectsV2``): every ``stat`` and ``exists`` is answered
from that listing, and every GET carries ``If-Match`` with the listed ETag, so an object
replaced after the listing fails its next read (``ObjectChanged``) instead of mixing
versions; nothing needs a second ``HEAD`` at the end. A replica's load opens its URL
three times (the size check, ``config.json``, the weights), so the process keeps one
client per set of options and shares a listing for ``LISTING_TTL_S``; a name missing from a
shared listing, or an object that changed, makes the next source list again. Its clients
share one botocore session: the first client parses the S3 model (0.13-0.4 s of CPU), the
next ones take milliseconds, and a warm-runtime worker builds that first one while idle
(:func:`warm_client`).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from typing import Any

from ember.errors import ObjectChanged, ShortRead, SourceError, WeightsNotFound
from ember.loaders._paths import check_relative, component
from ember.loaders._source import ObjectInfo, WeightSource

# s3fs-style storage options this source understands; any other makes the caller fall
# back to s3fs, which understands them all.
_CREDENTIALS = {"key": "aws_access_key_id", "secret": "aws_secret_access_key",
                "token": "aws_session_token"}
_IGNORED = {"skip_instance_cache", "use_listings_cache", "listings_expiry_time"}
_CLIENT_KEYS = {"endpoint_url", "region_name", "verify", "use_ssl"}
#: How long one process reuses a prefix's listing.
LISTING_TTL_S = 10.0
_lock = threading.Lock()
_clients: dict[str, Any] = {}
_listings: dict[str, tuple[float, dict[str, ObjectInfo]]] = {}
_botocore_session: Any = None


def client_args(options: dict[str, Any]) -> dict[str, Any] | None:
    """botocore ``create_client`` arguments for s3fs-style ``options``; ``None`` if unknown.

    Example:
        >>> client_args({"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": "http://h"}})
        {'aws_access_key_id': 'k', 'aws_secret_access_key': 's', 'endpoint_url': 'http://h'}
        >>> client_args({"requester_pays": True}) is None
        True
    """
    out: dict[str, Any] = {}
    for name, value in options.items():
        if name in _CREDENTIALS:
            out[_CREDENTIALS[name]] = value
        elif name == "endpoint_url":
            out["endpoint_url"] = value
        elif name == "client_kwargs" and isinstance(value, dict) and set(value) <= _CLIENT_KEYS:
            out.update(value)
        elif name not in _IGNORED:
            return None
    return out


def _session() -> Any:
    """The process's botocore session: its loader keeps the parsed S3 service model, so
    every client after the first is built in milliseconds instead of a tenth of a second."""
    import botocore.session

    global _botocore_session
    with _lock:
        if _botocore_session is None:
            _botocore_session = botocore.session.get_session()
        return _botocore_session


def warm_client() -> bool:
    """Parse botocore's S3 model now, so a later load's first client costs milliseconds.

    A warm-runtime worker calls it while it waits for a replica (``ember.control.s3_warm``).
    The throwaway client names its credentials, region and endpoint, so building it reads
    no environment, config file or metadata service and opens no connection.

    Returns:
        ``False`` when botocore is not installed.

    Example:
        >>> warm_client()
        True
    """
    try:
        from botocore.config import Config
    except ImportError:
        return False
    client = _session().create_client(
        "s3", region_name="us-east-1", endpoint_url="http://127.0.0.1:9",
        aws_access_key_id="warm", aws_secret_access_key="warm",
        config=Config(retries={"mode": "standard", "max_attempts": 1}))
    client.get_paginator("list_objects_v2")  # the listing's paginator model, read lazily
    return True


def _shared_client(args: dict[str, Any], max_connections: int) -> Any:
    """One thread-safe botocore client per set of arguments, for the process's life."""
    from botocore.config import Config

    key = json.dumps([args, max_connections], sort_keys=True, default=str)
    with _lock:
        client = _clients.get(key)
    if client is not None:
        return client
    config = Config(max_pool_connections=max_connections + 2,
                    retries={"mode": "standard", "max_attempts": 3})
    client = _session().create_client("s3", config=config, **args)
    with _lock:  # two racing loads keep the first client (and its connection pool)
        return _clients.setdefault(key, client)


def _error_code(exc: BaseException) -> tuple[str, int]:
    response = getattr(exc, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    return code, int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


class S3Source(WeightSource):
    """Ranged GETs with ``If-Match`` from one listing of ``s3://bucket/prefix/``.

    Args:
        url: the folder URL (``s3://bucket/prefix/``).
        options: s3fs-style storage options (see :func:`client_args`).
        max_connections: size of the connection pool (the read concurrency).
    """

    def __init__(self, url: str, options: dict[str, Any], *, max_connections: int = 8) -> None:
        self.url = url if url.endswith("/") else url + "/"
        scheme, _, rest = self.url.partition("://")
        self.bucket, _, prefix = rest.partition("/")
        self.prefix = prefix
        # The same namespace as the s3fs source of this URL: both fill one cache entry.
        digest = hashlib.sha256(self.url.encode("utf-8", "surrogatepass")).hexdigest()[:16]
        self.namespace = f"{scheme}--{component(self.bucket)}--{digest}"
        args = client_args(options)
        if args is None:
            raise SourceError("storage options the S3 client does not take", url=self.url)
        self._client = _shared_client(args, max_connections)
        self._key = json.dumps([self.url, args], sort_keys=True, default=str)
        self._listing: dict[str, ObjectInfo] | None = None
        self._shared = False

    def _list(self) -> dict[str, ObjectInfo]:
        """Every object under the prefix: this source's listing, a recent one, or a new one."""
        if self._listing is not None:
            return self._listing
        with _lock:
            listed_at, listing = _listings.get(self._key, (0.0, {}))
        if time.monotonic() - listed_at < LISTING_TTL_S:
            self._listing, self._shared = listing, True
            return listing
        self._listing, self._shared = self._list_now(), False
        return self._listing

    def _forget_listing(self) -> None:
        with _lock:
            _listings.pop(self._key, None)
        self._listing = None

    def _list_now(self) -> dict[str, ObjectInfo]:
        listing: dict[str, ObjectInfo] = {}
        try:
            pages = self._client.get_paginator("list_objects_v2")
            for page in pages.paginate(Bucket=self.bucket, Prefix=self.prefix):
                for item in page.get("Contents", ()):
                    name = str(item["Key"])[len(self.prefix):]
                    listing[name] = ObjectInfo(name, int(item["Size"]), str(item["ETag"]))
        except Exception as exc:  # botocore raises many unrelated classes
            code, status = _error_code(exc)
            if code == "NoSuchBucket" or status == 404:
                raise WeightsNotFound(f"no bucket {self.bucket}", url=self.url) from None
            raise SourceError(str(exc), url=self.url) from exc
        with _lock:
            _listings[self._key] = (time.monotonic(), listing)
        return listing

    def _lookup(self, name: str) -> ObjectInfo | None:
        info = self._list().get(check_relative(name))
        if info is None and self._shared:  # perhaps uploaded since: list again, once
            self._forget_listing()
            info = self._list().get(name)
        return info

    def exists(self, name: str) -> bool:
        return self._lookup(name) is not None

    def stat(self, name: str) -> ObjectInfo:
        info = self._lookup(name)
        if info is None:
            raise WeightsNotFound("no such object", url=self.describe(name))
        return info

    def _get(self, info: ObjectInfo, start: int, end: int) -> Any:
        key = self.prefix + check_relative(info.name)
        try:
            return self._client.get_object(Bucket=self.bucket, Key=key, IfMatch=info.version,
                                           Range=f"bytes={start}-{end - 1}")["Body"]
        except Exception as exc:
            code, status = _error_code(exc)
            if code in ("PreconditionFailed", "NoSuchKey") or status in (404, 412):
                self._forget_listing()
                raise ObjectChanged(f"ETag is no longer {info.version}",
                                    url=self.describe(info.name)) from None
            raise SourceError(str(exc), url=self.describe(info.name)) from exc

    def read_range(self, info: ObjectInfo, start: int, end: int) -> bytes:
        out = bytearray(end - start)
        self.read_into(info, start, memoryview(out))
        return bytes(out)

    def read_into(self, info: ObjectInfo, start: int, out: memoryview) -> None:
        body = self._get(info, start, start + len(out))
        # The http.client response under urllib3 fills ``out`` from the socket directly;
        # urllib3's own readinto reads into new bytes and copies.
        stream = getattr(body, "_raw_stream", None)
        raw = getattr(stream, "_fp", None)
        reader: Any = raw if hasattr(raw, "readinto") else body
        got = 0
        try:
            while got < len(out):
                n = reader.readinto(out[got:])
                if not n:
                    break
                got += n
        except Exception as exc:
            body.close()
            raise SourceError(f"read failed: {exc}", url=self.describe(info.name)) from exc
        if got == len(out) and raw is not None and raw.isclosed() and stream is not None:
            stream.release_conn()  # the body was read to its end: keep the connection
        else:
            body.close()
        if got != len(out):
            raise ShortRead(url=self.describe(info.name), start=start, end=start + len(out),
                            got=got)

    def confirm(self, info: ObjectInfo) -> None:
        """Nothing to do: every GET carried ``If-Match`` with the listed ETag."""

    def close(self) -> None:
        """Nothing to release: the client is shared by the process's sources."""
