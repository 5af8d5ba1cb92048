"""Options of offline batch jobs: Pydantic models, units in the field names."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    SecretStr,
    field_validator,
    model_validator,
)

InputFormat = Literal["jsonl", "csv", "parquet"]
OutputFormat = Literal["parquet", "jsonl"]


class ShareOptions(BaseModel):
    """How a batch job shares replicas with online traffic (it always goes second).

    Example:
        >>> ShareOptions(url="http://127.0.0.1:8000", latency_budget_s=0.2).budget_fraction
        0.5
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(description="Base URL of the running Ember ingress, e.g. http://host:8000.")
    latency_budget_s: PositiveFloat = Field(
        default=0.5, description="Longest an online request may wait behind one offline batch."
    )
    budget_fraction: float = Field(
        default=0.5, gt=0.0, le=1.0,
        description="Share of the budget one offline batch may use; the rest is the online"
        " request's own time.",
    )
    max_online_depth: NonNegativeInt = Field(
        default=0, description="Online ongoing + queued requests above which batch work waits."
    )
    poll_interval_s: PositiveFloat = Field(
        default=0.2, description="How often the ingress's /-/status is read."
    )
    resume_after_s: NonNegativeFloat = Field(
        default=0.5, description="Quiet time online before batch work starts again."
    )
    status_timeout_s: PositiveFloat = Field(default=2.0, description="Timeout of one status read.")
    api_key: SecretStr | None = Field(
        default=None, description="Bearer key for the ingress, when it has API keys on."
    )

    def headers(self) -> dict[str, str]:
        """Request headers for the ingress (its key, when one is set)."""
        if self.api_key is None:
            return {}
        return {"Authorization": f"Bearer {self.api_key.get_secret_value()}"}

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https:// (got {value!r})")
        return value.rstrip("/")


class OfflineOptions(BaseModel):
    """Options of one batch job (``ember batch`` / ``run_batch``).

    Example:
        >>> OfflineOptions(batch_size=64, concurrency=2).shard_rows
        5000
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    batch_size: PositiveInt = Field(default=256, description="Most items per handler call.")
    concurrency: PositiveInt = Field(default=1, description="Workers, each with its own replica.")
    shard_rows: PositiveInt = Field(
        default=5000, description="Rows per shard: the unit of output files and of redo on resume."
    )
    max_item_bytes: PositiveInt = Field(
        default=1 << 20, description="Rows larger than this go to the errors file."
    )
    max_batch_bytes: PositiveInt = Field(
        default=64 << 20, description="A batch over this many input bytes is split before the call."
    )
    input_column: str | None = Field(
        default=None, description="Column read as the item; default 'text' ('input' for tensors)."
    )
    id_column: str = Field(default="id", description="Column copied to the output's id.")
    input_format: InputFormat | None = Field(
        default=None, description="Format of every input; default: from each file's extension."
    )
    output_format: OutputFormat = "parquet"
    num_cpus: NonNegativeFloat | None = Field(
        default=None, description="CPUs per worker; default: the deployment's num_cpus."
    )
    num_gpus: NonNegativeFloat | None = Field(
        default=None, description="GPUs per worker; default: the deployment's num_gpus."
    )
    read_num_cpus: NonNegativeFloat = Field(
        default=0.0,
        description="CPUs per read task. Reading is light next to the model, and a read that"
        " waits for a CPU the workers hold would stall the job.",
    )
    read_concurrency: PositiveInt = Field(default=2, description="Read tasks at once.")
    share: ShareOptions | None = Field(
        default=None, description="Send batches through the online deployment; None = own workers."
    )
    progress: bool | None = Field(
        default=None, description="Show a progress bar; default: when stderr is a terminal."
    )

    @model_validator(mode="after")
    def _check_sizes(self) -> OfflineOptions:
        if self.max_batch_bytes < self.max_item_bytes:
            raise ValueError(
                f"max_batch_bytes ({self.max_batch_bytes}) must be at least max_item_bytes"
                f" ({self.max_item_bytes}), or an accepted row could not fit in a batch"
            )
        return self
