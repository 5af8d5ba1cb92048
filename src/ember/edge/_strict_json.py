"""Hostile input: a strict JSON parser, and ASGI guards for content codings and header size.

``parse_json`` accepts only what every JSON parser reads the same way: UTF-8, finite
numbers, unique keys, bounded nesting. Depth is checked by a linear scan *before* parsing,
so 100,000 nested brackets are refused in milliseconds without recursing.
``ContentEncodingMiddleware`` refuses compressed request bodies (415) so nothing is ever
inflated (no gzip bombs), and ``HeaderLimitMiddleware`` refuses oversized header blocks
(431) that reach the app::

    RequestError (400)                 ember.errors
    ├── MalformedJSON (400)
    │   └── JSONTooDeep (400)          nesting deeper than max_depth
    ├── UnsupportedMediaType (415)     a Content-Encoding other than identity
    └── HeadersTooLarge (431)          request headers over max_header_bytes

Example:
    >>> parse_json(b'{"a": [1, 2.5, "x"]}')
    {'a': [1, 2.5, 'x']}
    >>> parse_json(b'{"a": 1e999}')
    Traceback (most recent call last):
    ...
    ember.errors.MalformedJSON: malformed JSON: number 1e999 is out of range
"""

from __future__ import annotations

import json
import re
from itertools import accumulate
from typing import Any, NoReturn

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from ember.edge._asgi import RejectHook, send_error
from ember.errors import (
    ConfigError,
    HeadersTooLarge,
    JSONTooDeep,
    MalformedJSON,
    UnsupportedMediaType,
)

DEFAULT_MAX_DEPTH = 64
DEFAULT_MAX_HEADER_BYTES = 64 * 1024
_CLIP_CHARS = 40

