"""Settings in one place: every ``EMBER_*`` variable is read by ``ember.settings`` alone."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from ember import settings
from ember.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_the_environment_table_lists_exactly_the_settings() -> None:
    text = (ROOT / "docs" / "configuration.md").read_text()
    table = text.split("| variable |", 1)[1].split("\n\n", 1)[0]
    listed = set(re.findall(r"^\| `(EMBER_\w+)`", table, flags=re.M))
    assert listed == set(settings.variables())


def test_nothing_else_reads_ember_variables_from_the_environment() -> None:
    readers = []
    for path in (ROOT / "src").rglob("*.py"):
        if path.name == "settings.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and re.fullmatch(r"EMBER_[A-Z_]+", node.value):
                readers.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value}")
    assert readers == []


def test_private_variables_stay_in_the_warm_runtime_s_channel() -> None:
    """``_EMBER_*``: from the process that starts the cluster to its workers, not settings."""
    private: dict[str, set[str]] = {}
    for path in (ROOT / "src").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and re.fullmatch(r"_EMBER_[A-Z_]+", node.value):
                private.setdefault(node.value, set()).add(path.relative_to(ROOT).as_posix())
    assert private == {"_EMBER_WARM_IMPORTS": {"src/ember/control/warm_env.py"},
                       "_EMBER_LIGHT_WORKER": {"src/ember/control/warm_env.py"}}


def test_values_are_typed_and_empty_means_unset() -> None:
    config = settings.load({"EMBER_PORT": "9001", "EMBER_ACCESS_LOG": "true",
                            "EMBER_SCALEDOWN_AFTER_S": "2.5", "EMBER_WARM_POOL": "",
                            "EMBER_UNKNOWN": "ignored", "PATH": "/bin"})
    assert (config.port, config.access_log, config.scaledown_after_s) == (9001, True, 2.5)
    assert config.warm_pool == 1


def test_the_process_environment_is_read_on_each_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBER_PORT", "8123")
    assert settings.load().port == 8123
    monkeypatch.setenv("EMBER_PORT", "8124")
    assert settings.load().port == 8124


@pytest.mark.parametrize(("name", "value"), [
    ("EMBER_PORT", "eighty"), ("EMBER_PORT", "70000"), ("EMBER_WARM_POOL", "-1"),
    ("EMBER_SCALEDOWN_AFTER_S", "soon"), ("EMBER_SCALEDOWN_AFTER_S", "nan"),
    ("EMBER_RATE_LIMIT_RPS", "0"), ("EMBER_DEVICE", "tpu"), ("EMBER_SNAPSHOT_MAX_BYTES", "1GB"),
])
def test_a_bad_value_is_a_config_error_naming_the_variable(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=f"^{name}="):
        settings.load({name: value})


def test_secrets_are_not_shown() -> None:
    config = settings.load({"EMBER_API_KEYS": "k-0123456789abcdef"})
    assert "k-0123456789abcdef" not in repr(config)
