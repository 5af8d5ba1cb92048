"""Weights in a Hugging Face repository: ``hf://org/repo@revision[/file]``.

Files are read from the local Hugging Face cache with ``local_files_only=True``: Ember never
downloads from a hub at run time. Put a revision in the cache beforehand (for example with
``huggingface-cli download``, or by copying a cache directory), or serve the weights from
object storage (``s3://``, ``gs://``) or a file.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from ember.errors import UnsafePath, WeightsNotFound
from ember.loaders._paths import SHA256_HEX, check_relative
from ember.loaders._source import ObjectInfo, WeightSource
from ember.loaders._source_file import FileSource, file_version

_REPO_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class HfRef:
    """A parsed ``hf://`` URL."""

    repo_id: str
    revision: str
    path: str | None


def parse_hf_url(url: str) -> HfRef:
    """Split ``hf://org/repo@revision/path`` into its parts.

    Raises:
        UnsafePath: the repository id, revision or path is malformed or unsafe.
    """
    rest = url[len("hf://") :]
    parts = rest.split("/")
    if len(parts) < 2:
        raise UnsafePath(name=url, reason="expected hf://org/repo[@revision][/file]")
    org, repo_rev = parts[0], parts[1]
    repo, _, revision = repo_rev.partition("@")
    for part in (org, repo):
        if not _REPO_PART.match(part) or ".." in part:
            raise UnsafePath(name=url, reason=f"invalid repository part {part!r}")
    revision = revision or "main"
    if not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]*$", revision):
        raise UnsafePath(name=url, reason=f"invalid revision {revision!r}")
    path = "/".join(parts[2:]) or None
    return HfRef(f"{org}/{repo}", revision, check_relative(path) if path else None)


def _hub_cache() -> str:
    # Read at call time: huggingface_hub reads its environment once, at import.
    env = os.environ.get("HF_HUB_CACHE")
    if env:
        return env
    home = os.environ.get("HF_HOME")
    if home:
        return str(Path(home) / "hub")
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


class HfCacheSource(FileSource):
    """A snapshot directory of the local Hugging Face cache; versions are commit hashes."""

    def __init__(self, snapshot: Path, ref: HfRef) -> None:
        super().__init__(snapshot)
        self.commit = snapshot.name
        self.revision = ref.revision
        self.url = f"hf://{ref.repo_id}@{ref.revision}"
        self.namespace = "models--" + ref.repo_id.replace("/", "--")

    def stat(self, name: str) -> ObjectInfo:
        path = self._path(name)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise WeightsNotFound("not in the local cache", url=self.describe(name)) from None
        # LFS blobs in the Hugging Face cache are named by their sha256.
        blob = os.path.basename(os.path.realpath(path))
        sha = blob if SHA256_HEX.match(blob) else None
        return ObjectInfo(name, st.st_size, self.commit, sha256=sha, check=file_version(st))


def open_hf(url: str) -> tuple[WeightSource, str | None]:
    """Open ``url`` as a source and return it with the file the URL names, if any.

    Raises:
        WeightsNotFound: the revision is not in the local cache.
        UnsafePath: the URL is malformed.
    """
    ref = parse_hf_url(url)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snapshot = snapshot_download(ref.repo_id, local_files_only=True, revision=ref.revision,
                                     cache_dir=_hub_cache())
    except LocalEntryNotFoundError:
        raise WeightsNotFound(
            "not in the local Hugging Face cache, and Ember reads hf:// offline only (it never "
            "downloads from a hub at run time): fill the cache first, e.g. with "
            "huggingface-cli download", url=url
        ) from None
    return HfCacheSource(Path(snapshot), ref), ref.path
