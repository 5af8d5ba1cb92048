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
(503 with Retry-After). Which waiting request goes next (priorities, aging, backfill,
deadlines) is ``_textgen_admission.plan``; a request past its deadline is answered with
``DeadlineExceeded`` (504), before its prefill if it still waits, or stopped with its slot
freed if it runs. A request for ``n`` choices is prefilled once; the other choices copy the
prompt's cache into their own slots (``Backend.fork``) and sample on their own. A grammar
that does not compile is a ``BadRequest`` too (naming ``response_format``).

A sequence with a grammar (``SamplingParams.grammar``) carries its own constraint
(``_textgen_grammar``): its row of the step's logits is masked before the token is chosen,
and the chosen token advances it. With ``SamplingParams.logprobs`` each token's log-probability
under the distribution it was drawn from rides on its chunk (``_textgen_logprobs``).

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
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ember.deployments._textgen_admission import EngineConfig, Need, Waiting, plan
from ember.deployments._textgen_backend import Backend, Detokenizer
from ember.deployments._textgen_grammar import Constraint, constrain, constraint_for
from ember.deployments._textgen_logprobs import TokenLogprob, logprob_of
from ember.deployments._textgen_sampling import SamplingParams, StopText, generator_for, sample
from ember.errors import BadRequest, DeadlineExceeded, QueueFull

__all__ = ["Chunk", "Engine", "EngineConfig", "Need"]

FinishReason = Literal["stop", "length"]


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
    #: Which of the request's ``n`` choices this chunk belongs to.
    index: int = 0
    #: One entry per token of ``token_ids`` when the request asked for logprobs.
    logprobs: list[TokenLogprob] = field(default_factory=list)


def _ready(queue: asyncio.Queue[Any]) -> list[Any]:
    """What is already waiting in ``queue``, without waiting."""
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


def _join(chunks: list[Chunk]) -> list[Chunk]:
    """Chunks that piled up while the caller was busy sending, one per choice.

    A consumer that keeps up gets one chunk per step; one that falls behind (a transport
    that pays per message, as a stream through Ray and HTTP does) gets every token that
    waited in one message instead of falling further behind: vLLM's stream interval, made
    adaptive.
    """
    by_index: dict[int, list[Chunk]] = {}
    for chunk in chunks:
        by_index.setdefault(chunk.index, []).append(chunk)
    return [_merge(group) for group in by_index.values()]


def _merge(chunks: list[Chunk]) -> Chunk:
    if len(chunks) == 1:
        return chunks[0]
    last = chunks[-1]
    return dataclasses.replace(last, text="".join(c.text for c in chunks),
                               token_ids=[t for c in chunks for t in c.token_ids],
                               logprobs=[e for c in chunks for e in c.logprobs])


