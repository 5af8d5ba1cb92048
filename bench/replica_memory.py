"""Memory a second MiniLM replica adds on one node: Ember's mapped weights vs copied weights.

Two deployments, each run as two replicas on this node (``warm_floor=2``, no pool), one
after the other: Ember's ``MiniLM`` (weights mapped from the node's snapshot) and, as the
peer, the same class whose ``setup`` copies the weights into a normally built model
(``safetensors.torch.load_file`` + ``load_state_dict``, as ``torch.load`` users do). For the
later-started replica ("replica 2") psutil reports whole-process RSS, PSS and USS and, from
its memory maps, the weights file's mapping: resident, proportional, private (in this
process only) and anonymous (copied-on-write) bytes. The figure that matters is that
mapping's private + anonymous bytes against the file's size: clean file-backed pages are the
node's page cache, shared by every replica, whereas whole-process USS is mostly the Python
and torch runtime every replica has. Same in full and ``--short`` runs (no trials).

Usage:
    .venv/bin/python bench/replica_memory.py [--short]
"""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path
from typing import Any

import _harness as h
import _minilm_apps as m
import _serving
import httpx
import psutil
from ray import serve

import ember

#: (key, deployment name, base class: None for the flagship's own setup)
VARIANTS: tuple[tuple[str, str, type | None], ...] = (
    ("ember", "MiniLMMem", None), ("copy", "MiniLMCopy", m.CopyLoaded))


def replica_pids(base_url: str, app: str, deadline: h.Deadline) -> list[int]:
    """PIDs of the two replicas (``GET /pid``; the router spreads requests), oldest first."""
    seen: set[int] = set()
    with httpx.Client() as client:
        for _ in range(60):
            reply = client.get(f"{base_url}/pid", timeout=deadline.timeout(30))
            if reply.status_code == 200:
                seen.add(int(reply.json()["pid"]))
            if len(seen) >= 2:
                break
    if len(seen) < 2:
        raise RuntimeError(f"{app}: found replica PIDs {sorted(seen)}, expected two")
    return sorted(seen, key=lambda pid: psutil.Process(pid).create_time())


def process_memory(pid: int, blob: str) -> dict[str, Any]:
    """Whole-process RSS/PSS/USS and the weights file mapping's share, in bytes."""
    proc = psutil.Process(pid)
    full = proc.memory_full_info()
    mapping = {"rss": 0, "pss": 0, "private": 0, "anonymous": 0}
    for region in proc.memory_maps(grouped=True):
        if region.path and os.path.realpath(region.path) == blob:
            mapping["rss"] += region.rss
            mapping["pss"] += region.pss
            mapping["private"] += region.private_clean + region.private_dirty
            mapping["anonymous"] += region.anonymous
    return {"pid": pid, "rss": full.rss, "pss": full.pss, "uss": full.uss,
            "weights_mapping": mapping}


def other_mappers(blob: str, ours: set[int]) -> int:
    """Processes outside this measurement that map the weights file too (their pages look
    shared); reported so that the figure can be read."""
    count = 0
    for proc in psutil.process_iter():
        if proc.pid in ours:
            continue
        try:
            if blob in Path(f"/proc/{proc.pid}/maps").read_text():
                count += 1
        except OSError:
            continue
    return count


def measure(key: str, name: str, base: type | None, base_url: str, blob: str,
            deadline: h.Deadline) -> dict[str, Any]:
    """Deploy two replicas of one variant and read replica 2's memory."""
    extra = {} if base is None else {"base": base}
    cls = m.ember_variant(name, pid_route=True, warm_floor=2, max_replicas=2, **extra)
    app = ember.App([cls], name=f"mem-{key}", warm_pool=0)
    print(f"{name}: two replicas", flush=True)
    try:
        _serving.deploy_ember(app, deadline)
        h.wait_until(lambda: _serving.replica_states(app.name, name).get("RUNNING", 0) == 2,
                     f"two {name} replicas", deadline)
        pids = replica_pids(base_url, app.name, deadline)
        time.sleep(1.0)  # let the replicas settle after answering
        replicas = [process_memory(pid, blob) for pid in pids]
        return {"replicas": replicas, "other_processes_mapping_weights":
                other_mappers(blob, set(pids))}
    finally:
        serve.delete(app.name)


def measure_into(found: dict[str, Any], key: str, *args: Any) -> None:
    found[key] = measure(key, *args)


def figures(found: dict[str, Any], weight_bytes: int) -> dict[str, float | None]:
    """Per variant: replica 2's added weight bytes (% of the file) and its USS (MB)."""
    out: dict[str, float | None] = {"weights_mb": weight_bytes / 1e6}
    for key, doc in found.items():
        second = doc["replicas"][-1]
        mapping = second["weights_mapping"]
        added = mapping["private"] + mapping["anonymous"]
        out[f"{key}_replica2_weights_private_anon_pct"] = 100.0 * added / weight_bytes
        out[f"{key}_replica2_uss_mb"] = second["uss"] / 1e6
        out[f"{key}_replica2_weights_mapped_resident_mb"] = mapping["rss"] / 1e6
    if "ember" in found and "copy" in found:
        saved = found["copy"]["replicas"][-1]["uss"] - found["ember"]["replicas"][-1]["uss"]
        out["uss_copy_minus_ember_pct_of_weights"] = 100.0 * saved / weight_bytes
    return out


def print_figures(fig: dict[str, float | None]) -> None:
    lines = [["replica 2", "Ember (mapped)", "copy-loading peer", "peer / Ember"]]
    for label, suffix in (("weights private+anon [% of file]", "weights_private_anon_pct"),
                          ("weights mapping resident [MB]", "weights_mapped_resident_mb"),
                          ("whole-process USS [MB]", "uss_mb")):
        ours, peer = fig.get(f"ember_replica2_{suffix}"), fig.get(f"copy_replica2_{suffix}")
        lines.append([label, h.fmt(ours, ".1f"), h.fmt(peer, ".1f"), h.fmt_ratio(peer, ours)])
    lines.append(["USS above Ember's replica 2 [% of weights]", "0.0",
                  h.fmt(fig.get("uss_copy_minus_ember_pct_of_weights"), ".1f"), "-"])
    print()
    h.print_table(lines)
    print(f"weights file {h.fmt(fig['weights_mb'], '.1f')} MB. The copy-loading peer holds its "
          "weights in anonymous heap memory, not in the file mapping: its cost is the USS row.")


def main() -> int:
    parser = h.parser(__doc__, deadline_s=600)
    parser.add_argument("--port", type=int, default=0, help="HTTP port (default: a free one)")
    args = parser.parse_args()
    _serving.clear_overrides()
    found: dict[str, Any] = {}
    errors: list[str] = []
    blob = m.prepare_weights()
    weight_bytes = os.path.getsize(blob)
    with h.deadline_run(args.deadline_s, errors, _serving.shutdown) as deadline:
        base_url = _serving.start_serve(args.port or h.free_port())
        for key, name, base in VARIANTS:
            h.section(name, errors, functools.partial(
                measure_into, found, key, name, base, base_url, blob, deadline))
    fig = figures(found, weight_bytes)
    print_figures(fig)
    h.write_results("replica_memory", {
        "model": "all-MiniLM-L6-v2 (ember.deployments.embeddings.MiniLM)",
        "complete": not errors and len(found) == 2, "errors": errors, "summary": fig,
        "weights_bytes": weight_bytes, "raw": found,
        "config": {"replica_num_cpus": _serving.REPLICA_CPUS, "replicas": 2},
    }, short=args.short)
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
