"""``ember run``, ``status``, ``warm`` and ``plan``: serve an app and talk to a served one.

``plan --rps --p99-ms`` needs no server: it works from the committed measurements.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from ember import settings
from ember.cli._run import admin_key_path, cmd_run, ray_access_lines
from ember.cluster import capacity
from ember.cluster.defaults import DEFAULT_HOST, EDGE_NUM_CPUS, default_port
from ember.errors import ConfigError


def _admin_headers() -> dict[str, str]:
    """``Authorization`` with ``EMBER_ADMIN_KEY``, else the key ``ember run`` made here."""
    key = settings.load().admin_key
    if key is not None:
        return {"Authorization": f"Bearer {key.get_secret_value()}"}
    try:
        local = admin_key_path().read_text().strip()
    except OSError:
        return {}
    return {"Authorization": f"Bearer {local}"} if local else {}


def _get_status(url: str) -> dict[str, Any] | None:
    try:
        reply = httpx.get(f"{url.rstrip('/')}/-/status", headers=_admin_headers(), timeout=10)
    except httpx.HTTPError as exc:
        print(f"cannot reach Ember at {url}: {exc}", file=sys.stderr)
        return None
    if reply.status_code != 200:
        print(f"Ember answered {reply.status_code}: {reply.text[:200]}", file=sys.stderr)
        return None
    return dict(reply.json())


def cmd_status(args: argparse.Namespace) -> int:
    status = _get_status(args.url)
    if status is None:
        return 2
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        print(render_status(status))
    return 0


def _table(rows: Sequence[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def _cold_text(cold: dict[str, Any] | None) -> str:
    if not cold:
        return "-"
    phases = " ".join(f"{k}={v * 1000:.0f}" for k, v in cold.get("phases", {}).items() if v)
    text = f"{cold['total_s'] * 1000:.0f} ms via {cold['path']}"
    return f"{text} ({phases})" if phases else text


def render_status(status: dict[str, Any]) -> str:
    """A plain-text table of ``/-/status``, one row per deployment."""
    rows = [("DEPLOYMENT", "RUNNING", "STARTING", "ONGOING", "QUEUED", "FLOOR",
             "LAST COLD START (ms)")]
    for d in status["deployments"]:
        name = d["deployment"]
        if d.get("group", name) != name:  # a version: its label and share of the traffic
            name = f"{name} (v{d['version']}, {d['weight']}%)"
        rows.append((name, str(d["replicas_running"]), str(d["replicas_starting"]),
                     str(d["ongoing"]), str(d["queued"]), str(d["floor"]),
                     _cold_text(d.get("last_cold_start"))))
    ready = "ready" if status.get("ready") else "not ready"
    notes = [f"{d['deployment']}: {d[key]}" for d in status["deployments"]
             for key in ("waiting_for_resources", "pool_failure") if d.get(key)]
    notes += [_rollout_note(d) for d in status["deployments"] if d.get("rollout")]
    return "\n".join([f"app {status['app']} ({ready})", _table(rows), *notes,
                      *ray_access_lines(status.get("ray"))])


def _rollout_note(row: dict[str, Any]) -> str:
    """One line on the rollout to the version of ``row``."""
    r = row["rollout"]
    text = f"rollout {row['group']} v{r['from']} -> v{row['version']}: {r['state']}"
    if r["state"] == "running":
        text += f", step {r['step']}/{r['steps']} ({r['share']}%), {r['phase']}"
        if r.get("resumed"):
            text += ", resumed after a restart (this step started again)"
    return f"{text} ({r['reason']})" if r.get("reason") else text


def plan_rows(status: dict[str, Any]) -> list[tuple[str, ...]]:
    """Per deployment: budget, measured cold start, verdict and the floor that would meet it."""
    rows: list[tuple[str, ...]] = [("DEPLOYMENT", "BUDGET", "MEASURED", "VERDICT", "NEEDS")]
    for d in status["deployments"]:
        budget, cold = d.get("cold_start_budget_s"), d.get("last_cold_start")
        measured = f"{cold['total_s']:.3f}s via {cold['path']}" if cold else "-"
        if budget is None:
            verdict, needs = "no budget", "-"
        elif cold is None:
            verdict, needs = "not measured yet", "send one request at zero replicas"
        elif cold["total_s"] <= budget:
            verdict, needs = "meets", f"warm_floor={d['floor']}"
        else:
            verdict = "misses"
            needs = "warm_floor=1" if d["floor"] == 0 else f"warm_floor={d['floor'] + 1}"
        rows.append((d["deployment"], "-" if budget is None else f"{budget:.3f}s", measured,
                     verdict, needs))
    return rows


def cmd_plan(args: argparse.Namespace) -> int:
    if args.rps is not None or args.p99_ms is not None:
        return _plan_offline(args)
    status = _get_status(args.url)
    if status is None:
        return 2
    rows = plan_rows(status)
    print(_table(rows))
    return 1 if any(r[3] == "misses" for r in rows[1:]) else 0


#: Where the committed measurements live in a source checkout (``bench/results``).
RESULTS_DIR = Path("bench") / "results"


def results_file(given: Path | None, name: str) -> Path:
    """``given``, else ``bench/results/NAME`` under the current directory or the checkout
    Ember runs from.

    Raises:
        ConfigError: no such file; the message says which flag points at one.
    """
    if given is not None:
        candidates = [given]
    else:
        checkout = Path(__file__).resolve().parents[3]
        candidates = [RESULTS_DIR / name, checkout / RESULTS_DIR / name]
    for path in candidates:
        if path.is_file():
            return path
    raise ConfigError(f"no measurements at {candidates[0]}: run bench/{name.split('.')[0]}.py "
                      "or point --from / --coldstart at its results")


def _plan_offline(args: argparse.Namespace) -> int:
    """``plan --rps --p99-ms``: replicas and nodes from the committed measurements."""
    if args.rps is None or args.p99_ms is None:
        raise ConfigError("plan needs both --rps and --p99-ms to work from a latency target")
    curve_data = json.loads(results_file(args.curve_file, "batching_curve.json").read_text())
    cold_data = json.loads(results_file(args.coldstart_file, "coldstart.json").read_text())
    curve = capacity.curve_from_results(curve_data, args.curve)
    # Defaults describe the machine and the replica the curve was measured on.
    node_cpus = args.node_cpus or float(curve_data.get("host", {}).get("cpus", 1))
    replica_cpus = args.replica_cpus or float(curve_data.get("config", {}).get("torch_threads", 1))
    plan = capacity.plan_capacity(
        curve, rps=args.rps, p99_ms=args.p99_ms, node_cpus=node_cpus, replica_cpus=replica_cpus,
        edge_cpus=EDGE_NUM_CPUS, utilization=args.utilization, max_wait_ms=args.max_wait_ms,
        cold_paths=capacity.cold_paths_from_results(cold_data),
    )
    print(capacity.render_plan(plan, rps=args.rps, p99_target_ms=args.p99_ms))
    return 0


def cmd_warm(args: argparse.Namespace) -> int:
    path = f"/-/warm/{args.deployment}"
    body = (_admin_json(args, "DELETE", path) if args.off else
            _admin_json(args, "POST", path, params={"for": args.duration, "floor": args.floor}))
    if isinstance(body, int):
        return body
    if args.off:
        print(f"{args.deployment}: lease ended")
    else:
        print(f"{args.deployment}: floor {body['floor']} until "
              f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(body['until_s']))}")
    return 0


def parse_traffic(pairs: Sequence[str]) -> dict[str, int]:
    """``["1=90", "2=10"]`` -> ``{"1": 90, "2": 10}``; the server checks versions and sum.

    Raises:
        ValueError: a pair is not ``VERSION=PERCENT``.
    """
    weights: dict[str, int] = {}
    for pair in pairs:
        version, sep, percent = pair.partition("=")
        if not sep or not version or not percent.strip().lstrip("-").isdigit():
            raise ValueError(f"{pair!r} is not VERSION=PERCENT, e.g. 2=10")
        weights[version] = int(percent)
    return weights


def _admin_json(args: argparse.Namespace, method: str, path: str,
                **request: Any) -> dict[str, Any] | int:
    """Call an admin route of the server at ``args.url``: its JSON answer, or the exit code
    after saying what went wrong (2: unreachable, 1: refused)."""
    url = f"{args.url.rstrip('/')}{path}"
    try:
        reply = httpx.request(method, url, headers=_admin_headers(), timeout=30, **request)
    except httpx.HTTPError as exc:
        print(f"cannot reach Ember at {args.url}: {exc}", file=sys.stderr)
        return 2
    if reply.status_code != 200:
        print(f"Ember answered {reply.status_code}: {reply.text[:300]}", file=sys.stderr)
        return 1
    return dict(reply.json())


def cmd_traffic(args: argparse.Namespace) -> int:
    try:
        weights = parse_traffic(args.weights)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    path = f"/-/traffic/{args.deployment}"
    answer = (_admin_json(args, "PUT", path, json=weights) if weights
              else _admin_json(args, "GET", path))
    if isinstance(answer, int):
        return answer
    shares = ", ".join(f"v{v} {w}%" for v, w in answer["weights"].items())
    print(f"{args.deployment}: {shares}")
    return 0


def cmd_shadow(args: argparse.Namespace) -> int:
    body: dict[str, Any] | None = None
    if args.off:
        body = {"percent": 0}
    elif args.to is not None:
        body = {"to": args.to, "percent": args.percent}
    path = f"/-/shadow/{args.deployment}"
    answer = (_admin_json(args, "PUT", path, json=body) if body
              else _admin_json(args, "GET", path))
    if isinstance(answer, int):
        return answer
    shadow = answer["shadow"]
    print(f"{args.deployment}: " + (f"{shadow['percent']}% copied to v{shadow['to']}"
                                     if shadow["percent"] else "no shadow traffic"))
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``run``, ``status``, ``warm``, ``traffic``, ``shadow`` and ``plan``."""
    run = sub.add_parser("run", help="serve an app until Ctrl-C or SIGTERM, then drain; exit "
                         "0 after a clean drain, 3 if it ran out of time, 4 on a second signal")
    run.add_argument("target", help="module:app or path/to/file.py:app")
    run.add_argument("--host", default=DEFAULT_HOST)
    run.add_argument("--port", type=int, default=None, help="default: $EMBER_PORT or 8000")
    run.add_argument("--dashboard-port", type=int, default=0,
                     help="start Ray's dashboard on 127.0.0.1:PORT (local cluster; 0 = off)")
    run.add_argument("--state-dir", type=Path, default=None,
                     help="where traffic, rollouts, shadows and leases are kept across "
                     "restarts (default: ~/.local/share/ember/<app>)")
    run.set_defaults(func=cmd_run)
    url = settings.load().url or f"http://{DEFAULT_HOST}:{default_port()}"
    status = sub.add_parser("status", help="replicas, load and cold starts per deployment")
    status.add_argument("--json", action="store_true", help="print JSON")
    status.add_argument("--url", default=url)
    status.set_defaults(func=cmd_status)
    warm = sub.add_parser("warm", help="hold a warm floor for a while (a lease)")
    warm.add_argument("deployment")
    warm.add_argument("--for", dest="duration", default="10m", help="600, 90s, 10m, 2h, 1d")
    warm.add_argument("--floor", type=int, default=1)
    warm.add_argument("--off", action="store_true", help="end the lease now")
    warm.add_argument("--url", default=url)
    warm.set_defaults(func=cmd_warm)
    traffic = sub.add_parser("traffic", help="show or set the split between versions")
    traffic.add_argument("deployment")
    traffic.add_argument("weights", nargs="*", help="VERSION=PERCENT pairs, e.g. 1=90 2=10")
    traffic.add_argument("--url", default=url)
    traffic.set_defaults(func=cmd_traffic)
    shadow = sub.add_parser("shadow", help="show, set or end shadow copies to a version")
    shadow.add_argument("deployment")
    shadow.add_argument("--to", default=None, help="the version that gets the copies")
    shadow.add_argument("--percent", type=int, default=10, help="share of requests copied")
    shadow.add_argument("--off", action="store_true", help="stop copying")
    shadow.add_argument("--url", default=url)
    shadow.set_defaults(func=cmd_shadow)
    plan = sub.add_parser(
        "plan", help="does each deployment meet its cold-start budget? With --rps and "
        "--p99-ms: replicas and nodes for a latency target, from the measurements")
    plan.add_argument("--url", default=url)
    plan.add_argument("--rps", type=float, default=None, help="requests per second to serve")
    plan.add_argument("--p99-ms", type=float, default=None, help="p99 latency target")
    plan.add_argument("--from", dest="curve_file", type=Path, default=None,
                      help="batching results (default: bench/results/batching_curve.json)")
    plan.add_argument("--coldstart", dest="coldstart_file", type=Path, default=None,
                      help="cold-start results (default: bench/results/coldstart.json)")
    plan.add_argument("--curve", default="batched", help="which fitted curve (default: the "
                      "batched flagship)")
    plan.add_argument("--node-cpus", type=float, default=None,
                      help="CPUs per node (default: the measuring machine's)")
    plan.add_argument("--replica-cpus", type=float, default=None,
                      help="CPUs a busy replica uses (default: the measured torch threads)")
    plan.add_argument("--utilization", type=float, default=0.7,
                      help="load per replica as a share of its full throughput")
    plan.add_argument("--max-wait-ms", type=float, default=5.0,
                      help="the batch's max_wait_ms (the flagship's: 5)")
    plan.set_defaults(func=cmd_plan)
