"""What FastAPI is told of a route's body and answer: the types a deployment's method declares.

Split from ``ingress.py``, which builds the routes from these.
"""

from __future__ import annotations

import collections.abc
import inspect
import typing
from typing import Annotated, Any

from fastapi import Body
from pydantic import TypeAdapter

from ember.app.decorator import RouteSpec


def single_item(route: RouteSpec) -> tuple[Any, Any] | None:
    """``(In, Out)`` when a batch route also takes one ``In`` as the whole body, else None.

    A batch handler ``list[In] -> list[Out]`` answers a JSON array item for item, and a single
    ``In`` with a single ``Out`` (one batch item), as Ray Serve's ``@serve.batch`` and
    LitServe batch single requests. Not when ``In`` is itself an array type: an array body
    would then be ambiguous.
    """
    if route.kind != "batch" or typing.get_origin(route.input_model) is not list:
        return None
    (item,) = typing.get_args(route.input_model) or (Any,)
    if item is Any or typing.get_origin(item) in _ARRAY_ORIGINS or item in _ARRAY_ORIGINS:
        return None
    out_args = typing.get_args(route.output_model)
    out = out_args[0] if typing.get_origin(route.output_model) is list and out_args else Any
    return item, out


_ARRAY_ORIGINS: tuple[Any, ...] = (list, tuple, set, frozenset, bytes, collections.abc.Sequence)


def response_model(route: RouteSpec) -> Any:
    """The annotation if FastAPI can serialize it, else None (returned value sent as is)."""
    annotation = route.output_model
    single = single_item(route)
    if single is not None and annotation is not None:
        annotation = annotation | single[1] if single[1] is not Any else Any
    if route.is_stream or annotation is None or annotation is inspect.Signature.empty:
        return None
    try:
        TypeAdapter(annotation)
    except Exception:  # arbitrary user types (tensors...) have no schema
        return None
    return annotation


def body_parameter(route: RouteSpec) -> inspect.Parameter | None:
    """The endpoint's ``body`` parameter for FastAPI, or None for a route that takes none."""
    if route.kind == "none":
        return None
    # Body() makes FastAPI read lists and scalars from the body rather than the query.
    single = single_item(route)
    model = route.input_model | single[0] if single is not None else route.input_model
    annotation = Annotated[model, Body()] if route.kind in ("batch", "value") else model
    return inspect.Parameter("body", inspect.Parameter.KEYWORD_ONLY, annotation=annotation)
