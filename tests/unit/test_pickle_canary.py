"""A pickle whose unpickling would write a canary file is refused and never unpickled."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from ember.loaders import LoaderConfig, UnsafeFormat, load


class _Exploit:
    def __init__(self, canary: Path) -> None:
        self.canary = canary

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        # Unpickling calls Path.write_text(canary, "unpickled"): the canary proves it ran.
        return (Path.write_text, (self.canary, "unpickled"))  # type: ignore[return-value]


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "model.safetensors"])
def test_malicious_pickle_is_refused_and_never_unpickled(tmp_path: Path, name: str) -> None:
    canary = tmp_path / "canary"
    payload = pickle.dumps({"weight": _Exploit(canary)}, protocol=4)
    origin = tmp_path / "origin" / name
    origin.parent.mkdir()
    origin.write_bytes(payload)
    with pytest.raises(UnsafeFormat, match="convert it to safetensors"):
        load(origin.as_uri(), config=LoaderConfig(cache_dir=tmp_path / "cache"))
    assert not canary.exists()
    # The payload really is live: unpickling it here would have written the canary.
    pickle.loads(payload)
    assert canary.read_text() == "unpickled"
