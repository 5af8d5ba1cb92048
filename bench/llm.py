"""Ember's engine on a ~140M-parameter Llama against ``model.generate()``, in one run, CPU.

The model is built here (``LlamaConfig``: 12 layers, hidden 768, vocab 32000; seeded random
weights) and saved once under ``~/.cache/ember-bench/llama-140m`` with a one-token-per-
character tokenizer, so it is a model directory ``EMBER_TEXTGEN_MODEL`` can name. Random
weights emit random tokens, so every request runs to its drawn ``max_tokens`` (EOS ignored).

Measured, on one torch thread (as a ``num_cpus=1`` replica), the same seeded requests
(prompts of 8-64 characters, outputs of 8-64 tokens) each way:

* ``continuous c=N``: Ember's engine, N closed-loop clients, each sending its next request
  when the last is answered; sequences join and leave the fused decode batch at every step.
* ``static c=16``: ``model.generate()`` on static batches of 16 of the same requests
  (left-padded, as Hugging Face batches them), each batch running to its longest request;
  only the tokens each request asked for are counted.
* ``transformers continuous c=16``: transformers' own continuous batching
  (``init_continuous_batching``: paged KV cache, its own scheduler thread) on the same
  requests, 16 in flight, the next added as one finishes.
* ``one at a time``: ``model.generate()`` on each request alone.
* ``prefix``: time to first token of a prompt after a new 1,000-token prefix (a miss: the
  whole prompt is computed), then of another prompt after the same prefix (a hit: its 62
  cached blocks are not computed again); one pair per round, a fresh prefix each.
* ``http``: the same requests through ``ember run``'s ``/v1/completions`` against the same
  engine in this process (``bench/_llm_http.py``): tokens/s at c=16 and the TTFT HTTP adds at
  c=1.

Continuous c=16 and static c=16 alternate for ``--rounds`` rounds; the median round of each
is reported with every round kept. Output tokens/s is tokens asked for over wall time. Each
continuous run records its ``anatomy`` (decode and prefill seconds, steps, and a decode
step's median cost at each batch size), each static run its steps and the token rows it
computed, padding included: where the ratio comes from.

* ``structured``: c=16 tokens/s with a JSON schema over without (``_llm_structured.py``).

Usage:
    .venv/bin/python bench/llm.py [--short] [--rounds 3] [--requests 32]
        [--only prefix,c16,sweep,structured,http]
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import _harness as h
import _llm_http
import _llm_structured
import torch

MODEL_DIR = Path.home() / ".cache" / "ember-bench" / "llama-140m"
PROMPT_LENGTHS = (8, 16, 32, 64)
OUTPUT_LENGTHS = (8, 16, 32, 64)
SECTIONS = ("prefix", "c16", "sweep", "structured", "http")
ALPHABET = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ.,;:()[]{}0123456789"


def build_model(path: Path = MODEL_DIR, **sizes: int) -> Path:
    """The seeded random Llama and its tokenizer, saved once (a model directory); ``sizes``
    override the ``LlamaConfig`` fields (a smaller model for another benchmark)."""
    if (path / "config.json").exists():
        return path
    import tokenizers
    import transformers

    vocab = {chr(i): i for i in range(32, 127)} | {"<eos>": 127}
    vocab |= {f"<t{i}>": i for i in range(128, 32000)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<eos>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    tok.decoder = tokenizers.decoders.Fuse()
    fast = transformers.PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, eos_token="<eos>")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{
        "vocab_size": 32000, "hidden_size": 768, "intermediate_size": 2304,
        "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 12,
        "max_position_embeddings": 2048, "bos_token_id": None, "eos_token_id": 127,
        "pad_token_id": 0, **sizes})
    model = transformers.LlamaForCausalLM(config)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return path


def workload(requests: int, seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    return [("".join(rng.choice(ALPHABET) for _ in range(rng.choice(PROMPT_LENGTHS))),
             rng.choice(OUTPUT_LENGTHS)) for _ in range(requests)]


def load() -> Any:
    from ember.deployments._textgen_hf import TransformersBackend

    backend = TransformersBackend.from_directory(build_model(), max_len=2048)
    backend.eos_token_id = None  # forced lengths
    return backend


async def continuous(backend: Any, work: list[tuple[str, int]], concurrency: int,
                     params: dict[str, Any] | None = None, **engine: Any) -> dict[str, Any]:
    """Closed-loop clients against Ember's engine; tokens/s and TTFT."""
    from ember.deployments._textgen_engine import Engine, EngineConfig
    from ember.deployments._textgen_sampling import SamplingParams

    eng = Engine(backend, EngineConfig(max_num_seqs=max(concurrency, 1),
                                       max_num_batched_tokens=65536,
                                       max_waiting_seqs=len(work), **engine))
    queue, ttft, tokens = list(work), list[float](), 0

    async def client() -> None:
        nonlocal tokens
        while queue:
            prompt, length = queue.pop(0)
            sent = time.perf_counter()
            sampling = SamplingParams(max_tokens=length, temperature=0, **(params or {}))
            async for chunk in eng.generate(backend.encode(prompt), sampling):
                if chunk.completion_tokens == len(chunk.token_ids):
                    ttft.append(time.perf_counter() - sent)
                tokens += len(chunk.token_ids)

    started = time.perf_counter()
    with StepClock(backend) as clock:
        await asyncio.gather(*(client() for _ in range(concurrency)))
    took = time.perf_counter() - started
    await eng.close()
    return {"name": f"continuous c={concurrency}", "requests": len(work), "tokens": tokens,
            "seconds": took, "tokens_per_s": tokens / took, "steps": eng.steps,
            "ttft_s": h.p50_p99(ttft), "anatomy": clock.summary()}


