"""Continuous (iteration-level) batching for token generation, as in Orca, vLLM and TGI.

One asyncio task runs the schedule. At every step it drops the sequences whose caller went
away, admits waiting sequences while there is a free slot (``max_num_seqs``) and room in the
token budget (``max_num_batched_tokens``: every running sequence reserves its prompt plus
``max_tokens``, so the preallocated cache can never overflow), prefills the new ones and runs
one batched decode step for the others, then hands each sequence its token through its own
queue. A finished sequence leaves at once and its slot is taken at the next step.

``mode="static"`` is the baseline the benchmark compares against: a batch is admitted only
when the previous one is done (after ``static_wait_s`` or once ``max_num_seqs`` wait), and it
runs until its longest sequence ends; the finished ones keep their slots and are still
computed, as a padded batch is. ``max_num_seqs=1`` is one request at a time.

Admission is decided before any work: a request that can never fit is a ``BadRequest``
(400) naming the field, one that arrives while ``max_waiting_seqs`` wait is ``QueueFull``
(503 with Retry-After).

Example:
    >>> engine = Engine(backend, EngineConfig(max_num_seqs=8))  # doctest: +SKIP
    >>> async for chunk in engine.generate(backend.encode("Hello"), SamplingParams()):
    ...     print(chunk.text, end="")  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, NonNegativeInt, PositiveInt

from ember.deployments._textgen_backend import Backend, Detokenizer
from ember.deployments._textgen_sampling import SamplingParams, StopText, generator_for, sample
from ember.errors import BadRequest, QueueFull

FinishReason = Literal["stop", "length"]


class EngineConfig(BaseModel):
    """Limits of one engine (one replica)."""

    model_config = ConfigDict(frozen=True)
    max_num_seqs: PositiveInt = 16
    #: Tokens (prompt + max_tokens) all running sequences may reserve together.
    max_num_batched_tokens: PositiveInt = 8192
    #: Requests that may wait for a slot; one more is refused with 503 at once.
    max_waiting_seqs: NonNegativeInt = 64
    mode: Literal["continuous", "static"] = "continuous"
    static_wait_s: NonNegativeFloat = 0.05
    name: str = Field("textgen", description="The deployment named in errors.")


@dataclass(frozen=True)
class Need:
    """What a waiting sequence asks of the schedule."""

    prompt_tokens: int
    max_tokens: int

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.max_tokens


def admit_count(waiting: Sequence[Need], *, running: int, reserved: int, config: EngineConfig,
                max_len: int, oldest_wait_s: float) -> int:
    """How many sequences from the head of ``waiting`` join the batch at this step.

    First come, first served: the head is never overtaken, so a long request cannot starve.

    Example:
        >>> cfg = EngineConfig(max_num_seqs=2, max_num_batched_tokens=100)
        >>> admit_count([Need(10, 40)] * 3, running=0, reserved=0, config=cfg, max_len=512,
        ...             oldest_wait_s=0)
        2
    """
    if config.mode == "static":
        ready = len(waiting) >= config.max_num_seqs or oldest_wait_s >= config.static_wait_s
        if running or not ready:
            return 0
    count, longest_prompt, longest_output = 0, 0, 0
    for need in waiting:
        if running + count >= config.max_num_seqs:
            break
        if reserved + need.tokens > config.max_num_batched_tokens:
            break
        if config.mode == "static":
            # Every member of a static batch runs as long as its longest one.
            longest_prompt = max(longest_prompt, need.prompt_tokens)
            longest_output = max(longest_output, need.max_tokens)
            if longest_prompt + longest_output > max_len:
                break
        reserved += need.tokens
        count += 1
    return count


@dataclass
class Chunk:
    """One step's output for one sequence."""

    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    #: Prompt tokens found in the replica's prefix cache (not computed again).
    cached_tokens: int
    #: The engine's state when the chunk left: for the edge's gauges.
    running: int
    waiting: int


def _ready(queue: asyncio.Queue[Any]) -> list[Any]:
    """What is already waiting in ``queue``, without waiting."""
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


def _join(chunks: list[Chunk]) -> Chunk:
    """Chunks that piled up while the caller was busy sending, as one chunk.

    A consumer that keeps up gets one chunk per step; one that falls behind (a transport
    that pays per message, as a stream through Ray and HTTP does) gets every token that
    waited in one message instead of falling further behind: vLLM's stream interval, made
    adaptive.
    """
    if len(chunks) == 1:
        return chunks[0]
    last = chunks[-1]
    return dataclasses.replace(last, text="".join(c.text for c in chunks),
                               token_ids=[t for c in chunks for t in c.token_ids])


