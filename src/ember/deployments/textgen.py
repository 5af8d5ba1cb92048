"""Text generation with continuous batching, served as OpenAI's completions and chat APIs.

Serve it with ``ember run ember.deployments.textgen:app``:

* ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream`` true or false,
  ``max_tokens``, ``n``, ``temperature``, ``top_p``, ``seed``, ``stop``,
  ``stream_options.include_usage``; ``X-Ember-Priority`` and ``X-Ember-Timeout-S``, see
  ``docs/generation-admission.md``); ``GET /v1/models`` lists the model. The official
  ``openai`` client works unchanged.
* ``POST /generate`` is the deployment's own streaming route (server-sent events).

The model is Ember's own ``ember-tinylm-byte``: a 0.8M-parameter byte-level transformer
trained for five minutes on Python's documentation (``bench/train_textgen.py``), shipped in
the package and loaded through ``ember.loaders`` by a ``file://`` URL. It is small and its
text is only Python-doc-flavoured babble; the serving around it is the real thing.
``EMBER_TEXTGEN_MODEL=/models/qwen`` (a local ``transformers`` model directory, or an
``hf://org/name`` entry already in the Hugging Face cache; nothing is downloaded) gives the
same engine and routes a real model, named after its directory or repository; in code,
``Generator(load_backend(dir), ENGINE)`` does the same in a deployment of your own.
``EMBER_TEXTGEN_ADAPTERS=sql=s3://bucket/sql-lora,...`` serves LoRA adapters over that
model, each a ``model`` of its own (``docs/lora.md``).
"""

from __future__ import annotations

import asyncio
import importlib
import threading
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import torch
from ray import serve

import ember
from ember import loaders, settings
from ember.deployments._textgen_admission import BATCH
from ember.deployments._textgen_backend import Backend, TinyLMBackend
from ember.deployments._textgen_engine import Engine, EngineConfig
from ember.deployments._textgen_grammar import token_bytes, tokenizer_for
from ember.deployments._textgen_logprobs import describe
from ember.deployments._textgen_lora import AdapterStore, LoraAdapters, fetch
from ember.deployments._textgen_sampling import SamplingParams
from ember.deployments._tinylm import TinyLMConfig, build
from ember.edge.protocols.openai_structured import grammar_of
from ember.errors import BadRequest, ConfigError, InvalidBody, ModelNotFound
from ember.protocols import GenerateRequest, OpenAIGeneration

MODEL_NAME = "ember-tinylm-byte"
MODEL_DIR = Path(__file__).resolve().parent / "textgen_model"
CODE_VERSION = f"tinylm-1/ember-{ember.__version__}"


def is_weights_url(model: str) -> bool:
    """Whether ``model`` names weights for ``ember.loaders`` (``file://``, ``s3://``,
    ``https://``, ...) rather than a local directory or an ``hf://`` cache entry.

    Example:
        >>> [is_weights_url(m) for m in ("s3://b/llama/", "/models/qwen", "hf://org/tiny")]
        [True, False, False]
    """
    return "://" in model and not model.startswith("hf://")


def load_backend(model: str | None = None, *, slots: int = 0) -> Backend:
    """The shipped TinyLM, or the ``transformers`` causal LM at ``model``: a weights URL
    (through the node cache, the regional tier and the node's snapshot, with the weights
    mapped rather than copied), a local directory, or ``hf://org/name[@revision]`` already
    in the Hugging Face cache. ``slots``: the sequences its engine runs at once, whose KV
    caches a URL model's fit check counts beside its weights.

    Raises:
        WeightsError: the weights cannot be read or do not fit their config.
        InsufficientMemory: a URL's weights and KV caches do not fit in the node's free
            memory (503).
        OSError: ``model`` is not on this machine (nothing is downloaded).
    """
    if model is None:
        url = (MODEL_DIR / "model.safetensors").as_uri()
        state = loaders.snapshot_load(url, code_version=CODE_VERSION).tensors
        return TinyLMBackend(build(state, TinyLMConfig.from_file(MODEL_DIR / "config.json")))
    if model.startswith("hf://"):
        from huggingface_hub import snapshot_download

        repo, _, revision = model.removeprefix("hf://").partition("@")
        model = snapshot_download(repo, revision=revision or None, local_files_only=True)
    from ember.deployments._textgen_hf import TransformersBackend

    if is_weights_url(model):
        return TransformersBackend.from_url(model, slots=slots)
    return TransformersBackend.from_directory(model)


