"""A worker that loads one ladder model per command, for bench/coldstart_sizes.py.

It imports torch once, then reads one JSON command per line on stdin and answers one JSON
line: ``{"loader": ..., "folder": ..., "url": ..., "options": {...}}`` ->
``{"seconds": s, "import_s": s, "bytes": n}`` or ``{"error": "..."}``. Every loader builds the
same model (the folder's ``config.json``, bf16) and ends with every weight in memory:

* ``from_pretrained``: ``AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)``;
* ``load_file``: the model on ``meta``, each shard's ``safetensors.torch.load_file`` assigned;
* ``fastsafetensors``: the same with ``fastsafe_open(shards, device="cpu", nogds=True)``;
* ``runai``: ``runai_model_streamer.SafetensorsStreamer`` over the shards (paths or s3 URLs);
* ``s3_download+from_pretrained``: boto3's parallel download of every object, then
  ``from_pretrained`` (what a user without a streaming loader writes for S3);
* ``ember``: ``ember.deployments.causal_lm.load_causal_lm`` (the deployment's own load).

``seconds`` counts from the call until every page of every weight has been read once
(``returned_s``: until the loader returned, which for a lazy mapping is before any read);
``transformers`` is imported once when the worker starts (its time is in the ready line as
``import_s``), never per load. The
model is dropped before the answer, so the worker never holds two.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def _shards(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def _meta_model(folder: Path) -> Any:
    from ember.deployments.causal_lm import build_on_meta

    return build_on_meta(json.loads((folder / "config.json").read_text()))


def _assign(model: Any, state: dict[str, torch.Tensor]) -> Any:
    from ember.deployments.causal_lm import assign_weights

    return assign_weights(model, state)


def load_from_pretrained(folder: Path, **_: Any) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True,
                                                dtype=torch.bfloat16)


def load_load_file(folder: Path, **_: Any) -> Any:
    from safetensors.torch import load_file

    model, state = _meta_model(folder), {}
    for shard in _shards(folder):
        state.update(load_file(str(shard)))
    return _assign(model, state)


def load_fastsafetensors(folder: Path, **_: Any) -> Any:
    from fastsafetensors import fastsafe_open

    model, state = _meta_model(folder), {}
    with fastsafe_open([str(p) for p in _shards(folder)], device="cpu", nogds=True) as f:
        for name in f.keys():  # noqa: SIM118  (not iterable itself)
            state[name] = f.get_tensor(name)
    return _assign(model, state)


def load_runai(folder: Path, url: str = "", **_: Any) -> Any:
    from runai_model_streamer import SafetensorsStreamer

    model, state = _meta_model(folder), {}
    names = [p.name for p in _shards(folder)]
    paths = [f"{url.rstrip('/')}/{n}" for n in names] if url else [str(folder / n)
                                                                  for n in names]
    with SafetensorsStreamer() as streamer:
        streamer.stream_files(paths)
        for name, tensor in streamer.get_tensors():
            state[name] = tensor.clone()  # the streamer reuses its buffers
    return _assign(model, state)


def load_s3_download(folder: Path, url: str = "", endpoint: str = "", **_: Any) -> Any:
    import boto3
    from boto3.s3.transfer import TransferConfig

    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    client = boto3.client("s3", endpoint_url=endpoint)
    config = TransferConfig(max_concurrency=8, multipart_chunksize=8 << 20)
    with tempfile.TemporaryDirectory(prefix="ember-peer-") as tmp:
        for path in [*folder.glob("*.json"), *_shards(folder)]:
            client.download_file(bucket, f"{prefix.rstrip('/')}/{path.name}",
                                 str(Path(tmp) / path.name), Config=config)
        return load_from_pretrained(Path(tmp))


def load_ember(folder: Path, url: str = "", options: dict[str, Any] | None = None,
               **_: Any) -> Any:
    from ember.deployments.causal_lm import load_causal_lm

    model, _report = load_causal_lm(url or folder.as_uri(), config=options or {})
    return model


def touch(model: Any) -> None:
    """Read one element of every page of every weight: a lazily mapped model (Ember's, and
    transformers 5's ``from_pretrained`` on safetensors) pays for its reads here, as a
    model that copied its weights already did."""
    for tensor in model.state_dict().values():
        tensor.view(-1)[:: max(1, 4096 // tensor.element_size())].float().sum()


LOADERS = {"from_pretrained": load_from_pretrained, "load_file": load_load_file,
           "fastsafetensors": load_fastsafetensors, "runai": load_runai,
           "s3_download+from_pretrained": load_s3_download, "ember": load_ember}


def handle(command: dict[str, Any]) -> dict[str, Any]:
    folder = Path(command["folder"])
    start = time.perf_counter()
    model = LOADERS[command["loader"]](folder, url=command.get("url", ""),
                                       endpoint=command.get("endpoint", ""),
                                       options=command.get("options"))
    loaded_s = time.perf_counter() - start
    touch(model)
    seconds = time.perf_counter() - start
    if command["loader"] == "ember":  # its node-cache write must not run into the next peer
        from ember.loaders import wait_for_cache_writes

        wait_for_cache_writes()
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    del model
    gc.collect()
    return {"seconds": seconds, "returned_s": loaded_s, "bytes": nbytes}


def main() -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    start = time.perf_counter()
    import transformers.models.llama.modeling_llama  # noqa: F401  (once, not timed per load)

    print(json.dumps({"ready": True, "import_s": time.perf_counter() - start}), flush=True)
    for line in sys.stdin:
        try:
            answer = handle(json.loads(line))
        except Exception as exc:  # reported in the results, not fatal to the run
            answer = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
        print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
