"""Weights on a plain HTTP(S) server: ``https://host/path/``.

fsspec's HTTP filesystem hides the response status, so it cannot tell a server that
ignored ``Range`` (200 and the whole body) from one that honoured it; this source speaks
HTTP through httpx to check the status, ``Content-Range`` and ``ETag`` of every read.
"""

from __future__ import annotations

import hashlib
from urllib.parse import quote, urlsplit

import httpx

from ember.errors import (
    ObjectChanged,
    RangeNotSupported,
    ShortRead,
    SourceError,
    WeightsNotFound,
)
from ember.loaders._paths import check_relative, component
from ember.loaders._source import ObjectInfo, WeightSource

_TIMEOUT_S = 60.0


class HttpSource(WeightSource):
    """Range GETs with ``If-Match`` over one pooled client.

    Args:
        root_url: the folder URL, ending in ``/``.
        max_connections: size of the connection pool (the read concurrency).
    """

    def __init__(self, root_url: str, *, max_connections: int = 8) -> None:
        self.url = root_url if root_url.endswith("/") else root_url + "/"
        host = urlsplit(self.url).hostname or "host"
        digest = hashlib.sha256(self.url.encode()).hexdigest()[:16]
        self.namespace = f"http--{component(host)}--{digest}"
        limits = httpx.Limits(max_connections=max_connections)
        self._client = httpx.Client(timeout=_TIMEOUT_S, limits=limits, follow_redirects=True)

    def _url(self, name: str) -> str:
        return self.url + quote(check_relative(name))

    def exists(self, name: str) -> bool:
        try:
            return self._client.head(self._url(name)).status_code == 200
        except httpx.HTTPError:
            return False

    def stat(self, name: str) -> ObjectInfo:
        url = self._url(name)
        try:
            resp = self._client.head(url)
        except httpx.HTTPError as exc:
            raise SourceError(str(exc), url=url) from exc
        if resp.status_code == 404:
            raise WeightsNotFound("HTTP 404", url=url)
        if resp.status_code != 200 or "content-length" not in resp.headers:
            raise SourceError(f"HEAD answered {resp.status_code} without a size", url=url)
        etag = resp.headers.get("etag", "")
        size = int(resp.headers["content-length"])
        # A weak ETag cannot be used with If-Match; fall back to size + Last-Modified.
        version = etag if etag and not etag.startswith("W/") else ""
        version = version or f"{size}-{resp.headers.get('last-modified', '')}"
        return ObjectInfo(name=name, size=size, version=version)

    def read_range(self, info: ObjectInfo, start: int, end: int) -> bytes:
        url = self._url(info.name)
        headers = {"Range": f"bytes={start}-{end - 1}"}
        if info.version.startswith('"'):
            headers["If-Match"] = info.version
        try:
            with self._client.stream("GET", url, headers=headers) as resp:
                self._check_status(resp, info, url)
                data = self._read_body(resp, end - start)
        except httpx.HTTPError as exc:
            raise SourceError(str(exc), url=url) from exc
        if len(data) != end - start:
            raise ShortRead(url=url, start=start, end=end, got=len(data))
        return data

    def _check_status(self, resp: httpx.Response, info: ObjectInfo, url: str) -> None:
        status = resp.status_code
        if status == 412:
            raise ObjectChanged(f"ETag is no longer {info.version}", url=url)
        if status == 404:
            raise ObjectChanged("object disappeared", url=url)
        if status == 200:
            # The server ignored Range; closing the stream avoids reading the whole body.
            raise RangeNotSupported(url=url, status=status)
        if status == 416:
            raise ShortRead(url=url, start="?", end="?", got=0)
        if status != 206:
            raise SourceError(f"GET answered {status}", url=url)
        etag = resp.headers.get("etag")
        if etag and info.version.startswith('"') and etag != info.version:
            raise ObjectChanged(f"ETag {info.version} became {etag}", url=url)
        total = resp.headers.get("content-range", "").rpartition("/")[2]
        if total.isdigit() and int(total) != info.size:
            raise ObjectChanged(f"size {info.size} became {total}", url=url)

    @staticmethod
    def _read_body(resp: httpx.Response, limit: int) -> bytes:
        chunks: list[bytes] = []
        got = 0
        for chunk in resp.iter_bytes():
            chunks.append(chunk)
            got += len(chunk)
            if got > limit:
                break  # a server that sends more than asked is not trusted further
        return b"".join(chunks)

    def close(self) -> None:
        self._client.close()
