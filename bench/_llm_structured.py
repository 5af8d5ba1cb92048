"""``structured_ratio`` for ``bench/llm.py``: tokens/s with a JSON schema over without.

The same engine, model and seeded requests (closed loop, 16 clients, greedy), each request
forced to its drawn ``max_tokens`` both ways (the model's EOS is ignored; the schema cannot
be complete before 64 array items, more than any request's tokens, so no structured request
ends early: the token counts of the two runs are checked equal). The schema's output keeps
the mask changing: strings of at most 12 characters, each closed, a comma, a new one. The
grammar goes through the routes' own compile (``grammar_of``). The two runs alternate in
ABBA order, ``rounds`` of each; the ratio is the median of the per-round ratios.

Run alone with ``.venv/bin/python bench/llm.py --only structured [--short]``, which writes
``bench/results/llm_structured[.short].json``.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable, Coroutine
from typing import Any

import _harness as h

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


def measure(backend: Any, work: list[tuple[str, int]], rounds: int, run: Run,
            concurrency: int = 16) -> dict[str, Any]:
    """``rounds`` ABBA pairs of plain and structured runs of ``work``; their ratio."""
    from ember.deployments._textgen_grammar import tokenizer_for

    tokenizer_for(backend)  # built once per replica, at warm-up: not a per-request cost
    compiled = grammar()
    runs: dict[str, list[dict[str, Any]]] = {"plain": [], "structured": []}
    for i in range(rounds):
        order = ["plain", "structured"] if i % 2 == 0 else ["structured", "plain"]
        for kind in order:
            params = {"grammar": compiled} if kind == "structured" else None
            runs[kind].append(asyncio.run(run(backend, work, concurrency, params=params)))
            print(f"round {i} {kind}: {runs[kind][-1]['tokens_per_s']:.1f} tokens/s",
                  flush=True)
    ratios = [s["tokens_per_s"] / p["tokens_per_s"]
              for s, p in zip(runs["structured"], runs["plain"], strict=True)]
    median = statistics.median(ratios)
    return {"structured_ratio": median, "rounds": ratios, "target": TARGET,
            "meets_target": median >= TARGET,
            "same_tokens": all(s["tokens"] == p["tokens"] for s, p in
                               zip(runs["structured"], runs["plain"], strict=True)),
            "concurrency": concurrency, "schema": SCHEMA, "runs": runs}


def run_alone(backend: Any, work: list[tuple[str, int]], args: Any, run: Run,
              base: dict[str, Any]) -> int:
    """``llm.py --only structured``: this measurement alone, in its own results file."""
    errors: list[str] = []
    out: dict[str, Any] = {}
    with h.deadline_run(args.deadline_s, errors):
        h.section("structured", errors,
                  lambda: out.update(measure(backend, work, max(args.rounds, 2), run)))
    print({"structured_ratio": out.get("structured_ratio")}, flush=True)
    h.write_results("llm_structured", {"complete": not errors, "errors": errors, **base,
                                       **out}, short=args.short)
    return 0 if not errors else 1