def _adapters(rows: list[_Seq]) -> dict[str, Any]:
    """``adapters=`` for a step's rows, only when a row has one: base-only steps call the
    backend as before, so a backend without adapters never sees the argument."""
    names = [s.adapter for s in rows]
    return {"adapters": names} if any(names) else {}


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
    index: int = 0
    priority: int = 0
    timeout_s: float | None = None
    blocked_since: float | None = None
    #: The request's other choices: they wait with it and copy its prompt's cache.
    forks: list[_Seq] = field(default_factory=list)
    constraint: Constraint | None = None  # the grammar its tokens must follow
    logprobs: list[TokenLogprob] = field(default_factory=list)  # for the next chunk
    #: The LoRA adapter the sequence runs with (None: the base model).
    adapter: str | None = None

    @property
    def need(self) -> Need:
        return Need(len(self.prompt), self.params.max_tokens, 1 + len(self.forks))

    @property
    def deadline(self) -> float | None:
        return None if self.timeout_s is None else self.arrived + self.timeout_s

    def waiting(self) -> Waiting:
        return Waiting(self.need, self.priority, self.arrived, self.deadline,
                       self.blocked_since)

    def expired(self) -> DeadlineExceeded:
        """The 504 for this request, saying whether anything was computed."""
        when = ("while it waited for a slot; nothing was computed" if self.slot < 0 else
                f"while it ran, after {len(self.tokens)} tokens; it was stopped")
        return DeadlineExceeded(timeout_s=self.timeout_s, when=when)

    def take(self, token: int, eos: int | None, logits: torch.Tensor | None = None) -> None:
        """Record this step's token (chosen from ``logits``) and whether the sequence is
        finished."""
        if self.done:
            return
        self.new.append(token)
        self.tokens.append(token)
        if logits is not None and self.params.logprobs is not None:
            self.logprobs.append(logprob_of(logits, token, self.params, self.params.logprobs))
        complete = self.constraint is not None and self.constraint.advance(token)
        if token == eos and not self.params.ignore_eos:
            self.finish = "stop"
            return
        self.stop_text.add(self.detok.push(token))
        if self.stop_text.stopped or complete:
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

    async def generate(self, prompt: list[int], params: SamplingParams, *, n: int = 1,
                       priority: int = 0, timeout_s: float | None = None,
                       adapter: str | None = None) -> AsyncIterator[Chunk]:
        """Stream the chunks of ``n`` choices (each chunk says its ``index``); closing the
        iterator cancels them.

        Args:
            priority: higher goes first (see ``_textgen_admission``).
            timeout_s: the request's deadline, counted from now.
            adapter: the LoRA adapter every choice runs with (None: the base model).

        ``adapter`` names a LoRA adapter the backend holds (the caller keeps it loaded).

        Raises:
            BadRequest: the prompt plus ``max_tokens`` (times ``n``) can never fit, or the
                grammar does not compile for this model's tokenizer.
            QueueFull: ``max_waiting_seqs`` requests already wait.
            DeadlineExceeded: ``timeout_s`` passed, waiting or running.
        """
        group = self._submit(prompt, params, n=n, priority=priority, timeout_s=timeout_s)
        for seq in group:
            seq.adapter = adapter
        head, open_choices = group[0], n
        try:
            while open_choices:
                items = [await self._next(head), *_ready(head.queue)]
                # Tokens that came before an error still reach the caller.
                for merged in _join([i for i in items if not isinstance(i, BaseException)]):
                    yield merged
                    open_choices -= merged.finish_reason is not None
                for item in items:
                    if open_choices and isinstance(item, BaseException):
                        raise item
        finally:
            if any(s.finish is None for s in group):  # left early: free the slots now
                for seq in group:
                    seq.cancelled = True
                self._wake.set()

    async def _next(self, head: _Seq) -> Chunk | BaseException:
        """The group's next item, or its 504 the moment its deadline passes."""
        if head.deadline is None or not head.queue.empty():
            return await head.queue.get()
        try:
            return await asyncio.wait_for(head.queue.get(), head.deadline - time.monotonic())
        except TimeoutError:
            return head.expired()

    def room(self, prompt_tokens: int, n: int = 1) -> int:
        """The most ``max_tokens`` a prompt of ``prompt_tokens`` may ask for (``n`` choices)."""
        limit = min(self.backend.max_len, self.config.max_num_batched_tokens // n)
        return limit - prompt_tokens

    def _check(self, need: Need) -> None:
        """400 naming the field, for a request that can never be admitted."""
        if need.n > self.config.max_num_seqs:
            raise BadRequest(f"n: {need.n} choices are over this deployment's limit of "
                             f"{self.config.max_num_seqs}", param="n")
        room = self.room(need.prompt_tokens, need.n)
        if need.max_tokens > room:
            limit = room + need.prompt_tokens
            per = f" for each of {need.n} choices" if need.n > 1 else ""
            raise BadRequest(f"max_tokens: the prompt ({need.prompt_tokens} tokens) plus "
                             f"max_tokens ({need.max_tokens}) is over this model's limit of "
                             f"{limit} tokens{per}", param="max_tokens")

    def _submit(self, prompt: list[int], params: SamplingParams, *, n: int, priority: int,
                timeout_s: float | None) -> list[_Seq]:
        self._check(Need(len(prompt), params.max_tokens, n))
        # Sequences that a free slot takes at the next step are not waiting for one.
        free = max(0, self.config.max_num_seqs - len(self._running))
        if len(self._waiting) >= self.config.max_waiting_seqs + free:
            raise QueueFull(deployment=self.config.name, queued=len(self._waiting),
                            limit=self.config.max_waiting_seqs)
        # Seeded choices differ from each other, each still reproducible; each choice follows
        # the grammar with a constraint of its own.
        group = [_Seq(prompt, params, self.backend.detokenizer(),
                      generator_for(None if params.seed is None else params.seed + i),
                      stop_text=StopText(params.stop), index=i, priority=priority,
                      timeout_s=timeout_s,
                      constraint=constraint_for(self.backend, params.grammar))
                 for i in range(n)]
        for fork in group[1:]:
            fork.queue, fork.arrived = group[0].queue, group[0].arrived
        group[0].forks = group[1:]
        self._waiting.append(group[0])
        self._ensure_loop()
        self._wake.set()
        return group

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
            try:  # a request's other choices are not prefilled: they fork from its prompt
                await asyncio.to_thread(self._step, len(self._running) - len(fresh),
                                        [s for s in fresh if s.index == 0])
                self.steps += 1
                self._deliver()
            except Exception as exc:  # a failed step fails its sequences, not the replica
                self._fail_running(exc)

    def _drop_cancelled(self) -> None:
        now = time.monotonic()
        for seq in self._running:  # past its deadline: told (504) and stopped like a leaver
            if seq.deadline is not None and seq.deadline <= now and not seq.done:
                seq.queue.put_nowait(seq.expired())
                seq.cancelled = True
        self._waiting = deque(s for s in self._waiting if not s.cancelled)
        for seq in [s for s in self._running if s.cancelled and not s.done]:
            seq.done = True
            if self.config.mode == "continuous":
                self._release(seq)

    def _admit(self) -> list[_Seq]:
        now = time.monotonic()
        waiting = list(self._waiting)
        decision = plan([s.waiting() for s in waiting], running=len(self._running),
                        reserved=sum(len(s.prompt) + s.params.max_tokens
                                     for s in self._running),
                        config=self.config, max_len=self.backend.max_len, now_s=now,
                        oldest_wait_s=now - min((s.arrived for s in waiting), default=now))
        for i in decision.expire:  # never prefilled: nothing was computed for it
            waiting[i].queue.put_nowait(waiting[i].expired())
        if decision.blocked is not None and waiting[decision.blocked].blocked_since is None:
            waiting[decision.blocked].blocked_since = now
        fresh = [seq for i in decision.admit for seq in (waiting[i], *waiting[i].forks)]
        for seq in fresh:
            seq.slot = len(self._running)
            self._running.append(seq)
        gone = {*decision.admit, *decision.expire}
        self._waiting = deque(s for i, s in enumerate(waiting) if i not in gone)
        return fresh

    def _step(self, decoding: int, fresh: list[_Seq]) -> None:
        """One model step (in a worker thread): decode slots ``0..decoding-1``, prefill the rest."""
        eos = self.backend.eos_token_id
        if decoding:
            old = self._running[:decoding]
            last = [s.tokens[-1] for s in old]
            logits = self.backend.decode(list(range(decoding)), last, **_adapters(old))
            logits = constrain(logits, [s.constraint for s in old])
            # One argmax for the whole batch; only sampled rows go one by one.
            greedy = logits.argmax(dim=-1).tolist()
            for i, seq in enumerate(old):
                sampled = seq.params.temperature > 0
                seq.take(sample(logits[i], seq.params, seq.generator) if sampled
                         else greedy[i], eos, logits[i])
        if fresh:  # every prompt admitted at this step in as few forwards as the backend can
            done = self.backend.prefill_many([s.slot for s in fresh], [s.prompt for s in fresh],
                                             **_adapters(fresh))
            for seq, (logits, cached) in zip(fresh, done, strict=True):
                self._started(seq, logits, cached, eos)

    def _started(self, seq: _Seq, logits: torch.Tensor, cached: int, eos: int | None) -> None:
        """A prefilled prompt's first token; its other choices copy its cache, then sample."""
        for choice in (seq, *seq.forks):
            if choice is not seq:
                self.backend.fork(seq.slot, choice.slot)
            choice.cached = cached
            masked = constrain(logits.unsqueeze(0), [choice.constraint])[0]
            choice.take(sample(masked, choice.params, choice.generator), eos, masked)

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
            cached_tokens=seq.cached, running=running, waiting=waiting, index=seq.index,
            logprobs=seq.logprobs))
        seq.new, seq.logprobs = [], []

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
