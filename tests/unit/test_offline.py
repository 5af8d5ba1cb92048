"""Offline batch jobs without a cluster: framing, shards, mapping, commits, policy, CLI."""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import BaseModel

import ember
from ember import errors as ember_errors
from ember.errors import ConfigError
from ember.offline._config import OfflineOptions, ShareOptions
from ember.offline._policy import (
    Throttle,
    YieldContext,
    offline_batch_size,
    should_yield,
)

HAS_ARROW = all(importlib.util.find_spec(m) is not None for m in ("pyarrow", "pandas"))
needs_arrow = pytest.mark.skipif(not HAS_ARROW, reason="Ray Data's pyarrow/pandas missing")

if HAS_ARROW:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from ember import offline
    from ember.cli import batch as _offline_cli
    from ember.offline import _job
    from ember.offline._mapping import (
        ROW_SCHEMA,
        BatchRunner,
        LocalMapper,
        encode_item,
        encode_result,
        flatten,
        plan_inputs,
    )
    from ember.offline._reader import read_shard
    from ember.offline._shards import discover, iter_records, plan
    from ember.offline._share import online_depth
    from ember.offline._sink import OutputStore, ShardAssembler, done_shards


# --- policy: pure functions and a fake clock -------------------------------------------------


@pytest.mark.parametrize(("depth", "item_s", "budget_s", "max_batch", "expected"), [
    (0, None, 0.5, 64, 1),       # nothing measured yet: probe with one item
    (0, 0.01, 0.5, 256, 25),     # 0.25 s of the budget at 10 ms an item
    (0, 0.01, 0.5, 8, 8),        # never above the job's batch size
    (4, 0.01, 0.5, 256, 5),      # five online requests may wait: a fifth each
    (0, 2.0, 0.5, 64, 1),        # one item over budget still runs (when online is quiet)
])
def test_offline_batch_size(depth: int, item_s: float | None, budget_s: float, max_batch: int,
                            expected: int) -> None:
    assert offline_batch_size(depth, item_s, budget_s, max_batch) == expected


def test_offline_batch_size_keeps_one_batch_within_the_budget() -> None:
    for item_s in (0.001, 0.003, 0.02, 0.1):
        size = offline_batch_size(0, item_s, 0.4, 10_000, budget_fraction=0.5)
        assert size * item_s <= 0.2 + 1e-9


def test_offline_batch_size_refuses_an_empty_batch() -> None:
    with pytest.raises(ValueError, match="max_batch"):
        offline_batch_size(0, 0.1, 0.5, 0)


def _ctx(**kw: Any) -> YieldContext:
    base: dict[str, Any] = {"now_s": 10.0, "online_depth": 0, "max_online_depth": 0,
                            "last_busy_s": None, "resume_after_s": 0.5}
    return YieldContext(**{**base, **kw})


def test_should_yield() -> None:
    assert not should_yield(_ctx())
    assert should_yield(_ctx(online_depth=1))
    assert not should_yield(_ctx(online_depth=1, max_online_depth=1))
    assert should_yield(_ctx(online_depth=None))  # blind: online first means waiting
    assert should_yield(_ctx(last_busy_s=9.7))  # quiet for 0.3 s of the 0.5 s asked
    assert not should_yield(_ctx(last_busy_s=9.4))


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_throttle_yields_to_online_and_resumes_after_a_quiet_spell() -> None:
    clock = FakeClock()
    throttle = Throttle(ShareOptions(url="http://x", latency_budget_s=0.4, resume_after_s=1.0),
                        clock=clock)
    throttle.observe(0)
    assert throttle.next_batch_size(64) == 1  # first call measures the cost
    throttle.record(items=1, seconds=0.02)
    assert throttle.next_batch_size(64) == 10  # 0.2 s at 20 ms an item
    throttle.observe(3)  # online traffic arrives
    assert throttle.next_batch_size(64) == 0
    clock.now += 0.5
    throttle.observe(0)
    assert throttle.next_batch_size(64) == 0  # quiet for only 0.5 s
    clock.now += 0.6
    assert throttle.next_batch_size(64) == 10
    assert throttle.yields == 2


