"""``structured_ratio`` for ``bench/llm.py``: tokens/s with a JSON schema over without.

The same engine, model and seeded requests (closed loop, 16 clients, greedy), each request
forced to its drawn ``max_tokens`` both ways (the model's EOS is ignored; the schema cannot
be complete before 64 array items, more than any request's tokens, so no structured request
ends early: the token counts of the two runs are checked equal). The schema's output keeps
the mask changing: strings of at most 12 characters, each closed, a comma, a new one. The
grammar goes through the routes' own compile (``grammar_of``). The two runs alternate in
ABBA order, ``rounds`` of each, kept short (``max_tokens`` capped at 32) so that the two runs
of a round see the same load on a shared machine; the ratio is the median of the per-round
ratios. Tokens per CPU-second (the process's, all threads) is recorded beside it: it moves
less than wall time when other work shares the machine.

Run alone with ``.venv/bin/python bench/llm.py --only structured [--short]``, which writes
``bench/results/llm_structured[.short].json``.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable, Coroutine
from typing import Any

from ember.edge.protocols.openai_structured import ResponseFormat, grammar_of

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"words": {"type": "array", "minItems": 64,
                             "items": {"type": "string", "maxLength": 12}}},
    "required": ["words"], "additionalProperties": False}
#: Ember's goal: a schema costs at most 15% of tokens/s.
TARGET = 0.85

Run = Callable[..., Coroutine[Any, Any, dict[str, Any]]]


def grammar() -> str:
    """The benchmark schema through the routes' compile."""
    fmt = ResponseFormat.model_validate({"type": "json_schema", "json_schema": {
        "name": "words", "schema": SCHEMA, "strict": True}})
    compiled = grammar_of(fmt)
    assert compiled is not None
    return compiled


def _timed(backend: Any, work: list[tuple[str, int]], concurrency: int, run: Run,
           params: dict[str, Any] | None) -> dict[str, Any]:
    cpu = time.process_time()
    result = asyncio.run(run(backend, work, concurrency, params=params))
    result["cpu_s"] = time.process_time() - cpu
    result["tokens_per_cpu_s"] = result["tokens"] / result["cpu_s"]
    return result


def _ratios(runs: dict[str, list[dict[str, Any]]], key: str) -> dict[str, Any]:
    rounds = [s[key] / p[key] for s, p in zip(runs["structured"], runs["plain"], strict=True)]
    return {"median": statistics.median(rounds), "rounds": rounds}


def measure(backend: Any, work: list[tuple[str, int]], rounds: int, run: Run,
            concurrency: int = 16, cap_tokens: int = 32) -> dict[str, Any]:
    """``rounds`` ABBA pairs of plain and structured runs of ``work``; their ratio."""
    from ember.deployments._textgen_grammar import tokenizer_for

    tokenizer_for(backend)  # built once per replica, at warm-up: not a per-request cost
    compiled = grammar()
    work = [(prompt, min(length, cap_tokens)) for prompt, length in work]
    runs: dict[str, list[dict[str, Any]]] = {"plain": [], "structured": []}
    for i in range(rounds):
        order = ["plain", "structured"] if i % 2 == 0 else ["structured", "plain"]
        for kind in order:
            params = {"grammar": compiled} if kind == "structured" else None
            runs[kind].append(_timed(backend, work, concurrency, run, params))
            print(f"round {i} {kind}: {runs[kind][-1]['tokens_per_s']:.1f} tokens/s, "
                  f"{runs[kind][-1]['tokens_per_cpu_s']:.1f} per CPU-s", flush=True)
    wall, cpu = _ratios(runs, "tokens_per_s"), _ratios(runs, "tokens_per_cpu_s")
    return {"structured_ratio": wall["median"], "rounds": wall["rounds"],
            "cpu_ratio": cpu, "target": TARGET, "meets_target": wall["median"] >= TARGET,
            "same_tokens": all(s["tokens"] == p["tokens"] for s, p in
                               zip(runs["structured"], runs["plain"], strict=True)),
            "concurrency": concurrency, "cap_tokens": cap_tokens, "schema": SCHEMA,
            "runs": runs}

