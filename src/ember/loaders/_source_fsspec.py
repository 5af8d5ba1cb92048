"""Weights in an object store reached through fsspec (``s3://``, ``gs://``, ...)."""

from __future__ import annotations

import hashlib
from typing import Any

import fsspec
from fsspec.asyn import sync

from ember.errors import ObjectChanged, ShortRead, SourceError, WeightsNotFound
from ember.loaders._paths import check_relative, component
from ember.loaders._source import ObjectInfo, WeightSource


def _version(info: dict[str, Any]) -> str:
    for key in ("ETag", "etag", "VersionId", "md5Hash", "crc32c", "generation"):
        value = info.get(key)
        if value:
            return str(value)
    stamp = info.get("LastModified") or info.get("mtime") or info.get("updated") or ""
    return f"{info.get('size')}-{stamp}"


def _precondition_failed(exc: BaseException) -> bool:
    # s3fs turns botocore's 412 into a plain OSError; the original is its __cause__.
    seen: BaseException | None = exc
    while seen is not None:
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            code = response.get("Error", {}).get("Code")
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code == "PreconditionFailed" or status == 412:
                return True
        seen = seen.__cause__
    return False


async def _s3_get(fs: Any, path: str, start: int, end: int, etag: str) -> bytes:
    # s3fs's cat_file cannot send If-Match; the object must not change between reads.
    bucket, key, _ = fs.split_path(path)
    resp = await fs._call_s3(
        "get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}", IfMatch=etag
    )
    body = resp["Body"]
    try:
        data: bytes = await body.read()
    finally:
        body.close()
    return data


class FsspecSource(WeightSource):
    """Range reads through an fsspec filesystem; S3 reads carry ``If-Match``.

    Args:
        fs: the filesystem (e.g. ``s3fs.S3FileSystem``).
        root: the root path inside the filesystem, such as ``bucket/prefix``.
        url: the canonical URL of the root, for messages.
        namespace: override for the cache namespace (defaults to protocol + root).
    """

    def __init__(self, fs: Any, root: str, *, url: str, namespace: str | None = None) -> None:
        self.fs = fs
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        # A local file system's root is absolute (a regional cache on a shared mount); an
        # object store's starts at its bucket.
        self.root = root.rstrip("/") if protocol in ("file", "local") else root.strip("/")
        self.url = url
        self._is_s3 = protocol in ("s3", "s3a")
        head = root.strip("/").split("/", 1)[0]
        digest = hashlib.sha256(url.encode("utf-8", "surrogatepass")).hexdigest()[:16]
        self.namespace = namespace or f"{protocol}--{component(head)}--{digest}"

    @classmethod
    def from_url(cls, url: str, root: str, storage_options: dict[str, Any]) -> FsspecSource:
        """Open the filesystem for ``url``'s protocol with ``storage_options``."""
        protocol = url.split("://", 1)[0]
        fs = fsspec.filesystem(protocol, **storage_options)
        return cls(fs, root, url=url)

    def _path(self, name: str) -> str:
        return f"{self.root}/{check_relative(name)}" if self.root else check_relative(name)

    def exists(self, name: str) -> bool:
        try:
            return bool(self.fs.isfile(self._path(name)))
        except FileNotFoundError:
            return False

    def stat(self, name: str) -> ObjectInfo:
        path = self._path(name)
        self.fs.invalidate_cache(path)
        try:
            info = self.fs.info(path)
        except FileNotFoundError:
            raise WeightsNotFound("no such object", url=self.describe(name)) from None
        except OSError as exc:
            raise SourceError(str(exc), url=self.describe(name)) from exc
        if info.get("type") == "directory":
            raise WeightsNotFound("is a directory", url=self.describe(name))
        return ObjectInfo(name=name, size=int(info["size"]), version=_version(info))

    def read_range(self, info: ObjectInfo, start: int, end: int) -> bytes:
        path = self._path(info.name)
        try:
            if self._is_s3:
                data = sync(self.fs.loop, _s3_get, self.fs, path, start, end, info.version)
            else:
                data = self.fs.cat_file(path, start=start, end=end)
        except FileNotFoundError:
            raise ObjectChanged("object disappeared", url=self.describe(info.name)) from None
        except OSError as exc:
            if _precondition_failed(exc):
                raise ObjectChanged(
                    f"ETag is no longer {info.version}", url=self.describe(info.name)
                ) from None
            raise SourceError(str(exc), url=self.describe(info.name)) from exc
        if len(data) != end - start:
            raise ShortRead(url=self.describe(info.name), start=start, end=end, got=len(data))
        return bytes(data)