class StepClock:
    """Times the backend's decode and prefill forwards while a run lasts: where the run's
    time went, and what one decode step costs at each batch size."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.decode: list[tuple[int, float]] = []  # (rows, seconds) per step
        self.prefill: list[tuple[int, int, float]] = []  # (prompts, tokens, seconds) per call

    def __enter__(self) -> StepClock:
        decode, prefill = self.backend.decode, self.backend.prefill_many

        def timed_decode(slots: list[int], *args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            out = decode(slots, *args, **kwargs)
            self.decode.append((len(slots), time.perf_counter() - started))
            return out

        def timed_prefill(slots: list[int], prompts: list[list[int]], **kwargs: Any) -> Any:
            started = time.perf_counter()
            out = prefill(slots, prompts, **kwargs)
            self.prefill.append((len(prompts), sum(map(len, prompts)),
                                 time.perf_counter() - started))
            return out

        self.backend.decode, self.backend.prefill_many = timed_decode, timed_prefill
        return self

    def __exit__(self, *exc: object) -> None:
        del self.backend.decode, self.backend.prefill_many  # the class's methods again

    def summary(self) -> dict[str, Any]:
        by_rows: dict[int, list[float]] = {}
        for rows, seconds in self.decode:
            by_rows.setdefault(rows, []).append(seconds)
        return {
            "decode_s": round(sum(s for _, s in self.decode), 3),
            "decode_steps": len(self.decode),
            "decode_rows": sum(r for r, _ in self.decode),
            "prefill_s": round(sum(s for *_, s in self.prefill), 3),
            "prefill_calls": len(self.prefill),
            "prefill_tokens": sum(t for _, t, _ in self.prefill),
            "decode_ms_by_rows": {str(r): round(1000 * statistics.median(v), 1)
                                  for r, v in sorted(by_rows.items())},
        }


def hf_continuous(backend: Any, work: list[tuple[str, int]], concurrency: int
                  ) -> dict[str, Any]:
    """transformers' own continuous batching (``init_continuous_batching``: a paged KV cache
    and its scheduler in a thread), as its users drive it: ``concurrency`` requests in
    flight, the next one added as one finishes, each with its own ``max_new_tokens``."""
    from transformers import GenerationConfig

    model = backend.model
    attention = model.config._attn_implementation
    config = GenerationConfig(do_sample=False, max_new_tokens=max(OUTPUT_LENGTHS),
                              eos_token_id=-1)  # -1: no EOS, every request runs its length
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    used = model.config._attn_implementation  # what the manager runs with (it may switch)
    queue, sent, tokens, asked = list(work), set[str](), 0, 0
    try:
        started = time.perf_counter()

        def submit() -> None:
            nonlocal asked
            prompt, length = queue.pop(0)
            asked += length
            rid = manager.add_request(backend.encode(prompt), max_new_tokens=length,
                                      eos_token_id=-1)
            sent.add(str(rid))

        for _ in range(min(concurrency, len(queue))):
            submit()
        while sent:
            result = manager.get_result(timeout=120)
            if result is None:
                raise RuntimeError("transformers' continuous batching returned nothing in 120 s")
            if result.is_finished():
                if result.error:
                    raise RuntimeError(f"transformers' continuous batching: {result.error}")
                sent.remove(result.request_id)
                tokens += len(result.generated_tokens)
                if queue:
                    submit()
        took = time.perf_counter() - started
    finally:
        manager.stop(block=True)
        if hasattr(model, "destroy_cached_continuous_batching_manager"):
            model.destroy_cached_continuous_batching_manager()
        if model.config._attn_implementation != attention:  # for Ember's engine after it
            model.set_attn_implementation(attention)
    if tokens != asked:
        raise RuntimeError(f"transformers' continuous batching gave {tokens} of {asked} tokens")
    return {"name": f"transformers continuous c={concurrency}", "requests": len(work),
            "tokens": tokens, "seconds": took, "tokens_per_s": tokens / took,
            "attention": used}


@torch.inference_mode()
def static(backend: Any, work: list[tuple[str, int]], batch: int) -> dict[str, Any]:
    """``generate()`` on static, left-padded batches: each runs to its longest request."""
    model, tokens, started = backend.model, 0, time.perf_counter()
    steps = computed = 0
    for i in range(0, len(work), batch):
        group = work[i:i + batch]
        ids = [backend.encode(p) for p, _ in group]
        width = max(map(len, ids))
        input_ids = torch.tensor([[0] * (width - len(x)) + x for x in ids])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        longest = max(n for _, n in group)
        model.generate(input_ids, attention_mask=mask, max_new_tokens=longest,
                       min_new_tokens=longest, do_sample=False, pad_token_id=0)
        tokens += sum(n for _, n in group)
        steps += longest
        computed += len(group) * (width + longest)
    took = time.perf_counter() - started
    return {"name": f"generate static batch={batch}", "requests": len(work),
            "tokens": tokens, "seconds": took, "tokens_per_s": tokens / took,
            # Forwards over the batch, and the token rows they computed, padding included.
            "steps": steps, "rows_computed": computed}


async def prefix_ttft(backend: Any, rounds: int, prefix_tokens: int,
                      seed: int) -> dict[str, Any]:
    """TTFT of a prompt whose ``prefix_tokens``-token prefix is new (miss), then of another
    prompt with the same prefix (hit), ``rounds`` pairs; each pair a fresh prefix."""
    from ember.deployments._textgen_engine import Engine, EngineConfig
    from ember.deployments._textgen_sampling import SamplingParams

    eng = Engine(backend, EngineConfig(max_num_seqs=1, max_num_batched_tokens=65536))
    rng, out = random.Random(seed), {"miss_ttft_s": list[float](), "hit_ttft_s": list[float]()}
    for _ in range(rounds):
        prefix = "".join(rng.choice(ALPHABET) for _ in range(prefix_tokens))
        for kind, question in (("miss", " first question?"), ("hit", " another one?")):
            sent = time.perf_counter()
            async for _chunk in eng.generate(backend.encode(prefix + question),
                                             SamplingParams(max_tokens=1, temperature=0)):
                out[f"{kind}_ttft_s"].append(time.perf_counter() - sent)
            print(f"prefix {kind}: {out[f'{kind}_ttft_s'][-1]:.3f} s", flush=True)
    await eng.close()
    ratios = [hit / miss for hit, miss in zip(out["hit_ttft_s"], out["miss_ttft_s"],
                                              strict=True)]
    return {"hit_ttft_s": statistics.median(out["hit_ttft_s"]),
            "miss_ttft_s": statistics.median(out["miss_ttft_s"]),
            "hit_over_miss": {"median": statistics.median(ratios), "rounds": ratios},
            "prefix_tokens": prefix_tokens, "rounds": out}


def median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    if not rounds:  # the section was not run (--only) or failed
        return {}
    ordered = sorted(rounds, key=lambda r: r["tokens_per_s"])
    spread = [r["tokens_per_s"] for r in rounds]
    return {**ordered[len(ordered) // 2], "rounds": rounds,
            "tokens_per_s_min_max": [min(spread), max(spread)]}


def ratio_spread(num: list[dict[str, Any]], den: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-round ratios (round i of each), their median and range."""
    ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(num, den, strict=False)]
    return {"median": statistics.median(ratios) if ratios else None, "rounds": ratios}


