"""OpenAI's ``response_format`` and ``logprobs`` for the generation routes.

``response_format`` is ``{"type": "text"}`` (free text), ``{"type": "json_object"}`` (any
JSON object) or ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...},
"strict": ...}}``; :func:`grammar_of` turns it into an llguidance grammar, checked here at
the edge so that a schema llguidance cannot compile is a 400 naming ``response_format``
before any replica is asked. JSON is generated compactly (no optional whitespace): a small
model cannot then spend its tokens on blank space. The schema is always enforced; ``strict``
is accepted and changes nothing.

The replica reports each token as an entry of OpenAI chat's ``logprobs.content``
(``token``, ``logprob``, ``bytes``, ``top_logprobs``); :func:`chat_logprobs` wraps them for
chat and :class:`LegacyLogprobs` reshapes them into the completions API's older
``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset`` lists.

Example:
    >>> grammar_of(ResponseFormat(type="text")) is None
    True
    >>> grammar_of(ResponseFormat(type="json_object")).startswith("{")
    True
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import llguidance
from pydantic import BaseModel, ConfigDict, Field

from ember.errors import BadRequest

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

#: llguidance's JSON options: no optional whitespace, "," and ":" as separators.
COMPACT_JSON: JsonCompileOptions = {"whitespace_flexible": False}


class JsonSchemaFormat(BaseModel):
    """The ``json_schema`` member of ``response_format``."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``; ``type`` is checked by :func:`grammar_of` (400)."""

    model_config = ConfigDict(extra="forbid")
    type: str
    json_schema: JsonSchemaFormat | None = None


def _refuse(detail: str) -> BadRequest:
    return BadRequest(f"response_format: {detail}", param="response_format")


def grammar_of(fmt: ResponseFormat | None) -> str | None:
    """The llguidance grammar ``fmt`` asks for (None: free text).

    Raises:
        BadRequest: an unknown type, a ``json_schema`` type without its schema, or a schema
            llguidance cannot compile; ``param`` is ``response_format``.
    """
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        schema: dict[str, Any] = {"type": "object"}
    elif fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise _refuse("type json_schema needs a json_schema member with a schema")
        schema = fmt.json_schema.schema_
    else:
        raise _refuse(f"unknown type {fmt.type!r}; use text, json_object or json_schema")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=COMPACT_JSON)
    except ValueError as err:
        raise _refuse(f"the schema is not a JSON object: {err}") from None
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        raise _refuse(f"the schema cannot be compiled: {problem}")
    return grammar


def chat_logprobs(entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """A chat choice's ``logprobs`` from the replica's entries (None when not asked)."""
    return None if entries is None else {"content": entries, "refusal": None}


@dataclass
class LegacyLogprobs:
    """The completions API's ``logprobs`` object, built as the tokens come.

    ``text_offset`` counts characters of the completion before each token; a token that
    ends half-way through a UTF-8 character counts the character where it completes.
    """

    _decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace"))
    _offset: int = 0

    def shape(self, entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
        """``entries`` (the next tokens, in order) in the legacy shape; None when not asked."""
        if entries is None:
            return None
        offsets = []
        for entry in entries:
            offsets.append(self._offset)
            self._offset += len(self._decoder.decode(bytes(entry["bytes"])))
        return {"tokens": [e["token"] for e in entries],
                "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]}
                                 for e in entries],
                "text_offset": offsets}

