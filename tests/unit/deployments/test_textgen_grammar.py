"""Constrained decoding and logprobs in the engine: the mask, the tokenizers llguidance reads,
the finish at a complete grammar, and the log-probabilities of what was sampled from."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
from typing import Any

import jsonschema
import llguidance
import pytest
import torch

from ember.deployments._textgen_backend import TinyLMBackend
from ember.deployments._textgen_engine import Engine, EngineConfig
from ember.deployments._textgen_grammar import (
    Constraint,
    byte_tokenizer,
    constrain,
    constraint_for,
    tokenizer_for,
)
from ember.deployments._textgen_logprobs import FLOOR, describe, logprob_of
from ember.deployments._textgen_sampling import SamplingParams
from ember.deployments._tinylm import EOS
from ember.deployments.textgen import load_backend
from ember.edge.protocols.openai_structured import COMPACT_JSON
from ember.errors import BadRequest

from support import char_llama

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "maxItems": 3,
                                  "items": {"type": "string", "maxLength": 10}}}}


def grammar(schema: dict[str, Any]) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=COMPACT_JSON)


def allowed(logits: torch.Tensor) -> list[int]:
    return [int(i) for i in torch.isfinite(logits).nonzero().flatten()]


def test_the_mask_lets_through_only_what_the_grammar_allows_next() -> None:
    c = Constraint(byte_tokenizer(), grammar({"type": "boolean"}))
    masked = constrain(torch.zeros(1, 258), [c])[0]
    assert allowed(masked) == [ord("f"), ord("t")]
    for token in b"tru":
        assert not c.advance(token)
    assert allowed(constrain(torch.zeros(1, 258), [c])[0]) == [ord("e")]
    assert c.advance(ord("e"))  # the grammar is complete: the sequence ends here


def test_only_constrained_rows_are_masked_and_extra_vocabulary_is_forbidden() -> None:
    c = Constraint(byte_tokenizer(), grammar({"type": "null"}))
    logits = torch.randn(3, 300)  # wider than the 258 tokens the tokenizer knows
    masked = constrain(logits, [None, c, None])
    assert torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])
    assert allowed(masked[1]) == [ord("n")]
    assert constrain(logits, [None, None, None]) is logits  # nothing to do: no copy


def test_a_grammar_that_does_not_compile_is_a_400_naming_response_format() -> None:
    backend = load_backend()
    with pytest.raises(BadRequest) as caught:
        constraint_for(backend, '{"grammars": [{"lark_grammar": "start: ("}]}')
    assert caught.value.fields["param"] == "response_format"
    assert constraint_for(backend, None) is None


Result = tuple[str, str | None, list[Any]]


def run(backend: Any, requests: list[tuple[str, SamplingParams]],
        max_num_seqs: int = 8) -> list[Result]:
    """Text, finish reason and logprob entries of each request, all in one engine's batch."""

    async def one(engine: Engine, prompt: str, params: SamplingParams) -> Result:
        text, finish, lps = "", None, []
        async for chunk in engine.generate(backend.encode(prompt), params):
            text, finish = text + chunk.text, chunk.finish_reason
            lps += chunk.logprobs
            assert len(chunk.logprobs) == (len(chunk.token_ids) if params.logprobs is not None
                                           else 0)
        return text, finish, lps

    async def go() -> list[Result]:
        engine = Engine(backend, EngineConfig(max_num_seqs=max_num_seqs))
        try:
            return list(await asyncio.gather(*(one(engine, p, s) for p, s in requests)))
        finally:
            await engine.close()

    return asyncio.run(go())


def test_schema_outputs_parse_and_validate_mixed_with_free_rows_in_one_batch() -> None:
    schema = grammar(PERSON)
    results = run(load_backend(), [("user: hi\n", SamplingParams(
        max_tokens=300, temperature=1.0, seed=s, grammar=schema if s % 2 == 0 else None))
        for s in range(8)])
    for text, finish, _ in results[0::2]:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), PERSON)
    assert any(_not_json(text) for text, _, _ in results[1::2])  # the free rows stayed free


def _not_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return True
    return False


def test_greedy_logprobs_are_the_masked_softmax_and_skip_forbidden_tokens() -> None:
    logits = torch.tensor([2.0, 1.0, float("-inf"), 0.0])
    entry = logprob_of(logits, 0, SamplingParams(temperature=0), top=4)
    expected = torch.log_softmax(logits, dim=-1)
    assert entry.logprob == pytest.approx(float(expected[0]))
    assert [t for t, _ in entry.top] == [0, 1, 3]  # the masked token is not an alternative
    assert logprob_of(logits, 2, SamplingParams(temperature=0), top=0).logprob == FLOOR


def test_sampled_logprobs_follow_temperature_and_the_nucleus() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0])
    hot = logprob_of(logits, 1, SamplingParams(temperature=2.0), top=1)
    assert hot.logprob == pytest.approx(float(torch.log_softmax(logits / 2, dim=-1)[1]))
    # top_p=0.5 keeps the first token alone: it is drawn with probability 1.
    cut = logprob_of(logits, 0, SamplingParams(temperature=1.0, top_p=0.5), top=2)
    assert cut.logprob == pytest.approx(0.0) and [t for t, _ in cut.top] == [0]


