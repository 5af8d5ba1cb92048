"""The seed MLP (256 -> 512 -> 16) served at ``POST /mlp`` and over Open Inference v2.

Run it with ``ember run examples/mlp_app.py:app``. On first use the app writes its weights
as a safetensors file under ``$EMBER_CACHE_DIR`` (default ``~/.cache/ember``), so every
replica loads real weights from disk the way a model deployment does.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import load_file, save_file

import ember
from ember.protocols import OpenInferenceProtocol, TensorModel, TensorSpec

IN_FEATURES, HIDDEN, OUT_FEATURES = 256, 512, 16
MAX_ROWS = 512


class MlpRequest(BaseModel):
    """A batch of feature rows."""

    model_config = ConfigDict(extra="forbid")
    inputs: list[list[float]] = Field(min_length=1, max_length=MAX_ROWS)


class MlpResponse(BaseModel):
    outputs: list[list[float]]


def weights_path() -> Path:
    root = Path(os.environ.get("EMBER_CACHE_DIR", Path.home() / ".cache" / "ember"))
    return root / "examples" / "seed-mlp-256-512-16.safetensors"


def ensure_weights(path: Path) -> Path:
    """Write deterministic weights once, atomically (temp file + rename)."""
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "fc1.weight": torch.randn(HIDDEN, IN_FEATURES, generator=gen) / IN_FEATURES**0.5,
        "fc1.bias": torch.zeros(HIDDEN),
        "fc2.weight": torch.randn(OUT_FEATURES, HIDDEN, generator=gen) / HIDDEN**0.5,
        "fc2.bias": torch.zeros(OUT_FEATURES),
    }
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)
    return path


@ember.deployment(route="/mlp", warm_floor=0, max_replicas=2, num_cpus=0.5, scaledown_after_s=60,
                  batch=ember.Batch(max_size=512, max_wait_ms=2), target_queue_depth=64)
class SeedMLP:
    def setup(self) -> None:
        torch.set_num_threads(1)
        state = load_file(str(ensure_weights(weights_path())))
        self.model = torch.nn.Sequential(
            torch.nn.Linear(IN_FEATURES, HIDDEN),
            torch.nn.ReLU(),
            torch.nn.Linear(HIDDEN, OUT_FEATURES),
        )
        renamed = {k.replace("fc1", "0").replace("fc2", "2"): v for k, v in state.items()}
        self.model.load_state_dict(renamed)
        self.model.eval()

    def __call__(self, body: MlpRequest) -> MlpResponse:
        rows = body.inputs
        if any(len(row) != IN_FEATURES for row in rows):
            raise ember.errors.InvalidBody(f"every row of inputs must have {IN_FEATURES} numbers")
        return MlpResponse(outputs=self.forward(torch.tensor(rows, dtype=torch.float32)).tolist())

    @ember.route()  # tensor in, tensor out: batched across requests, served over OIP v2
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.model(x)  # type: ignore[no-any-return]


app = ember.App(
    [SeedMLP],
    name="mlp",
    protocols=[OpenInferenceProtocol([TensorModel(
        name="mlp", deployment="SeedMLP", attr="forward",
        input=TensorSpec("INPUT", "FP32", (-1, IN_FEATURES)),
        output=TensorSpec("OUTPUT", "FP32", (-1, OUT_FEATURES)))])],
    curl=(
        "curl -s -X POST {url}/mlp -H 'content-type: application/json' "
        "-d \"{{\\\"inputs\\\": [$(python3 -c 'print([0.5]*256)')]}}\""
    ),
)