def _adapters(rows: list[_Seq]) -> dict[str, Any]:
    """``adapters=`` for a decode step, only when a row has one: base-only steps call the
    backend as before, so a backend without adapters never sees the argument."""
    names = [s.adapter for s in rows]
    return {"adapters": names} if any(names) else {}


def _adapter(seq: _Seq) -> dict[str, Any]:
    """``adapter=`` for one prefill, only when the sequence has one."""
    return {"adapter": seq.adapter} if seq.adapter else {}


@dataclass(eq=False)
class _Seq:
    prompt: list[int]
    params: SamplingParams
    detok: Detokenizer
    generator: torch.Generator
    queue: asyncio.Queue[Chunk | BaseException] = field(default_factory=asyncio.Queue)
    arrived: float = field(default_factory=time.monotonic)
    tokens: list[int] = field(default_factory=list)
    stop_text: StopText = field(default_factory=lambda: StopText(()))
    slot: int = -1
    cached: int = 0
    new: list[int] = field(default_factory=list)
    finish: FinishReason | None = None
    cancelled: bool = False
    done: bool = False  # finished and told; in static mode it may still pad its batch
    #: The LoRA adapter the sequence runs with (None: the base model).
    adapter: str | None = None

    @property
    def need(self) -> Need:
        return Need(len(self.prompt), self.params.max_tokens)

    def take(self, token: int, eos: int | None) -> None:
        """Record this step's token and whether the sequence is finished."""
        if self.done:
            return
        self.new.append(token)
        self.tokens.append(token)
        if token == eos and not self.params.ignore_eos:
            self.finish = "stop"
            return
        self.stop_text.add(self.detok.push(token))
        if self.stop_text.stopped:
            self.finish = "stop"
        elif len(self.tokens) >= self.params.max_tokens:
            self.finish = "length"