def test_engine_logprobs_match_the_distribution_each_token_was_drawn_from() -> None:
    (text, _, lps), (_, finish, first) = run(load_backend(), [
        ("Return the", SamplingParams(max_tokens=6, temperature=0, logprobs=3)),
        ("x", SamplingParams(max_tokens=8, temperature=0, logprobs=5,
                             grammar=grammar({"type": "boolean"})))])
    assert len(lps) == 6 and all(len(e.top) == 3 for e in lps)
    for e in lps:  # greedy: the chosen token is the best alternative
        assert e.top[0] == (e.token, pytest.approx(e.logprob))
        assert sum(math.exp(v) for _, v in e.top) <= 1.0 + 1e-5
    described = describe(lps, lambda t: bytes([t]) if t < 256 else b"")
    assert "".join(d["token"] for d in described) == text
    assert described[0]["bytes"] == list(text[0].encode())
    # Under a grammar the first token of a boolean is f or t: nothing else has probability.
    assert finish == "stop" and {t for t, _ in first[0].top} == {ord("f"), ord("t")}
    assert math.exp(first[0].top[0][1]) + math.exp(first[0].top[1][1]) == pytest.approx(1.0)


def test_the_byte_tokenizer_is_the_tinylms_vocabulary() -> None:
    tok = tokenizer_for(load_backend())
    assert tok.vocab_size == 258 and tok.eos_token == EOS
    assert tok.decode_bytes([104, 105]) == b"hi" and tok.is_special_token(EOS)
    assert isinstance(load_backend(), TinyLMBackend)


@pytest.mark.slow
def test_a_transformers_model_follows_a_schema(tmp_path: Any) -> None:
    """A tokenizer llguidance.hf cannot read (a character-level WordLevel one) goes through
    the per-token fallback; the random model's output still validates."""
    hf = pytest.importorskip("ember.deployments._textgen_hf")
    backend = hf.TransformersBackend.from_directory(char_llama(tmp_path), max_len=512)
    tok = tokenizer_for(backend)
    assert tok.decode_bytes([ord("a"), ord("{")]) == b"a{" and tok.eos_token == 127
    for text, finish, lps in run(backend, [("hello", SamplingParams(
            max_tokens=400, temperature=1.0, seed=seed, grammar=grammar(PERSON), logprobs=1))
            for seed in range(3)]):
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), PERSON)
        assert "".join(d["token"] for d in describe(
            lps, lambda t: tok.decode_bytes([t]))).startswith(text)


@pytest.mark.slow
def test_a_byte_level_bpe_tokenizer_goes_through_llguidance_hf() -> None:
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(["hello world, a JSON object {\"name\": \"x\"}"] * 20,
                            vocab_size=300, special_tokens=["<|end|>"])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer,
                                                eos_token="<|end|>")

    class Backend:
        tokenizer = fast

    tok = tokenizer_for(Backend())  # type: ignore[arg-type]
    ids = fast("hello world")["input_ids"]
    assert tok.decode_bytes(ids) == b"hello world"
    c = Constraint(tok, grammar({"type": "boolean"}))
    assert c.matcher.consume_tokens(fast("true")["input_ids"]) and c.matcher.is_stopped()


def test_a_complete_grammar_finishes_the_sequence_without_an_eos() -> None:
    """A model without an EOS token (or one told to ignore it) still stops at the end of
    its grammar, not at max_tokens."""
    backend = load_backend()
    backend.eos_token_id = None
    boolean = grammar({"type": "boolean"})
    results = run(backend, [("x", SamplingParams(max_tokens=50, temperature=0, grammar=boolean)),
                            ("y", SamplingParams(max_tokens=50, temperature=1.0, seed=1,
                                                 ignore_eos=True, grammar=boolean))])
    for text, finish, _ in results:
        assert finish == "stop" and text in ("true", "false"), (text, finish)


def test_each_of_n_choices_follows_the_schema_with_its_own_constraint() -> None:
    backend, schema = load_backend(), grammar(PERSON)

    async def choices() -> dict[int, str]:
        engine = Engine(backend, EngineConfig(max_num_seqs=4))
        params = SamplingParams(max_tokens=300, temperature=1.0, seed=7, grammar=schema)
        text: dict[int, str] = {}
        async for chunk in engine.generate(backend.encode("user: hi\n"), params, n=3):
            text[chunk.index] = text.get(chunk.index, "") + chunk.text
        await engine.close()
        return text

    out = asyncio.run(choices())
    assert sorted(out) == [0, 1, 2] and len(set(out.values())) > 1  # seeded apart
    for text in out.values():
        jsonschema.validate(json.loads(text), PERSON)


def test_importing_the_textgen_deployment_loads_no_torch_compiler() -> None:
    # Every textgen replica (and the warm pool's, which serves it) imports this module as it
    # starts; the edges do not. ``llguidance.torch`` runs a ``torch.compile`` decorator at
    # import, which loads dynamo and inductor: about 2 s of CPU in each of those processes,
    # for a kernel the engine never calls.
    script = ("import sys, ember.deployments.textgen\n"
              "print(sorted(m for m in ('torch._dynamo', 'torch._inductor', 'llguidance.torch')"
              " if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr
