"""Every figures table in README.md and docs/*.md matches the results file it names.

A table whose figures come from a benchmark is preceded by a marker naming its results file::

    <!-- figures: bench/results/throughput.json -->
    | contender | c=1 p50 | ... |

:data:`FIGURES` maps each results file to a function that, from the parsed JSON, gives the
expected text of each cell by ``(row, column)``: the row's first cell and the column's
header, as the table spells them. A cell that differs fails, and so does a cell quoting a
number (any digit) that the mapping does not give: a table cannot carry a figure its results
file does not back. A table adopts the check with its marker and one mapping here.
"""

from __future__ import annotations

import copy
import json
import re
import statistics
from collections.abc import Callable
from pathlib import Path
from statistics import median
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"<!--\s*figures:\s*(\S+)\s*-->")
Cells = dict[tuple[str, str], str]


def _spread(s: dict[str, float], spec: str, unit: str = "") -> str:
    """``median unit (min-max)``, as the request-path table writes a metric over rounds."""
    return f"{s['median']:{spec}}{unit} ({s['min']:{spec}}-{s['max']:{spec}})"


THROUGHPUT_ROWS = {"ember": "Ember, `ember run`",
                   "stock": "Ray Serve, stock `serve run`",
                   "tuned": "Ray Serve, tuned `serve run`"}
THROUGHPUT_COLUMNS = (("c1_p50_ms", "c=1 p50", ".1f", " ms"), ("c32_rps", "c=32 req/s", ".1f", ""),
                      ("cpu_ms_per_request", "CPU per request", ".1f", " ms"),
                      ("mean_batch_per_request", "mean batch per request", ".1f", ""))


def throughput(doc: dict[str, Any]) -> Cells:
    """``bench/throughput.py``: each contender's medians (min-max) and Ember's ratios."""
    cells: Cells = {}
    for key, row in THROUGHPUT_ROWS.items():
        for metric, column, spec, unit in THROUGHPUT_COLUMNS:
            cells[row, column] = _spread(doc["contenders"][key][metric], spec, unit)
    for peer in ("stock", "tuned"):
        for metric, column, _, _ in THROUGHPUT_COLUMNS:
            value = doc["ratios"][f"ember/{peer} {metric}"]["value"]
            cells[f"Ember / {peer}", column] = f"{value:.2f}x"
    return cells


COLDSTART_ROWS = {"a": "(a)", "b": "(b)", "c": "(c)", "d": "(d)", "e": "(e)", "f": "(f)"}


def coldstart(doc: dict[str, Any]) -> Cells:
    """``bench/coldstart.py``: each variant's median and the Ray variants' ratios to it."""
    cells: Cells = {}
    for row in doc["summary"]:
        label = COLDSTART_ROWS[row["key"]]
        cells[label, "cold start"] = f"{row['cold_start_median_s']:.2f} s"
        if row["key"] not in ("e", "f"):
            cells[label, "(e) / it"] = f"{row['ray_default_over_it']:.1f}x"
            cells[label, "(f) / it"] = f"{row['ray_shrunk_over_it']:.1f}x"
    return cells


BURST_ROWS = {"Ember pool+preload": "Ember, pool with the model preloaded",
              "Ember no pool": "Ember, own replicas from fresh processes",
              "Ray Serve shrunk": "Ray Serve on Ember's cluster, timers shrunk"}


def burst(doc: dict[str, Any]) -> Cells:
    """``bench/burst.py``: p50 and max of each variant, and how many requests were 200."""
    cells: Cells = {}
    for key, row in BURST_ROWS.items():
        s = doc["summary"][key]
        cells[row, "p50"] = f"{s['p50_s']:.2f} s"
        cells[row, "max"] = f"{s['max_s']:.2f} s"
        cells[row, "answered 200"] = f"{s['requests'] - s['non_200']} / {s['requests']}"
    return cells