class Engine:
    """Schedules many sequences onto one :class:`Backend`, one step at a time."""

    def __init__(self, backend: Backend, config: EngineConfig | None = None) -> None:
        self.backend = backend
        self.config = config or EngineConfig()
        backend.allocate(self.config.max_num_seqs)
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []  # running[i] holds slot i
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        #: Decode steps run so far (tests check that a disconnect frees a slot in one).
        self.steps = 0

    @property
    def running(self) -> int:
        return sum(not s.done for s in self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def slots_used(self) -> int:
        return len(self._running)

    async def generate(self, prompt: list[int], params: SamplingParams, *,
                       adapter: str | None = None) -> AsyncIterator[Chunk]:
        """Stream one sequence's chunks; closing the iterator cancels the sequence.

        ``adapter`` names a LoRA adapter the backend holds (the caller keeps it loaded).

        Raises:
            BadRequest: the prompt plus ``max_tokens`` can never fit.
            QueueFull: ``max_waiting_seqs`` requests already wait.
        """
        seq = self._submit(prompt, params)
        seq.adapter = adapter
        try:
            while True:
                items = [await seq.queue.get(), *_ready(seq.queue)]
                chunks = [i for i in items if not isinstance(i, BaseException)]
                if chunks:  # tokens that came before an error still reach the caller
                    merged = _join(chunks)
                    yield merged
                    if merged.finish_reason is not None:
                        return
                for item in items:
                    if isinstance(item, BaseException):
                        raise item
        finally:
            if seq.finish is None:  # the caller left early: free the slot at the next step
                seq.cancelled = True
                self._wake.set()

    def _submit(self, prompt: list[int], params: SamplingParams) -> _Seq:
        need = Need(len(prompt), params.max_tokens)
        limit = min(self.backend.max_len, self.config.max_num_batched_tokens)
        if need.tokens > limit:
            raise BadRequest(f"the prompt ({need.prompt_tokens} tokens) plus max_tokens "
                             f"({need.max_tokens}) is over this model's limit of {limit} tokens",
                             param="max_tokens")
        # Sequences that a free slot takes at the next step are not waiting for one.
        free = max(0, self.config.max_num_seqs - len(self._running))
        if len(self._waiting) >= self.config.max_waiting_seqs + free:
            raise QueueFull(deployment=self.config.name, queued=len(self._waiting),
                            limit=self.config.max_waiting_seqs)
        seq = _Seq(prompt, params, self.backend.detokenizer(), generator_for(params.seed),
                   stop_text=StopText(params.stop))
        self._waiting.append(seq)
        self._ensure_loop()
        self._wake.set()
        return seq

    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def close(self) -> None:
        """Stop the schedule; sequences still running get no more chunks."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        while True:
            self._drop_cancelled()
            if not self._running and not self._waiting:
                self._wake.clear()
                await self._wake.wait()
                continue
            fresh = self._admit()
            if not self._running:  # static mode gathering a batch
                await asyncio.sleep(self.config.static_wait_s / 4)
                continue
            try:
                await asyncio.to_thread(self._step, len(self._running) - len(fresh), fresh)
                self.steps += 1
                self._deliver()
            except Exception as exc:  # a failed step fails its sequences, not the replica
                self._fail_running(exc)

    def _drop_cancelled(self) -> None:
        self._waiting = deque(s for s in self._waiting if not s.cancelled)
        for seq in [s for s in self._running if s.cancelled and not s.done]:
            seq.done = True
            if self.config.mode == "continuous":
                self._release(seq)

    def _admit(self) -> list[_Seq]:
        oldest = time.monotonic() - self._waiting[0].arrived if self._waiting else 0.0
        count = admit_count([s.need for s in self._waiting], running=len(self._running),
                            reserved=sum(s.need.tokens for s in self._running),
                            config=self.config, max_len=self.backend.max_len,
                            oldest_wait_s=oldest)
        fresh = [self._waiting.popleft() for _ in range(count)]
        for seq in fresh:
            seq.slot = len(self._running)
            self._running.append(seq)
        return fresh

    def _step(self, decoding: int, fresh: list[_Seq]) -> None:
        """One model step (in a worker thread): decode slots ``0..decoding-1``, prefill the rest."""
        eos = self.backend.eos_token_id
        if decoding:
            old = self._running[:decoding]
            last = [s.tokens[-1] for s in old]
            logits = self.backend.decode(list(range(decoding)), last, **_adapters(old))
            # One argmax for the whole batch; only sampled rows go one by one.
            greedy = logits.argmax(dim=-1).tolist()
            for i, seq in enumerate(old):
                sampled = seq.params.temperature > 0
                seq.take(sample(logits[i], seq.params, seq.generator) if sampled
                         else greedy[i], eos)
        for seq in fresh:
            logits = self.backend.prefill(seq.slot, seq.prompt, **_adapter(seq))
            seq.cached = self.backend.cached_tokens
            seq.take(sample(logits, seq.params, seq.generator), eos)

    def _deliver(self) -> None:
        finished = [s for s in self._running if s.finish is not None and not s.done]
        for seq in finished:
            seq.done = True
            if self.config.mode == "continuous":
                self._release(seq)
        if self.config.mode == "static" and all(s.done for s in self._running):
            for seq in list(self._running):
                self._release(seq)
        running, waiting = self.running, self.waiting
        for seq in self._running + finished:
            if seq.new:
                self._send(seq, running, waiting)

    def _send(self, seq: _Seq, running: int, waiting: int) -> None:
        if seq.cancelled:
            seq.new.clear()
            return
        final = seq.finish is not None
        seq.queue.put_nowait(Chunk(
            text=seq.stop_text.release(final=final), token_ids=seq.new, finish_reason=seq.finish,
            prompt_tokens=len(seq.prompt), completion_tokens=len(seq.tokens),
            cached_tokens=seq.cached, running=running, waiting=waiting))
        seq.new = []

    def _release(self, seq: _Seq) -> None:
        """Free ``seq``'s slot; the last running sequence moves into it (slots stay 0..B-1)."""
        last = len(self._running) - 1
        slot = self._running.index(seq)
        if slot != last:
            self.backend.move(last, slot)
            self._running[slot] = self._running[last]
            self._running[slot].slot = slot
        self._running.pop()
        self.backend.free(last)

    def _fail_running(self, exc: Exception) -> None:
        for slot, seq in enumerate(self._running):
            seq.queue.put_nowait(exc)
            seq.finish, seq.done = seq.finish or "stop", True
            with contextlib.suppress(Exception):  # the backend may be what failed
                self.backend.free(slot)
        self._running.clear()