def served_model() -> tuple[str | None, str]:
    """Where the app's model is (None: the shipped TinyLM) and the name clients call it by,
    from ``EMBER_TEXTGEN_MODEL``: ``hf://org/tiny@main`` is called ``org/tiny``, a directory
    or a weights URL by its folder's name (``s3://b/llama-1b/`` is ``llama-1b``)."""
    model = settings.load().textgen_model
    if model is None:
        return None, MODEL_NAME
    if model.startswith("hf://"):
        return model, model.removeprefix("hf://").partition("@")[0]
    path = Path(model.partition("://")[2] if is_weights_url(model) else model)
    if path.suffix in (".json", ".safetensors"):  # the URL names the index or the file
        path = path.parent
    return model, path.name


def replica_bounds(config: settings.Settings | None = None) -> tuple[int, int]:
    """TextGen's warm floor and most replicas, from ``EMBER_TEXTGEN_WARM_FLOOR`` and
    ``EMBER_TEXTGEN_MAX_REPLICAS`` (defaults 0 and 1: one replica, scaled to zero).

    Raises:
        ConfigError: the floor is above the most replicas (both variables named).
    """
    config = config or settings.load()
    floor, most = config.textgen_warm_floor, config.textgen_max_replicas
    if floor > most:
        raise ConfigError(f"{settings.variable('textgen_warm_floor')}={floor} is above "
                          f"{settings.variable('textgen_max_replicas')}={most}")
    return floor, most


def chat_prompt(messages: list[Any]) -> str:
    """The plain-text chat template of the byte model: one ``role: content`` line per turn."""
    turns = [f"{m.role}: {m.content}" for m in messages]
    return "\n".join([*turns, "assistant:"])


#: How long a replica's engine must have been idle before the grammar tokenizer is built.
GRAMMAR_AFTER_IDLE_S = 1.0