def offline(doc: dict[str, Any]) -> Cells:
    """``bench/offline.py``: items/s and cost per million items of each measure."""
    cells: Cells = {}
    for m in doc["measures"]:
        name = m["name"].strip()
        cells[name, "items/s"] = f"{m['items_per_s']:.1f}"
        cells[name, "items/s, whole machine"] = f"{m['machine_items_per_s']:.1f}"
    cells["offline job / online, one replica", "items/s"] = f"{doc['ratio_items_per_s']:.2f}x"
    cells["offline job / online, every core", "items/s, whole machine"] = (
        f"{doc['ratio_vs_online_every_core']:.2f}x")
    return cells


def _samples_per_request(doc: dict[str, Any], groups: tuple[str, ...]) -> str:
    samples = sum(p["samples"] for p in doc["processes"] if p["group"].endswith(groups))
    return f"{samples / doc['load']['requests']:.2f}"


def profile_two_hops(doc: dict[str, Any]) -> Cells:
    """``bench/profile_path.py`` before the edges: Serve's proxy and the ingress replica."""
    row = "before the edges: Serve's proxy + the ingress replica"
    return {(row, "req/s"): f"{doc['load']['throughput_rps']:.1f}",
            (row, "HTTP-tier samples per request"): _samples_per_request(
                doc, ("HTTP proxy", "ember-ingress"))}


def profile_edges(doc: dict[str, Any]) -> Cells:
    """``bench/profile_path.py`` with the edges (Serve's idle proxy not counted)."""
    row = "the edges (two)"
    return {(row, "req/s"): f"{doc['load']['throughput_rps']:.1f}",
            (row, "HTTP-tier samples per request"): _samples_per_request(doc, ("ember-edge",))}


SIZES_PATHS = {"disk_cold": "page cache cold", "disk_warm": "page cache warm",
               "regional": "regional store", "second_replica": "second replica"}


def coldstart_sizes(doc: dict[str, Any]) -> Cells:
    """``bench/coldstart_sizes.py``: per size and path, the replica's times and the loaders'."""
    cells: Cells = {}
    for r in doc["rows"]:
        row = f"{r['size_gb']:.1f} GB, {SIZES_PATHS[r['path']]}"
        cells[row, "request to first answer"] = f"{r['total_s']:.1f} s"
        cells[row, "weights phase"] = f"{r['weights_s']:.2f} s"
        cells[row, "same bytes at the measured limit"] = f"{r['limit_s']:.2f} s"
        peers = {k: v for k, v in (r.get("peers") or {}).items() if isinstance(v, (int, float))}
        if "ember" in peers:
            cells[row, "Ember's loader"] = f"{peers['ember']:.2f} s"
            others = {k: v for k, v in peers.items() if k != "ember"}
            best = min(others, key=lambda k: others[k])
            cells[row, "best peer loader"] = f"{others[best]:.2f} s ({best})"
            if "from_pretrained" in peers:
                cells[row, "from_pretrained"] = f"{peers['from_pretrained']:.2f} s"
    return cells