def test_throttle_smooths_the_cost_per_item() -> None:
    throttle = Throttle(ShareOptions(url="http://x"), clock=FakeClock())
    throttle.record(items=10, seconds=0.1)
    throttle.record(items=10, seconds=0.2)
    assert throttle.item_s == pytest.approx(0.3 * 0.02 + 0.7 * 0.01)
    throttle.record(items=0, seconds=5.0)  # ignored
    assert throttle.item_s == pytest.approx(0.013)


# --- options -------------------------------------------------------------------------------


def test_options_cross_field_check_names_both_fields() -> None:
    with pytest.raises(ValueError, match=r"max_batch_bytes \(10\).*max_item_bytes \(20\)"):
        OfflineOptions(max_item_bytes=20, max_batch_bytes=10)


def test_share_options_need_an_http_url_and_keep_the_key_secret() -> None:
    with pytest.raises(ValueError, match="http://"):
        ShareOptions(url="127.0.0.1:8000")
    assert ShareOptions(url="http://h:1/").url == "http://h:1"
    share = ShareOptions(url="http://h:1", api_key="ek-secret-key")
    assert share.headers() == {"Authorization": "Bearer ek-secret-key"}
    assert "ek-secret-key" not in repr(share) and ShareOptions(url="http://h").headers() == {}


# --- framing and shards ----------------------------------------------------------------------


@needs_arrow
def test_jsonl_records_skip_blank_lines_and_never_hold_an_oversized_one() -> None:
    data = b'{"a": 1}\n\n   \n' + b"x" * 5000 + b'\n{"b": 2}'
    records = list(iter_records(io.BytesIO(data), "jsonl", 0, None, limit=100))
    assert [r.data for r in records] == [b'{"a": 1}\n', None, b'{"b": 2}']
    assert records[1].size == 5001 and records[2].offset == 14 + 5001


@needs_arrow
def test_csv_records_follow_quoted_newlines() -> None:
    data = b'id,text\n1,"two\nlines"\n2,plain\n3,"open\n'
    records = list(iter_records(io.BytesIO(data), "csv", 0, None, limit=100))
    assert [r.data for r in records] == [b"id,text\n", b'1,"two\nlines"\n', b"2,plain\n",
                                         b'3,"open\n']


def _jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@needs_arrow
def test_plan_cuts_deterministic_shards_and_reads_them_back(tmp_path: Path) -> None:
    _jsonl(tmp_path / "a.jsonl", [{"id": f"r{i}", "text": f"t{i}"} for i in range(7)])
    pq.write_table(pa.table({"text": ["p0", "p1", "p2"]}), tmp_path / "b.parquet",
                   row_group_size=2)
    found = discover([str(tmp_path)], None, {})
    assert [f[1] for f in found] == ["jsonl", "parquet"]
    manifest = plan(found, shard_rows=3, limit=1000, storage_options={}, job={})
    again = plan(discover([str(tmp_path)], None, {}), 3, 1000, {}, {})
    assert manifest == again
    assert [(s.first_row, s.num_rows) for s in manifest.shards] == [(0, 3), (3, 3), (6, 1),
                                                                   (7, 3)]
    route = _route(ember.deployment(ListOfStr))
    input_plan = plan_inputs(route, None, "id")
    rows = [r for s in manifest.shards for t in read_shard(s, input_plan, 1000, {})
            for r in t.to_pylist()]
    assert [r["_row"] for r in rows] == list(range(10))
    assert [r["_id"] for r in rows][5:8] == ["r5", "r6", "7"]
    assert [json.loads(r["_input"]) for r in rows][7:] == ["p0", "p1", "p2"]


@needs_arrow
def test_discover_reports_missing_and_unknown_inputs(tmp_path: Path) -> None:
    (tmp_path / "data.txt").write_text("x")
    with pytest.raises(ember_errors.InputError, match="no such file"):
        discover([str(tmp_path / "nope.jsonl")], None, {})
    with pytest.raises(ember_errors.InputError, match="unknown format"):
        discover([str(tmp_path / "data.txt")], None, {})


# --- the mapping rule -------------------------------------------------------------------------


class ListOfStr:
    @ember.route("/t")
    def embed(self, texts: list[str]) -> list[list[float]]:
        return [[float(len(t))] for t in texts]


class Doc(BaseModel):
    text: str
    weight: int = 1


class Docs:
    @ember.route("/d")
    def score(self, docs: list[Doc]) -> list[dict[str, float]]:
        return [{"score": d.weight * 1.0} for d in docs]


def _route(cls: type) -> Any:
    from ember.app.decorator import get_spec

    return get_spec(cls).routes[0]


@needs_arrow
def test_prepare_rows_for_each_input_kind() -> None:
    text = plan_inputs(_route(ember.deployment(ListOfStr)), None, "id")
    assert text.prepare({"text": "hi"}).item == "hi"
    assert text.prepare({"text": 3}).reason == "wrong_type"
    assert text.prepare({"other": "x"}).reason == "missing_field"
    assert text.row_id({"id": 7}, 3) == "7" and text.row_id({"id": ""}, 3) == "3"
    docs = plan_inputs(_route(ember.deployment(Docs)), None, "id")
    assert docs.prepare({"text": "a", "weight": "2"}).item == Doc(text="a", weight=2)
    bad = docs.prepare({"text": "a", "weight": "heavy"})
    assert bad.reason == "invalid_row" and bad.message is not None and "weight" in bad.message


@needs_arrow
def test_flatten_outputs() -> None:
    class Out(BaseModel):
        label: str
        vector: list[float]

    assert flatten(Out(label="a", vector=[1.0])) == {"label": "a", "vector": [1.0]}
    assert flatten({"n": np.int64(3)}) == {"n": 3}
    assert flatten([0.5, 1.5]) == {"embedding": [0.5, 1.5]}
    assert list(flatten(torch.ones(2))["embedding"]) == [1.0, 1.0]
    assert flatten(torch.tensor(4.0)) == {"output": 4.0}
    assert flatten("x") == {"output": "x"}
    with pytest.raises(ember_errors.OfflineError, match="collide"):
        flatten({"id": 1})


class Clash(BaseModel):
    id: str


class Bad:
    @ember.route("/b")
    def run(self, texts: list[str]) -> list[Clash]:
        return []


@needs_arrow
def test_output_models_may_not_use_reserved_names() -> None:
    with pytest.raises(ConfigError, match="row_index"):
        plan_inputs(_route(ember.deployment(Bad)), None, "id")


@needs_arrow
def test_batch_runner_isolates_bad_items_and_learns_memory_limits() -> None:
    calls: list[int] = []

    def call(items: list[int]) -> list[int]:
        calls.append(len(items))
        if 13 in items:
            raise ValueError("unlucky")
        if len(items) > 4:
            raise MemoryError("too big")
        return [i * 2 for i in items]

    runner = BatchRunner(call, max_batch_bytes=1000, where=("D", "f"))
    outcomes = runner.run(list(range(16)), [1] * 16)
    assert [o.value for o in outcomes if o.error is None] == [i * 2 for i in range(16) if i != 13]
    assert outcomes[13].error == "ValueError: unlucky"
    assert runner.max_items is not None and runner.max_items <= 8
    calls.clear()
    runner.run(list(range(4)), [600, 600, 100, 100])  # bytes split the batch: 1, then 3
    assert calls == [1, 3]


@needs_arrow
def test_batch_runner_refuses_a_wrong_result_count() -> None:
    runner = BatchRunner(lambda items: items[:-1], 1000, ("Emb", "embed"))
    with pytest.raises(ember_errors.HandlerContract, match=r"Emb\.embed returned 1 results for 2"):
        runner.run([1, 2], [1, 1])