class Generator:
    """The replica's side of generation: one engine, requests in, chunks out.

    ``adapters`` (name to URL) are LoRA adapters requests may name; at most ``max_adapters``
    stay loaded, and a request holds its adapter until its stream ends.
    """

    def __init__(self, backend: Backend, config: EngineConfig, *,
                 adapters: Mapping[str, str] | None = None, max_adapters: int = 4) -> None:
        self.backend = backend
        self.engine = Engine(backend, config)
        self.adapters = dict(adapters or {})
        lora = getattr(backend, "lora", None)
        if self.adapters and not isinstance(lora, LoraAdapters):
            raise ConfigError("LoRA adapters need a transformers model (EMBER_TEXTGEN_MODEL)")
        self.lora = lora
        self.store = AdapterStore[str](max_adapters, load=self._load_adapter,
                                       unload=lambda name, _: self._lora().remove(name))

    def _lora(self) -> LoraAdapters:
        if not isinstance(self.lora, LoraAdapters):
            raise BadRequest("this model serves no LoRA adapters", param="model")
        return self.lora

    def _load_adapter(self, name: str) -> str:
        """Fetch ``name`` through the caches, check it fits the base, put it in."""
        files = fetch(self.adapters[name])
        self._lora().check(name, files)
        self._lora().add(name, files)
        return name

    async def acquire(self, name: str) -> float | None:
        """Hold adapter ``name`` (loading it if needed); the load's seconds if it was cold.

        Raises:
            ModelNotFound: no adapter of that name is configured (404).
            BadRequest: the adapter does not fit the base (400; nothing was evicted).
        """
        if name not in self.adapters:
            raise ModelNotFound(model=name, param="model")
        _, cold = await asyncio.to_thread(self.store.acquire, name)
        return cold

    def prompt_of(self, body: GenerateRequest) -> list[int]:
        if (body.prompt is None) == (body.messages is None):
            raise InvalidBody("give either prompt or messages", param="prompt")
        if body.prompt is not None:
            return self.backend.encode(body.prompt)
        tokenizer = getattr(self.backend, "tokenizer", None)
        if tokenizer is not None and tokenizer.chat_template:
            # a transformers model with its own chat template
            turns = [m.model_dump(exclude_none=True) for m in body.messages or []]
            return list(tokenizer.apply_chat_template(turns, add_generation_prompt=True))
        return self.backend.encode(chat_prompt(body.messages or []))

    async def stream(self, body: GenerateRequest) -> AsyncIterator[dict[str, Any]]:
        prompt, adapter = self.prompt_of(body), body.adapter
        cold = await self.acquire(adapter) if adapter is not None else None
        try:
            async for chunk in self._chunks(body, prompt, adapter):
                if cold is not None:  # the first chunk tells the edge about the cold load
                    chunk, cold = {**chunk, "adapter_load_s": cold}, None
                yield chunk
        finally:
            if adapter is not None:
                await asyncio.to_thread(self.store.release, adapter)

    async def _chunks(self, body: GenerateRequest, prompt: list[int],
                      adapter: str | None) -> AsyncIterator[dict[str, Any]]:
        # No max_tokens: the room the prompt leaves (at least 1, so a prompt with none left
        # is refused naming max_tokens and the limit).
        limit = body.max_tokens or max(1, self.engine.room(len(prompt), body.n))
        if body.response_format is not None or body.logprobs is not None:
            # Built (or waited for) on a thread: on the loop it would stop every stream.
            await asyncio.to_thread(tokenizer_for, self.backend)
        params = SamplingParams(max_tokens=limit, temperature=body.temperature,
                                top_p=body.top_p, seed=body.seed, stop=tuple(body.stop),
                                ignore_eos=body.ignore_eos, logprobs=body.logprobs,
                                grammar=grammar_of(body.response_format))
        priority = BATCH if body.priority == "batch" else body.priority
        async for chunk in self.engine.generate(prompt, params, n=body.n, priority=priority,
                                                timeout_s=body.timeout_s, adapter=adapter):
            out = {"text": chunk.text, "tokens": len(chunk.token_ids),
                   "finish_reason": chunk.finish_reason, "prompt_tokens": chunk.prompt_tokens,
                   "completion_tokens": chunk.completion_tokens,
                   "cached_tokens": chunk.cached_tokens, "running": chunk.running,
                   "waiting": chunk.waiting, "index": chunk.index}
            if body.logprobs is not None:
                out["logprobs"] = describe(chunk.logprobs, self._token_bytes)
            yield out

    def _token_bytes(self, token: int) -> bytes:
        return token_bytes(tokenizer_for(self.backend), token)

    def warmup(self) -> None:
        """Pay the process's one-time costs before the first request; the grammar tokenizer
        is built beside, later.

        A warm-up prefill and decode step is a forward pass over every weight, twice, and a
        request waiting at zero waits for it: on CPU, about half a second of a 2 GB model's
        cold start (``bench/textgen_coldstart.py``). In a process set up as a warm-runtime
        worker is, which ran torch's operators when it started (``control/torch_warm``), the
        first prefill and decode take as long as the next ones
        (``bench/textgen_first_prefill.py``), so on CPU that exercise runs here instead
        (once per process, on tiny tensors; a replica in a fresh process gets it too). On an
        accelerator the forward pass stays: it is cheap there, and it creates the device's
        kernels and library handles before the replica takes traffic.

        Structured output and logprobs need the model's llguidance tokenizer, a walk of the
        whole vocabulary in Python that grows with it. Built on the replica's start, every
        cold start waited for it, structured or not; built on a thread at once, it held the
        GIL while the cold request that started the replica was routed and prefilled, so
        the thread waits until the engine has been idle for :data:`GRAMMAR_AFTER_IDLE_S`; a
        structured request that comes sooner builds it (or waits for the build in flight).
        """
        if _on_accelerator(self.backend):
            self.backend.prefill(0, self.backend.encode("warm up"))
            self.backend.decode([0], [32])
            self.backend.free(0)
        else:
            importlib.import_module("ember.control.torch_warm")
        threading.Thread(target=self._grammar_when_idle, daemon=True,
                         name="ember-grammar-tokenizer").start()

    def _grammar_when_idle(self) -> None:
        quiet_since: float | None = None
        while quiet_since is None or time.monotonic() - quiet_since < GRAMMAR_AFTER_IDLE_S:
            busy = self.engine.running or self.engine.waiting
            quiet_since = None if busy else quiet_since or time.monotonic()
            time.sleep(0.1)
        tokenizer_for(self.backend)