def llm(doc: dict[str, Any]) -> Cells:
    """``bench/llm.py``: prefix-cache hit vs miss, continuous vs static batching at c=16,
    structured output's cost and the HTTP path against the engine in-process."""
    prefix, c16 = doc["prefix"], doc["c16"]
    hit = "time to first token, 1,000-token prefix: hit / miss"
    tps = "tokens/s at c=16: Ember / `generate()` static batches"
    ratio = "ratio (median of rounds)"
    cells = {(hit, "Ember"): f"{prefix['hit_ttft_s']:.2f} s",
             (hit, "peer"): f"{prefix['miss_ttft_s']:.1f} s",
             (hit, ratio): f"{prefix['hit_over_miss']['median']:.3f}x",
             (tps, "Ember"): f"{c16['continuous_tps']:.1f}",
             (tps, "peer"): f"{c16['static_tps']:.1f}",
             (tps, ratio): f"{c16['ratio']['median']:.2f}x"}
    if c16.get("hf_continuous_tps"):
        row = "tokens/s at c=16: Ember / transformers' continuous batching"
        cells |= {(row, "Ember"): f"{c16['continuous_tps']:.1f}",
                  (row, "peer"): f"{c16['hf_continuous_tps']:.1f}",
                  (row, ratio): f"{c16['ratio_over_hf_continuous']['median']:.2f}x"}
    if doc.get("structured"):
        runs = doc["structured"]["runs"]
        row = "tokens/s at c=16: with a JSON schema / without"
        cells |= {(row, "Ember"): f"{median(r['tokens_per_s'] for r in runs['structured']):.1f}",
                  (row, "peer"): f"{median(r['tokens_per_s'] for r in runs['plain']):.1f}",
                  (row, ratio): f"{doc['structured_ratio']:.2f}x"}
    if doc.get("http"):
        web = doc["http"]
        row = "tokens/s at c=16: over HTTP / the engine in-process"
        ttft = "TTFT at c=1: over HTTP / in-process"
        cells |= {(row, "Ember"): f"{web['http_tps']:.1f}",
                  (row, "peer"): f"{web['inprocess_tps']:.1f}",
                  (row, ratio): f"{web['http_over_inprocess_tps']['median']:.2f}x",
                  (ttft, "Ember"): f"{web['ttft_c1_ms']['http']:.0f} ms",
                  (ttft, "peer"): f"{web['ttft_c1_ms']['inprocess']:.0f} ms",
                  (ttft, ratio): f"{web['ttft_added_ms_c1']:+.1f} ms added"}
    return cells


def operator_state(doc: dict[str, Any]) -> Cells:
    """``tests/e2e/test_operator_state.py``'s figures: read after write and the switch time."""
    row = "new traffic weights, every edge"
    return {(row, "GETs right after a 200 PUT showing them"):
            f"{doc['read_after_write_gets']} of {doc['read_after_write_gets']}",
            (row, "routed by them within (max of 8 switches)"): f"{doc['max_switch_s']:.2f} s",
            (row, "edges"): str(doc["edges"])}


#: Results file (relative to the repository root) -> the cells its tables quote.
IDLE_ROWS = {"ember": "Ember, `ember run`", "stock": "Ray Serve, stock `serve run`"}
IDLE_KINDS = (("serve controller", "Serve controller"), ("edges / proxy", "edges / proxy"),
              ("ray daemons", "Ray's daemons"))


def idle_cpu(doc: dict[str, Any]) -> Cells:
    """``bench/idle_cpu.py``: idle CPU in % of a core and idle memory (PSS), in total and by
    process kind, and the start to the first answer (medians over rounds), and Ember / stock."""
    cells: Cells = {}
    for key, row in IDLE_ROWS.items():
        summary = doc["summary"][key]
        cells[row, "idle CPU"] = _spread(summary["idle_cpu_pct"], ".1f", " %")
        cells[row, "idle memory (PSS)"] = _spread(summary["pss_mb"], ".0f", " MB")
        cells[row, "start to first answer"] = _spread(summary["answering_s"], ".1f", " s")
        rounds = [r for r in doc["rounds"] if r["contender"] == key]
        for kind, column in IDLE_KINDS:
            value = statistics.median(r["by_kind_pct"].get(kind, 0.0) for r in rounds)
            cells[row, column] = f"{value:.1f} %"
            mb = statistics.median(r["pss_mb_by_kind"].get(kind, 0.0) for r in rounds)
            cells[row, f"{column} memory"] = f"{mb:.0f} MB"
    for figure, column in (("idle_cpu_pct", "idle CPU"), ("pss_mb", "idle memory (PSS)"),
                           ("answering_s", "start to first answer")):
        cells["Ember / stock", column] = f"{doc['ratio'][f'ember/stock {figure}']['value']:.2f}x"
    return cells


def _textgen_row(row: dict[str, Any]) -> str:
    """``2 GB, page cache warm``: a generation table's row label."""
    size = row["size"].removesuffix("gb")
    return f"{size} GB, page cache {'warm' if row['path'] == 'disk_warm' else 'cold'}"


def _textgen(doc: dict[str, Any], ours: str, peer: str, ratio: str, columns: tuple[str, ...],
             spec: str) -> Cells:
    """A generation table: each row's median time to first token for Ember and the peer, and
    the peer over Ember."""
    cells: Cells = {}
    for row in doc["rows"]:
        label, med = _textgen_row(row), row["medians"]
        cells[label, columns[0]] = f"{med[ours]['ttft_s']:.2f} s"
        cells[label, columns[1]] = f"{med[peer]['ttft_s']:.2f} s"
        cells[label, columns[2]] = f"{row[ratio]:{spec}}x"
    return cells


def textgen_coldstart(doc: dict[str, Any]) -> Cells:
    """``bench/textgen_coldstart.py``: time to first token from zero, Ember and Ray Serve."""
    return _textgen(doc, "ember", "rayserve", "ttft_ratio_rayserve_over_ember",
                    ("Ember", "Ray Serve", "Ray Serve / Ember"), ".1f")


def textgen_sizes(doc: dict[str, Any]) -> Cells:
    """``bench/textgen_sizes.py``: load to first token in a fresh process, and the ratio."""
    return _textgen(doc, "ember", "from_pretrained", "ttft_ratio_peer_over_ember",
                    ("Ember's loader", "from_pretrained", "from_pretrained / Ember"), ".2f")

def textgen_first_prefill(doc: dict[str, Any]) -> Cells:
    """``bench/textgen_first_prefill.py``: first and later prefill and decode, per table."""
    cells: Cells = {}
    for row in doc["rows"]:
        label = f"{row['size'].removesuffix('gb')} GB, {row['table'].replace('_', '-')}"
        first, later = row["first"], row["later"]
        cells[label, "first prefill"] = f"{first['prefill_s']:.3f} s"
        cells[label, "its page faults"] = f"{first['prefill_faults']:,.0f}"
        cells[label, "later prefills"] = f"{later['prefill_s']:.3f} s"
        cells[label, "first decode"] = f"{first['decode_s']:.3f} s"
        cells[label, "later decodes"] = f"{later['decode_s']:.3f} s"
    return cells


def page_reads(doc: dict[str, Any]) -> Cells:
    """``bench/page_reads.py``: ``LoaderConfig.huge_pages`` (``populate_8x32mib_huge_seq``)
    against the default's populate, the cold read and the next mapping of the same pages."""
    option, default = "populate_8x32mib_huge_seq", "populate_8x32mib"
    cold, remap, ratios = doc["median_gbps"], doc["remap_median_gbps"], doc["ratios"]
    label = ("at rest (freed long before, handed back to the host)" if doc["at_rest"]
             else "just freed (the trial before freed 2 MiB folios)")
    pmd = [b >> 20 for b in doc["file_pmd_mapped_bytes"][option]]
    return {
        (label, "cold read, option / default"):
            f"{ratios[option + '_over_' + default]:.2f}x ({cold[option]:.2f} / "
            f"{cold[default]:.2f} GB/s)",
        (label, "next mapping, option / default"):
            f"{ratios['remap_after_huge_seq_over_remap_after_' + default]:.1f}x "
            f"({remap[option]:.1f} / {remap[default]:.1f} GB/s)",
        (label, "2 MiB-mapped after the option"):
            f"{min(pmd)}-{max(pmd)} MiB of {doc['bytes'] >> 20}",
    }


