"""Every ``EMBER_*`` environment variable, read in one place and typed.

Nothing else in Ember reads ``EMBER_*`` from the environment (a test walks the source for
it), and README's environment table lists exactly the fields below (a test compares them).
The environment is read on each call to :func:`load`, not once at import: tests, the CLI and
Ray workers each see the environment they run in. An empty variable counts as unset.

Example:
    >>> load({"EMBER_PORT": "9000", "EMBER_ACCESS_LOG": "1"}).port
    9000
    >>> load({"EMBER_WARM_POOL": "many"})
    Traceback (most recent call last):
    ...
    ember.errors._base.ConfigError: EMBER_WARM_POOL='many': Input should be a valid integer, \
unable to parse string as an integer
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from ember.errors import ConfigError

PREFIX = "EMBER_"


class Settings(BaseSettings):
    """Ember's process-wide settings; each field is ``EMBER_<FIELD NAME IN CAPITALS>``."""

    model_config = SettingsConfigDict(
        env_prefix=PREFIX, env_ignore_empty=True, extra="ignore", frozen=True
    )

    # -- serving ---------------------------------------------------------------------------
    port: int = Field(8000, ge=1, le=65535, description="port `ember run` listens on")
    url: str | None = Field(None, description="where `ember status|warm|plan` look")
    warm_pool: int = Field(1, ge=0, description="warm pool replicas of an App (0 = off)")
    warm_runtime: int = Field(
        2, ge=0, description="idle pre-started workers, torch imported, on a local cluster"
    )
    warm_pool_bytes: int = Field(
        2 << 30, ge=0, description="model memory one pool replica keeps constructed"
    )
    gpu_pool_park_after_s: float = Field(
        10.0, ge=0, allow_inf_nan=False,
        description="idle time before the GPU pool frees a model's device copy",
    )
    scaledown_after_s: float | None = Field(
        None, ge=0, allow_inf_nan=False, description="overrides every deployment's quiet time"
    )
    body_timeout_s: float = Field(
        30.0, gt=0, allow_inf_nan=False, description="a request body must arrive whole within "
        "this, else 408",
    )
    edge_max_concurrency: int = Field(
        2048, ge=1, description="connections and requests one edge holds before answering 503",
    )
    edge_max_connections_per_client: int = Field(
        512, ge=0, description="connections one client address holds at one edge before the "
        "next is answered 503 and closed (0 = no cap; behind a proxy every client is the proxy)",
    )
    access_log: bool = Field(False, description="Ray Serve's per-request access log lines")
    textgen_model: str | None = Field(
        None, description="the textgen app's model: a weights URL (file://, s3://, https://: "
        "through the caches, weights mapped), a transformers directory, or hf://org/name "
        "from the local cache; unset: the shipped TinyLM",
    )
    textgen_adapters: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=dict, description="LoRA adapters over the textgen model: name=url "
        "pairs, comma-separated (any ember.loaders URL of a peft adapter folder)",
    )
    textgen_max_adapters: int = Field(
        4, ge=1, description="LoRA adapters one textgen replica keeps loaded (LRU)"
    )
    textgen_max_replicas: int = Field(
        1, ge=1, description="most replicas of the textgen app's TextGen deployment"
    )
    textgen_warm_floor: int = Field(
        0, ge=0, description="TextGen replicas kept running when idle (0: scale to zero)"
    )
    # -- who may call ------------------------------------------------------------------------
    api_keys: SecretStr | None = Field(None, description="invoke keys, comma-separated")
    api_keys_file: Path | None = Field(None, description="invoke keys, one per line")
    admin_keys: SecretStr | None = Field(None, description="admin keys, comma-separated")
    admin_loopback: bool = Field(
        False, description="admin routes answer loopback callers with no admin key (local "
        "development only: a proxy on the host connects from loopback)",
    )
    allow_unauthenticated: bool = Field(
        False, description="let the edge listen beyond loopback with no API key",
    )
    admin_key: SecretStr | None = Field(
        None, description="the key `ember status|warm|plan` send"
    )
    max_lease_s: float = Field(
        3600.0, gt=0, allow_inf_nan=False, description="longest warm lease an admin may take"
    )
    api_key: SecretStr | None = Field(
        None, description="the key `ember batch --share-with-online` sends"
    )
    rate_limit_rps: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="requests/s per key (off if unset)"
    )
    rate_limit_burst: int | None = Field(None, ge=1, description="bucket (default: the rate)")
    # -- weights -----------------------------------------------------------------------------
    cache_dir: Path | None = Field(None, description="node cache (default ~/.cache/ember)")
    regional_cache: str | None = Field(None, description="fsspec URL of the regional tier")
    snapshot_max_bytes: int | None = Field(None, ge=0, description="cap on node snapshots")
    minilm_weights: str | None = Field(None, description="weights URL of the flagship")
    device: str = Field(
        "auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$", description="where models run"
    )

    @field_validator("textgen_adapters", mode="before")
    @classmethod
    def _name_url_pairs(cls, value: Any) -> Any:
        """``a=file:///x,b=s3://y`` as ``{"a": "file:///x", "b": "s3://y"}``."""
        if not isinstance(value, str):
            return value
        pairs = [p.strip() for p in value.split(",") if p.strip()]
        bad = [p for p in pairs if "=" not in p or not p.partition("=")[0].strip()]
        if bad:
            raise ValueError(f"expected name=url pairs, got {bad[0]!r}")
        return {n.strip(): u.strip() for n, _, u in (p.partition("=") for p in pairs)}


def variable(field: str) -> str:
    """The environment variable of a settings field: ``variable("port") == "EMBER_PORT"``."""
    return PREFIX + field.upper()


def variables() -> list[str]:
    """Every ``EMBER_*`` variable Ember reads, sorted."""
    return sorted(variable(name) for name in Settings.model_fields)


def load(environ: Mapping[str, str] | None = None) -> Settings:
    """The settings from ``environ`` (default: this process's environment).

    Raises:
        ConfigError: a variable holds a value of the wrong kind; the message names it.
    """
    try:
        if environ is None:
            return Settings()
        values = {
            key.removeprefix(PREFIX).lower(): value
            for key, value in environ.items()
            if key.startswith(PREFIX) and value != ""
        }
        return Settings.model_validate(values)
    except ValidationError as exc:
        first = exc.errors()[0]
        name = variable(str(first["loc"][0])) if first["loc"] else PREFIX + "*"
        raise ConfigError(f"{name}={first.get('input')!r}: {first['msg']}") from None


__all__ = ["PREFIX", "Settings", "load", "variable", "variables"]