class Counting:
    setups = 0

    def setup(self) -> None:
        type(self).setups += 1

    @ember.route("/c")
    async def run(self, texts: list[str]) -> list[int]:
        return [len(t) for t in texts]


@needs_arrow
def test_local_mapper_sets_up_once_and_passes_bad_rows_through() -> None:
    table = pa.Table.from_pylist([
        {"_shard": 0, "_row": 0, "_id": "a", "_reason": None, "_message": None,
         "_input": encode_item("abc"), "_size": 3},
        {"_shard": 0, "_row": 1, "_id": "b", "_reason": "invalid_json", "_message": "x",
         "_input": None, "_size": 1}], schema=ROW_SCHEMA)
    mapper = LocalMapper(ember.deployment(Counting), "run", tensor=False, max_batch_bytes=100,
                         deployment="Counting", item_type=str)
    first, second = mapper(table).to_pylist(), mapper(table).to_pylist()
    assert Counting.setups == 1 and first == second
    assert json.loads(first[0]["_result"]) == {"output": 3}
    assert (first[1]["_reason"], first[1]["_result"]) == ("invalid_json", None)


# --- commits, resume checks, targets --------------------------------------------------------


def _result_table(rows: list[tuple[int, int, str | None]]) -> Any:
    return pa.Table.from_pylist([
        {"_shard": s, "_row": r, "_id": str(r), "_reason": reason, "_message": reason,
         "_result": None if reason else encode_result({"output": r})}
        for s, r, reason in rows])


@needs_arrow
def test_shards_commit_once_complete_and_count_duplicates_once(tmp_path: Path) -> None:
    src = _jsonl(tmp_path / "in.jsonl", [{"text": str(i)} for i in range(5)])
    manifest = plan(discover([str(src)], None, {}), 3, 100, {}, {})
    store = OutputStore(str(tmp_path / "out"), {})
    assembler = ShardAssembler(manifest.shards, store, "parquet")
    assert assembler.add(_result_table([(0, 0, None), (0, 1, "too_large"), (1, 3, None)])) == 3
    assert done_shards(store, manifest, "parquet") == set()
    assert assembler.add(_result_table([(0, 1, "too_large"), (0, 2, None)])) == 1
    assert done_shards(store, manifest, "parquet") == {0}
    part = pq.read_table(tmp_path / "out" / "part-00000.parquet").to_pylist()
    assert part == [{"id": "0", "row_index": 0, "output": 0}, {"id": "2", "row_index": 2,
                                                               "output": 2}]
    errors = (tmp_path / "out" / "errors" / "part-00000.jsonl").read_text()
    assert json.loads(errors)["reason"] == "too_large"
    with pytest.raises(ember_errors.ShardIncomplete, match="shard 1 returned 1 of 2 rows"):
        assembler.finish()
    assert not [p for p in (tmp_path / "out").rglob("*") if ".tmp-" in p.name]


@needs_arrow
def test_an_all_bad_shard_is_typed_like_the_others(tmp_path: Path) -> None:
    src = _jsonl(tmp_path / "in.jsonl", [{"text": str(i)} for i in range(4)])
    manifest = plan(discover([str(src)], None, {}), 2, 100, {}, {})
    assembler = ShardAssembler(manifest.shards, OutputStore(str(tmp_path / "out"), {}), "parquet")
    assembler.add(_result_table([(0, 0, None), (0, 1, None), (1, 2, "wrong_type"),
                                 (1, 3, "wrong_type")]))
    table = pq.read_table(tmp_path / "out", ignore_prefixes=["_", ".", "errors"])
    assert table.column_names == ["id", "row_index", "output"] and table.num_rows == 2
    assert (assembler.rows_ok, assembler.rows_failed) == (2, 2)


@needs_arrow
def test_an_output_inside_the_input_is_not_read(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    pq.write_table(pa.table({"text": ["old"]}), tmp_path / "out" / "part-00000.parquet")
    with pytest.raises(ember_errors.InputError, match="outside the output"):
        offline.run_batch(ember.deployment(ListOfStr), input=str(tmp_path),
                          output=str(tmp_path / "out"))


@needs_arrow
def test_leftover_temp_files_are_cleaned(tmp_path: Path) -> None:
    store = OutputStore(str(tmp_path), {})
    (tmp_path / ".part-00000.parquet.tmp-abc").write_bytes(b"half")
    store.commit("part-00001.parquet", b"whole")
    assert store.clean_temp() == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["part-00001.parquet"]


@needs_arrow
def test_an_existing_job_needs_resume_and_the_same_options(tmp_path: Path) -> None:
    src = _jsonl(tmp_path / "in.jsonl", [{"text": "a"}])
    cls = ember.deployment(ListOfStr)
    out = tmp_path / "out"
    store = OutputStore(str(out), {})
    target = offline.resolve_target(cls)
    opts = OfflineOptions()
    key = _job._job_key(target, plan_inputs(target.route, None, "id"), opts)
    store.write_manifest(plan(discover([str(src)], None, {}), 10, 100, {}, key))
    with pytest.raises(ember_errors.OutputExists):
        offline.run_batch(cls, input=str(src), output=str(out))
    with pytest.raises(ember_errors.ResumeMismatch, match="shard_rows was 5000 and is now 7"):
        offline.run_batch(cls, input=str(src), output=str(out), resume=True, shard_rows=7)
    src.write_text('{"text": "changed"}\n')
    with pytest.raises(ember_errors.ResumeMismatch, match="inputs"):
        offline.run_batch(cls, input=str(src), output=str(out), resume=True)


@needs_arrow
def test_resolve_target_explains_what_to_pick() -> None:
    class Two:
        @ember.route("/a")
        def a(self, texts: list[str]) -> list[int]:
            return []

        @ember.route("/b")
        def b(self, texts: list[str]) -> list[int]:
            return []

    class Plain:
        def __call__(self, body: Doc) -> int:
            return 1

    two, plain = ember.deployment(Two), ember.deployment(Plain)
    with pytest.raises(ConfigError, match=r"several batch handlers \(\['a', 'b'\]\)"):
        offline.resolve_target(two)
    assert offline.resolve_target(two, attr="b").route.attr == "b"
    with pytest.raises(ember_errors.NoBatchHandler):
        offline.resolve_target(plain)
    app = ember.App([two, plain])
    assert offline.resolve_target(app, attr="a").spec.name == "Two"
    with pytest.raises(ConfigError, match="module:app:Deployment"):
        offline.resolve_target("ember")


# --- share mode status, CLI -----------------------------------------------------------------


@needs_arrow
def test_online_depth_reads_the_ingress_status() -> None:
    status = {"deployments": [{"deployment": "A", "ongoing": 2, "queued": 3}]}

    def reply(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=status) if request.url.path == "/-/status" else (
            httpx.Response(404))

    client = httpx.Client(transport=httpx.MockTransport(reply))
    assert online_depth(client, "http://ingress", "A") == 5
    assert online_depth(client, "http://ingress", "B") is None
    broken = httpx.Client(transport=httpx.MockTransport(lambda r: httpx.Response(500)))
    assert online_depth(broken, "http://ingress", "A") is None


@needs_arrow
def test_cli_registers_batch_and_reports_bad_targets(capsys: pytest.CaptureFixture[str],
                                                     tmp_path: Path) -> None:
    parser = argparse.ArgumentParser(prog="ember")
    _offline_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["batch", "m:app", "-i", "a", "-i", "b", "-o", "out",
                              "--batch-size", "8", "--share-with-online", "http://h:1"])
    assert (args.input, args.batch_size, args.func) == (["a", "b"], 8, _offline_cli.cmd_batch)
    code = _offline_cli.main(["batch", "no_such_module_xyz:app", "-i", str(tmp_path),
                              "-o", str(tmp_path / "o")])
    assert code == 2
    assert "cannot import 'no_such_module_xyz'" in capsys.readouterr().err