def _on_accelerator(backend: Backend) -> bool:
    """Whether ``backend``'s weights are on a device other than the CPU."""
    model = getattr(backend, "model", None)
    first = next(model.parameters(), None) if isinstance(model, torch.nn.Module) else None
    return first is not None and first.device.type != "cpu"


#: Engine limits of one replica: 16 sequences in the batch, 64 waiting, then 503.
ENGINE = EngineConfig(max_num_seqs=16, max_num_batched_tokens=8192, max_waiting_seqs=64,
                      name="TextGen")


#: TextGen's warm floor and most replicas (read where the app is built).
WARM_FLOOR, MAX_REPLICAS = replica_bounds()


# max_ongoing_requests covers the running batch and the engine's waiting line, so the engine
# decides admission (503 with Retry-After) and Ray's own queue only holds the overflow.
# With more than one replica, prompts sharing a prefix go where its blocks are cached and
# requests for a LoRA adapter where it is loaded (ember.control.prefix_routing).
@ember.deployment(name="TextGen", warm_floor=WARM_FLOOR, max_replicas=MAX_REPLICAS,
                  num_cpus=1, router="prefix", max_ongoing_requests=96, max_queue=64,
                  target_queue_depth=64, scaledown_after_s=300, request_timeout_s=300)
class TextGen:
    """One continuous-batching engine per replica."""

    def setup(self) -> None:
        config = settings.load()
        self.generator = Generator(load_backend(served_model()[0], slots=ENGINE.max_num_seqs),
                                   ENGINE,
                                   adapters=config.textgen_adapters,
                                   max_adapters=config.textgen_max_adapters)

    def warmup(self) -> None:
        self.generator.warmup()

    # Ray Serve's model multiplexing: the replica reports the adapters it was asked for, and
    # the edge's handle (``multiplexed_model_id``) sends a request naming one to a replica
    # that has it. The generator's store does the loading: a request holds its adapter for
    # its whole stream, which Serve's own cache cannot know.
    @serve.multiplexed(  # type: ignore[untyped-decorator]  # Ray's decorator is untyped
        max_num_models_per_replica=settings.load().textgen_max_adapters)
    async def adapter_id(self, name: str) -> str:
        return name

    @ember.route("/generate")
    async def generate(self, body: GenerateRequest) -> AsyncIterator[dict[str, Any]]:
        if body.adapter is not None:
            # What Serve routed the request by (the edge sets it for an adapter); a call of
            # the native route that names an adapter in its body has none.
            await self.adapter_id(serve.get_multiplexed_model_id() or body.adapter)
        async for chunk in self.generator.stream(body):
            yield chunk


def _preload_modules() -> tuple[str, ...]:
    """What the warm runtime's workers import for this app, so that a cold replica (or a
    cold adapter) does not: a transformers model's backend, with transformers' model code,
    and peft when adapters are served. The shipped TinyLM needs neither."""
    config = settings.load()
    hf = ("ember.deployments._textgen_hf",) if config.textgen_model is not None else ()
    return (*hf, "peft") if hf and config.textgen_adapters else hf


app = ember.App(
    [TextGen],
    name="textgen",
    preload_modules=_preload_modules(),
    protocols=[OpenAIGeneration(deployment="TextGen", attr="generate",
                                model=served_model()[1],
                                adapters=tuple(settings.load().textgen_adapters))],
    curl=("curl -sN {url}/v1/completions -H 'content-type: application/json' -d "
          "'{{\"model\": \"ember-tinylm-byte\", \"prompt\": \"Return the\", \"max_tokens\": 32, "
          "\"stream\": true}}'"),
)