FIGURES: dict[str, Callable[[dict[str, Any]], Cells]] = {
    "bench/results/throughput.json": throughput,
    "bench/results/coldstart.json": coldstart,
    "bench/results/burst.json": burst,
    "bench/results/offline.json": offline,
    "bench/results/profile_path_two_hops.json": profile_two_hops,
    "bench/results/profile_path.json": profile_edges,
    "bench/results/coldstart_sizes.json": coldstart_sizes,
    "bench/results/coldstart_sizes.short.json": coldstart_sizes,
    "bench/results/coldstart_sizes_regional.short.json": coldstart_sizes,
    "bench/results/coldstart_sizes_regional.json": coldstart_sizes,
    "bench/results/coldstart_sizes_disk_cold_disk_warm_second_replica.json": coldstart_sizes,
    "bench/results/coldstart_sizes_regional.short.run1.json": coldstart_sizes,
    "bench/results/llm.json": llm,
    "bench/results/operator_state.json": operator_state,
    "bench/results/idle_cpu.json": idle_cpu,
    "bench/results/textgen_coldstart.json": textgen_coldstart,
    "bench/results/textgen_sizes.json": textgen_sizes,
    "bench/results/textgen_sizes.avx2.json": textgen_sizes,
    "bench/results/textgen_first_prefill.json": textgen_first_prefill,
    "bench/results/page_reads.json": page_reads,
    "bench/results/page_reads_at_rest.json": page_reads,
}


def _row(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def marked_tables(text: str) -> list[tuple[str, int, list[list[str]]]]:
    """(results file, line number, rows with the header first) of every marked table
    (outside fenced code blocks, where a marker is only shown)."""
    lines, out, fenced = text.splitlines(), [], False
    for i, line in enumerate(lines):
        fenced = fenced != line.startswith("```")
        match = MARKER.search(line)
        if fenced or not match:
            continue
        j = i + 1
        while j < len(lines) and not lines[j].startswith("|"):
            if lines[j].strip():
                raise AssertionError(f"line {i + 1}: the figures marker must precede a table")
            j += 1
        rows = []
        while j < len(lines) and lines[j].startswith("|"):
            if not re.fullmatch(r"\|[\s|:-]+\|?", lines[j].strip()):
                rows.append(_row(lines[j]))
            j += 1
        out.append((match.group(1), i + 1, rows))
    return out


def check(text: str, source: str,
          load: Callable[[str], dict[str, Any]] | None = None) -> list[str]:
    """Every disagreement between ``text``'s marked tables and their results files."""
    load = load or (lambda path: json.loads((ROOT / path).read_text()))
    problems = []
    for path, line, rows in marked_tables(text):
        if path not in FIGURES:
            problems.append(f"{source}:{line}: no mapping for {path} in FIGURES")
            continue
        expected = FIGURES[path](load(path))
        header = rows[0]
        for row in rows[1:]:
            for column, cell in zip(header[1:], row[1:], strict=True):
                want = expected.get((row[0], column))
                if want is None and re.search(r"\d", cell):
                    problems.append(f"{source}:{line}: [{row[0]} | {column}] = {cell!r} "
                                    f"is not backed by {path}")
                elif want is not None and cell != want:
                    problems.append(f"{source}:{line}: [{row[0]} | {column}] = {cell!r}, "
                                    f"{path} says {want!r}")
    return problems


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_marked_tables_match_their_results(page: Path) -> None:
    assert check(page.read_text(), page.relative_to(ROOT).as_posix()) == []


def test_the_request_path_table_is_checked() -> None:
    """The checker is not vacuous: the benchmarks page marks the request-path table."""
    tables = marked_tables((ROOT / "docs" / "benchmarks.md").read_text())
    assert "bench/results/throughput.json" in [path for path, _, _ in tables]


def _benchmarks_page() -> str:
    return (ROOT / "docs" / "benchmarks.md").read_text()


def test_a_changed_figure_fails() -> None:
    doc = json.loads((ROOT / "bench/results/throughput.json").read_text())
    changed = copy.deepcopy(doc)
    changed["contenders"]["ember"]["c32_rps"]["median"] += 10.0
    problems = check(_benchmarks_page(), "docs/benchmarks.md",
                     load=lambda path: changed if path.endswith("throughput.json")
                     else json.loads((ROOT / path).read_text()))
    assert any("c=32 req/s" in p and "Ember, `ember run`" in p for p in problems), problems


def test_an_unbacked_number_fails() -> None:
    text = _benchmarks_page().replace("| Ember / tuned |", "| Ember / tuned, redone |", 1)
    problems = check(text, "docs/benchmarks.md")
    assert any("is not backed" in p and "Ember / tuned, redone" in p for p in problems)
