"""Header validation: every lie is refused with a typed error before any large read."""

from __future__ import annotations

import json
import struct
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ember.errors import WeightsError
from ember.loaders import HeaderInvalid, LoaderConfig, UnsafeFormat, load
from ember.loaders._header import parse_header, parse_length
from ember.loaders._reader import read_header
from ember.loaders._source_file import FileSource

T = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


def _header(path: Path) -> None:
    source = FileSource(path.parent)
    read_header(source, source.stat(path.name), 100_000_000)


@pytest.mark.parametrize(
    ("header", "data", "length", "reason"),
    [
        ({"t": T}, b"\0" * 8, 0, "header length is 0"),
        ({"t": T}, b"\0" * 8, 100_000_001, "exceeds 100000000"),
        ({"t": T}, b"\0" * 8, 10_000, "exceeds file size"),
        (b"\xff\xfe{}", b"", None, "not UTF-8"),
        (b"[1, 2]", b"", None, "does not start with '{'"),
        (b"{not json", b"", None, "not JSON"),
        (b'{"t": 1, "t": 2}', b"", None, "duplicate key"),
        ({"t": {**T, "dtype": "C64"}}, b"\0" * 8, None, "not in the allowlist"),
        ({"t": {**T, "dtype": "PICKLE"}}, b"\0" * 8, None, "not in the allowlist"),
        ({"t": {**T, "shape": [3]}}, b"\0" * 8, None, "!= byte span"),
        ({"t": {**T, "shape": [2**62, 2**62]}}, b"\0" * 8, None, "!= byte span"),
        ({"t": {**T, "shape": [-2]}}, b"\0" * 8, None, "negative"),
        ({"t": {**T, "shape": [True, 2]}}, b"\0" * 8, None, "non-integer"),
        ({"t": {**T, "data_offsets": [0, 16]}}, b"\0" * 8, None, "!= byte span"),
        ({"t": {**T, "data_offsets": [8, 0]}}, b"\0" * 8, None, "out of order"),
        ({"t": {**T, "data_offsets": [8, 16]}}, b"\0" * 16, None, "gap before"),
        ({"t": {**T, "data_offsets": [2**40, 2**40 + 8]}}, b"\0" * 8, None, "gap before"),
        ({"a": T, "b": {**T, "data_offsets": [4, 12]}}, b"\0" * 12, None, "overlaps"),
        ({"t": T}, b"\0" * 4, None, "past the file size"),
        ({"t": {**T, "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 8, None, "trailing"),
        ({"t": T, "__metadata__": {"k": 1}}, b"\0" * 8, None, "is not a string"),
        ({"t": T, "__metadata__": ["x"]}, b"\0" * 8, None, "not an object"),
        ({"t": {"dtype": "F32", "shape": [2]}}, b"\0" * 8, None, "exactly dtype"),
        ({"t": {**T, "extra": 1}}, b"\0" * 8, None, "exactly dtype"),
        ({"t": {**T, "data_offsets": [0]}}, b"\0" * 8, None, "[begin, end]"),
    ],
)
def test_malformed_headers_are_refused(
    raw_file: Callable[..., Path], header: Any, data: bytes, length: int | None, reason: str
) -> None:
    path = raw_file(header, data, length=length)
    with pytest.raises(HeaderInvalid) as info:
        _header(path)
    assert reason in info.value.reason
    assert reason in str(info.value)


def test_data_past_the_end_is_refused(raw_file: Callable[..., Path]) -> None:
    # The only tensor claims bytes the file does not have.
    path = raw_file({"t": {**T, "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8)
    with pytest.raises(HeaderInvalid, match="past the file size"):
        _header(path)


def test_valid_header_with_metadata_and_padding(raw_file: Callable[..., Path]) -> None:
    body = json.dumps({"t": T, "__metadata__": {"format": "pt"}}).encode() + b"   "
    path = raw_file(body, b"\0" * 8)
    header = parse_header(body, name="x", file_size=path.stat().st_size)
    assert header.metadata == {"format": "pt"}
    assert [(s.name, s.shape, s.end - s.start) for s in header.tensors] == [("t", (2,), 8)]


def test_file_shorter_than_the_prefix() -> None:
    with pytest.raises(HeaderInvalid, match="shorter than 8"):
        parse_length(b"\1\0", name="x", file_size=2, cap_bytes=100)


@pytest.mark.parametrize("magic", [b"PK\x03\x04\0\0\0\0", b"\x80\x02}q\0(X\0\0"])
def test_pickle_bytes_are_refused_even_with_a_safetensors_name(
    tmp_path: Path, magic: bytes, config: LoaderConfig
) -> None:
    path = tmp_path / "origin" / "model.safetensors"
    path.parent.mkdir()
    path.write_bytes(magic + b"\0" * 64)
    with pytest.raises(UnsafeFormat, match="convert it to safetensors"):
        load(path.as_uri(), config=config)


def test_header_over_the_configured_cap_is_refused_before_reading_it(
    raw_file: Callable[..., Path], config: LoaderConfig
) -> None:
    path = raw_file({"t": T}, b"\0" * 8)
    small = config.model_copy(update={"max_header_bytes": 16})
    with pytest.raises(HeaderInvalid, match="exceeds 16"):
        load(path.as_uri(), config=small)


def _blob(draw: st.DrawFn) -> bytes:
    value = st.recursive(
        st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=8),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner),
        max_leaves=12,
    )
    entry = st.fixed_dictionaries(
        {
            "dtype": st.sampled_from(["F32", "F16", "I8", "BOOL", "X", "F8_E4M3"]) | value,
            "shape": st.lists(st.integers(-2, 2**40), max_size=3) | value,
            "data_offsets": st.lists(st.integers(-2, 2**41), min_size=2, max_size=2) | value,
        }
    )
    doc = draw(st.dictionaries(st.text(max_size=8), entry | value, max_size=4))
    text = json.dumps(doc).encode()
    text = draw(st.sampled_from([text, text[: len(text) // 2], b" " + text, text + b"  "]))
    data = draw(st.binary(max_size=64))
    length = draw(st.sampled_from([len(text), 0, 2**63, 2**64 - 1, len(text) + 1]))
    return struct.pack("<Q", length) + text + data


@st.composite
def _files(draw: st.DrawFn) -> bytes:
    return draw(st.binary(max_size=48)) if draw(st.booleans()) else _blob(draw)


@pytest.mark.timeout(120)
@settings(
    max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(content=_files())
def test_fuzzed_headers_raise_only_typed_errors_within_the_cap(
    tmp_path: Path, content: bytes
) -> None:
    path = tmp_path / "fuzz.safetensors"
    path.write_bytes(content)
    tracemalloc.start()
    try:
        _header(path)
    except WeightsError:
        pass
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    # A header may claim up to 2**64 bytes; what is allocated stays near the file's size.
    assert peak < 1 << 20