def kept_sections(out: dict[str, Any], only: set[str], short: bool) -> dict[str, Any]:
    """``out`` with the sections this run skipped (``--only``) taken from the results file.

    Each section compares Ember with its peer inside its own run; ``sections_run_at`` says
    when each was measured, so a file whose sections come from different runs says so.
    """
    path = h.RESULTS_DIR / f"llm{'.short' if short else ''}.json"
    old = json.loads(path.read_text()) if path.exists() and only != set(SECTIONS) else {}
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    run_at = dict(old.get("sections_run_at", {}))
    for name in SECTIONS:
        if name in only:
            run_at[name] = now
        elif name in old:
            out[name] = old[name]
    return {**out, "sections_run_at": run_at}


def ratios_of(out: dict[str, Any]) -> dict[str, Any]:
    sweep = out.get("sweep") or {}
    one = sweep.get("one_at_a_time", {}).get("tokens_per_s")
    return {
        "c16_continuous_over_static": out["c16"]["ratio"]["median"],
        "c16_continuous_over_hf_continuous": (out["c16"].get("ratio_over_hf_continuous")
                                              or {}).get("median"),
        "prefix_hit_over_miss_ttft": (out.get("prefix") or {}).get("hit_over_miss", {}).get(
            "median"),
        "c16_continuous_over_one_at_a_time": h.ratio(out["c16"]["continuous_tps"], one),
        **{f"{k}_over_one_at_a_time": h.ratio(v["tokens_per_s"], one)
           for k, v in sweep.items() if k.startswith("c")},
        "structured_ratio": out.get("structured_ratio"),
        "http_over_inprocess_tps": ((out.get("http") or {}).get("http_over_inprocess_tps")
                                    or {}).get("median"),
    }