# A JSON string, or an unterminated one running to the end of the text. Matching the
# unterminated case too keeps re.sub linear: it never rescans from a later quote.
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*\\?(?:"|\Z)', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}
# \uD800-\uDFFF escapes: only then can a parsed string hold an unpaired surrogate.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")

def parse_json(body: bytes, *, max_depth: int = DEFAULT_MAX_DEPTH) -> Any:
    """Parse a request body strictly.

    Args:
        body: the raw request body.
        max_depth: most levels of nested arrays and objects accepted.

    Returns:
        The parsed value (dicts, lists, str, int, float, bool, None).

    Raises:
        MalformedJSON: invalid UTF-8 or JSON, NaN or Infinity, a number out of float range
            or with too many digits, a duplicate key, or an unpaired surrogate escape.
        JSONTooDeep: nesting deeper than ``max_depth``.
        ConfigError: ``max_depth`` is below 1.

    Example:
        >>> parse_json(b'{"a": 1, "a": 2}')
        Traceback (most recent call last):
        ...
        ember.errors.MalformedJSON: malformed JSON: duplicate key 'a'
    """
    if max_depth < 1:
        raise ConfigError(f"max_depth must be at least 1, got {max_depth}")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedJSON(f"body is not valid UTF-8 (byte {exc.start})") from None
    # Counting openers is C-speed; only when there are more openers than the limit (strings
    # included, so this over-counts) is the exact scan needed.
    if text.count("[") + text.count("{") > max_depth and nesting_depth(text) > max_depth:
        raise JSONTooDeep(max_depth=max_depth)
    value = _loads(text)
    if _SURROGATE_ESCAPE.search(text):
        _refuse_unpaired_surrogates(value)
    return value


async def read_json(request: Request) -> Any:
    """The body of an admin route, parsed as strictly as a model route's.

    Raises:
        MalformedJSON: the body is not strict JSON.
    """
    return parse_json(await request.body())


def nesting_depth(text: str) -> int:
    """Deepest nesting of ``[`` and ``{`` outside strings, in linear time, no recursion.

    Malformed text gives a meaningless but finite answer; the parser refuses it anyway.

    Example:
        >>> nesting_depth('[{"a": "[[["}, []]')
        2
    """
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    return max(accumulate(_STEP[ch] for ch in brackets), default=0)


def _loads(text: str) -> Any:
    """``json.loads`` with the strict hooks, every failure turned into MalformedJSON."""
    try:
        return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float,
                          object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as exc:
        raise MalformedJSON(f"{exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except ValueError as exc:  # an integer over Python's 4,300-digit conversion limit
        raise MalformedJSON(f"a number is too long ({str(exc).split(':')[0]})") from None
    except RecursionError:  # unreachable after the depth check; never a 500 regardless
        raise MalformedJSON("nesting too deep") from None


def _refuse_constant(name: str) -> NoReturn:
    """NaN and Infinity are not JSON; other parsers refuse them or read them differently."""
    raise MalformedJSON(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    """A float, refusing literals like ``1e999`` that overflow to infinity."""
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise MalformedJSON(f"number {_clip(text)} is out of range")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object, refusing duplicate keys (parsers disagree on which value wins)."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise MalformedJSON(f"duplicate key {_clip(key)!r}")
            seen.add(key)
    return obj


def _refuse_unpaired_surrogates(value: Any) -> None:
    """Refuse strings that cannot be encoded as UTF-8 (they would fail later, as a 500)."""
    stack = [value]
    while stack:  # iterative: depth is bounded already, but a loop needs no bound at all
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise MalformedJSON("a string holds an unpaired surrogate escape such as "
                                    "\\ud800") from None


def _clip(text: str) -> str:
    """Caller-supplied text short enough to put in a message and a log line."""
    return text if len(text) <= _CLIP_CHARS else text[:_CLIP_CHARS] + "..."


class ContentEncodingMiddleware:
    """Answer 415 to a request whose ``Content-Encoding`` is anything but identity.

    Nothing in Ember inflates request bodies; refusing them up front means a compressed
    body (a gzip bomb included) is neither inflated nor passed to user code as garbage.

    Args:
        app: the wrapped ASGI app.
        on_reject: called with ``(path, "unsupported_encoding")`` for each refusal.
    """

    def __init__(self, app: ASGIApp, *, on_reject: RejectHook | None = None) -> None:
        self.app = app
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        encoding = content_encoding(scope) if scope["type"] == "http" else None
        if encoding is None:
            await self.app(scope, receive, send)
            return
        if self.on_reject is not None:
            self.on_reject(scope["path"], "unsupported_encoding")
        await send_error(UnsupportedMediaType(encoding=repr(_clip(encoding))),
                         scope, receive, send)


def content_encoding(scope: Scope) -> str | None:
    """The request's content coding when it is not identity, else None."""
    values = [v.decode("latin-1") for k, v in scope.get("headers", [])
              if k == b"content-encoding"]
    codings = [c.strip().lower() for c in ",".join(values).split(",")]
    if all(c in ("", "identity") for c in codings):
        return None
    return ", ".join(c for c in codings if c)


class HeaderLimitMiddleware:
    """Answer 431 when the request's headers total more than ``max_header_bytes``.

    Counted as on the wire (name, value, ``": "`` and CRLF), so ten thousand tiny headers
    count as well as one huge one. A server in front (uvicorn/h11) may refuse far smaller
    header blocks first, with 400; this covers whatever reaches the app.

    Args:
        app: the wrapped ASGI app.
        max_header_bytes: the limit; 64 KiB by default.
        on_reject: called with ``(path, "headers_too_large")`` for each refusal.
    """

    def __init__(self, app: ASGIApp, max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES, *,
                 on_reject: RejectHook | None = None) -> None:
        if max_header_bytes < 1:
            raise ConfigError(f"max_header_bytes must be at least 1, got {max_header_bytes}")
        self.app = app
        self.max_header_bytes = max_header_bytes
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        size = sum(len(k) + len(v) + 4 for k, v in scope.get("headers", []))
        if size <= self.max_header_bytes:
            await self.app(scope, receive, send)
            return
        if self.on_reject is not None:
            self.on_reject(scope["path"], "headers_too_large")
        await send_error(HeadersTooLarge(size=size, limit=self.max_header_bytes),
                         scope, receive, send)


__all__ = [
    "ContentEncodingMiddleware",
    "HeaderLimitMiddleware",
    "HeadersTooLarge",
    "JSONTooDeep",
    "UnsupportedMediaType",
    "content_encoding",
    "nesting_depth",
    "parse_json",
]
