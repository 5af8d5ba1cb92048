"""One file through the tiers: node hit, or a single-flight fill from regional or origin."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ember.errors import IntegrityError
from ember.loaders._config import LoaderConfig
from ember.loaders._copy import FileCopy
from ember.loaders._flight import FillTicket, claim
from ember.loaders._header import Header, TensorSpec
from ember.loaders._reader import Progress, StreamingReader
from ember.loaders._source import ObjectInfo, WeightSource
from ember.loaders._source_file import FileSource
from ember.loaders._tier import BlobKey, BlobRecord
from ember.loaders._tier_node import NodeHit, NodeTier, TempBlob
from ember.loaders._tier_regional import RegionalTier
from ember.loaders._writebehind import CacheSeal, CacheWrite, done, seal, submit

log = logging.getLogger("ember.loaders")


def regional_tier(config: LoaderConfig) -> RegionalTier | None:
    """The configured regional tier, if any."""
    url = config.regional_url()
    if not url:
        return None
    return RegionalTier(url, dict(config.regional_storage_options),
                        max_connections=config.max_concurrency)


class Fill:
    """Streams one file from the next tier into memory and into the node cache.

    Args:
        node: the node tier to fill.
        source: the origin.
        info: the origin object's size and version.
        key: the blob key.
        ticket: the single-flight ticket for ``key``.
        progress: optional ``(bytes_done, bytes_total)`` callback.
        behind: publish after the load (``_writebehind``) instead of writing through.
        seal_behind: write through, but leave the checksum (unless the origin publishes
            one, which is verified in the read), the fsync and the publication to
            :meth:`publish`; :attr:`filled` is the complete temp file once :meth:`run` is
            done, a path that stays valid only until :meth:`publish` is called.

    After :meth:`run` is exhausted, :attr:`hit` is the published blob (write-through), or
    :meth:`publish` queues the write (or the seal) and returns the future of the blob.
    """

    def __init__(
        self,
        node: NodeTier,
        source: WeightSource,
        info: ObjectInfo,
        key: BlobKey,
        ticket: FillTicket,
        progress: Progress | None = None,
        *,
        behind: bool = False,
        seal_behind: bool = False,
    ) -> None:
        self.node, self.source, self.info, self.key = node, source, info, key
        self.ticket = ticket
        self.progress = progress
        self.behind = behind
        self.seal_behind = seal_behind and not behind
        self._job: CacheWrite | None = None
        self._seal: CacheSeal | None = None
        self.filled: Path | None = None
        self._published: Future[NodeHit | None] | None = None
        self._tmp: TempBlob | None = None
        self.regional = regional_tier(node.config)
        self.hit: NodeHit | None = None
        self.reader: StreamingReader | FileCopy | None = None
        self._from_regional = False
        self._regional_sha = ""

    def _open_reader(self) -> StreamingReader | FileCopy:
        source, info = self.source, self.info
        if self.regional is not None:
            record = self._regional_record(self.regional)
            if record is not None:
                source, info = self.regional.source_for(self.key, record)
                self._from_regional, self._regional_sha = True, record.sha256
        # Write-behind hashes in the cache write, unless there is a checksum to verify
        # before anyone uses the tensors.
        hash_now = not (self.behind or self.seal_behind) or bool(info.sha256)
        if self.seal_behind and not hash_now and isinstance(source, FileSource):
            # The load maps the temp file: the kernel copies into it, no buffer here.
            return FileCopy(source, info, self.node.config, self.progress)
        return StreamingReader(source, info, self.node.config, progress=self.progress,
                               hash_bytes=hash_now)

    def _regional_record(self, regional: RegionalTier) -> BlobRecord | None:
        try:
            record = regional.lookup(self.key)
        except OSError as exc:  # an unreachable regional tier degrades to the origin
            log.warning("regional cache %s unavailable: %s", regional.location, exc)
            return None
        return record if record is not None and record.size == self.info.size else None

    @property
    def tier(self) -> str:
        """Where the bytes come from: ``"regional"`` or ``"origin"`` (once :meth:`run` began)."""
        return "regional" if self._from_regional else "origin"

    @property
    def header(self) -> Header:
        """The validated header (available once :meth:`run` has started)."""
        if self.reader is None:
            raise RuntimeError("Fill.run() has not started")
        return self.reader.header

    def start(self, pool: ThreadPoolExecutor | None = None) -> None:
        """Read and check the header, allocate the buffer and queue the range reads.

        Raises:
            WeightsError: as for :meth:`run` (the ticket is finished with the error).
        """
        if self.reader is not None:
            return
        try:
            self.reader = reader = self._open_reader()
            if not self.behind:
                self._tmp = self.node.begin_fill(self.key, self.info.size)
                if isinstance(reader, FileCopy):
                    reader.attach_file(self._tmp)
                else:
                    reader.attach_sink(self._tmp.write_at)
            reader.start(pool)
        except BaseException as exc:
            self._failed(exc)
            raise

    @property
    def read(self) -> bool:
        """Whether :meth:`run` read and checked every byte."""
        return self.hit is not None or self.filled is not None or self._published is not None \
            or self._job is not None

    def abandon(self) -> None:
        """Give up a started fill that will not be run: no reads left, no temp file."""
        if self.reader is not None:
            self.reader.cancel()
        self._failed(None)

    def _failed(self, exc: BaseException | None) -> None:
        if self._tmp is not None:
            self._tmp.discard()
        if isinstance(exc, IntegrityError) and self._regional_sha and self.regional:
            # The regional blob is named by its SHA-256, whichever checksum caught it.
            self.regional.remove(self.key.namespace, self._regional_sha)
        self.ticket.finish(exc, published=False)

    def run(self) -> Iterator[TensorSpec]:
        """Yield tensor specs as their bytes arrive; publish the blob (or queue its write).

        Raises:
            WeightsError: the read, the verification or the cache write failed; every
                process waiting on this fill receives the same error.
        """
        self.start()
        reader = self.reader
        assert reader is not None  # set by start()
        try:
            yield from reader.run()
            if self.behind:  # the job owns the ticket from here
                assert isinstance(reader, StreamingReader)  # only a seal-behind fill copies
                self._job = CacheWrite(self.node, self.key, reader.info, reader.buffer,
                                       reader.sha256, self.ticket, self._after_publish())
                return
            assert self._tmp is not None
            record = BlobRecord(reader.sha256, self.info.size)
            if self.seal_behind:  # the seal owns the ticket and the temp file from here
                tmp, self._tmp = self._tmp, None
                self.filled = tmp.path
                self._seal = CacheSeal(self.node, self.key, tmp, record, self.ticket,
                                       self._after_publish())
                return
            self.hit = self.node.commit(self.key, self._tmp, record)
        except BaseException as exc:
            self._failed(exc)
            raise
        self.ticket.finish()
        self._after_publish()(self.hit)

    def release_buffer(self) -> None:
        """Drop the reader (and its whole-file buffer) once :meth:`run` is done with it;
        :meth:`publish` needs only what ``run`` kept (the blob, the write or the seal)."""
        if self.read:
            self.reader = None

    def publish(self) -> Future[NodeHit | None]:
        """The published blob: queue the write-behind of a finished fill (once).

        The load queues its files' writes only once it has every byte: on two cores a
        write running beside the reads would slow them.
        """
        if self._job is not None:
            job, self._job = self._job, None
            self._published = submit(job)
        if self._seal is not None:
            sealing, self._seal = self._seal, None
            self._published = seal(sealing)
        if self._published is None:
            self._published = done(self.hit)
        return self._published

    def _after_publish(self) -> _AfterPublish:
        return _AfterPublish(self.node, self.key, self.source, self.regional,
                             self._from_regional)


@dataclass(frozen=True)
class _AfterPublish:
    """What follows a blob's publication: the branch's ref, the regional copy.

    Kept apart from :class:`Fill` so that a queued seal does not keep the fill's read
    buffer (the whole file, in anonymous memory) alive.
    """

    node: NodeTier
    key: BlobKey
    source: WeightSource
    regional: RegionalTier | None
    from_regional: bool

    def __call__(self, hit: NodeHit) -> None:
        commit = getattr(self.source, "commit", None)
        revision = getattr(self.source, "revision", None)
        if isinstance(commit, str) and isinstance(revision, str):
            self.node.write_ref(self.key.namespace, revision, commit)
        if self.regional is not None and not self.from_regional:
            try:
                self.regional.publish_file(self.key, hit.path, hit.record)
            except OSError as exc:  # the node copy is good; the region fills next time
                log.warning("could not publish to %s: %s", self.regional.location, exc)


def obtain(
    node: NodeTier,
    source: WeightSource,
    name: str,
    progress: Progress | None = None,
    *,
    behind: bool = False,
    seal_behind: bool = False,
) -> tuple[BlobKey, NodeHit | Fill]:
    """The key for ``name`` and either its node hit or a :class:`Fill` the caller must run.

    Raises:
        WeightsError: the origin cannot be read, or a fill this call waited on failed.
    """
    info = source.stat(name)
    key = BlobKey(source.namespace, info.version, name)
    outcome = claim(node, key)
    if isinstance(outcome, NodeHit):
        if progress is not None:
            progress(info.size, info.size)
        return key, outcome
    return key, Fill(node, source, info, key, outcome, progress, behind=behind,
                     seal_behind=seal_behind)