def main() -> int:
    parser = h.parser(__doc__, deadline_s=1500)
    parser.add_argument("--requests", type=int, help="requests per c=16 run (32; short 16)")
    parser.add_argument("--rounds", type=int, help="rounds of continuous/static (3; short 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default=",".join(SECTIONS),
                        help=f"comma-separated sections to run, of {','.join(SECTIONS)}")
    args = h.pick(parser.parse_args(), requests=(32, 16), rounds=(3, 1))
    torch.set_num_threads(1)
    errors: list[str] = []
    out: dict[str, Any] = {}
    backend = load()
    out["model_params"] = sum(p.numel() for p in backend.model.parameters())
    work = workload(args.requests, args.seed)
    rounds: dict[str, list[dict[str, Any]]] = {"continuous": [], "static": [],
                                               "hf_continuous": []}
    sweep: dict[str, Any] = {}
    only = set(args.only.split(","))
    with h.deadline_run(args.deadline_s, errors) as deadline:
        def prefix() -> None:
            out["prefix"] = asyncio.run(prefix_ttft(backend, args.rounds, 1000, args.seed))
        if "prefix" in only:
            h.section("prefix", errors, prefix)
        for i in range(args.rounds if "c16" in only else 0):
            def pair() -> None:
                rounds["continuous"].append(asyncio.run(continuous(backend, work, 16)))
                rounds["static"].append(static(backend, work, 16))
                rounds["hf_continuous"].append(hf_continuous(backend, work, 16))
                print(f"round {len(rounds['static'])}: continuous "
                      f"{rounds['continuous'][-1]['tokens_per_s']:.1f} tokens/s, static "
                      f"{rounds['static'][-1]['tokens_per_s']:.1f}, transformers continuous "
                      f"{rounds['hf_continuous'][-1]['tokens_per_s']:.1f}", flush=True)
            h.section(f"c16 round {i}", errors, pair)
        for c in (1, 8, 32) if "sweep" in only else ():
            def one(c: int = c) -> None:
                n = max(4, min(len(work), 2 * c))
                sweep[f"c{c}"] = asyncio.run(continuous(backend, work[:n], c))
                print(f"continuous c={c}: {sweep[f'c{c}']['tokens_per_s']:.1f} tokens/s",
                      flush=True)
            h.section(f"c{c}", errors, one)
        if "structured" in only:
            h.section("structured", errors, lambda: out.update(
                structured=_llm_structured.measure(backend, work, args.rounds, continuous)))

        def alone() -> None:
            sweep["one_at_a_time"] = static(backend, work[:4], 1)
            print(f"one at a time: {sweep['one_at_a_time']['tokens_per_s']:.1f} tokens/s")
        if "sweep" in only:
            h.section("one at a time", errors, alone)

        def http() -> None:
            out["http"] = _llm_http.measure(MODEL_DIR, work, args.rounds, deadline, errors)
        if "http" in only:
            h.section("http", errors, http)
    cont, stat = median_round(rounds["continuous"]), median_round(rounds["static"])
    hf = median_round(rounds["hf_continuous"])
    out["c16"] = {"continuous_tps": cont.get("tokens_per_s"),
                  "static_tps": stat.get("tokens_per_s"),
                  "ratio": ratio_spread(rounds["continuous"], rounds["static"]),
                  "continuous": cont, "static": stat,
                  # transformers' own continuous batching, the engine the issue asked to use
                  # where it measures well: Ember's engine over it, round by round.
                  "hf_continuous_tps": hf.get("tokens_per_s"), "hf_continuous": hf,
                  "ratio_over_hf_continuous": ratio_spread(rounds["continuous"],
                                                           rounds["hf_continuous"])}
    out["sweep"] = sweep
    out.setdefault("http", None)
    out = kept_sections(out, only, args.short)
    out["structured_ratio"] = (out.get("structured") or {}).get("structured_ratio")
    out["ratios"] = ratios_of(out)
    print(out["ratios"], flush=True)
    h.write_results("llm", {"complete": not errors, "errors": errors, **out,
                            "config": {"requests": args.requests, "rounds": args.rounds,
                                       "prompt_lengths": PROMPT_LENGTHS,
                                       "output_lengths": OUTPUT_LENGTHS, "seed": args.seed,
                                       "torch_threads": 1, "model_dir": str(MODEL_DIR)}},
                    short=args.short)
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
