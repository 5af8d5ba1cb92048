"""The request path under load: Ember against Ray Serve as its users run it, stock and tuned.

Each contender is started the way its users start it, alone on the machine, in a process
tree and a Ray cluster of its own, with the same filtered environment (``PATH``, ``HOME``,
the locale, ``PYTHONPATH`` for the model code, ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` and
``BENCH_TORCH_THREADS`` = ``--torch-threads``; no other ``RAY_*`` or ``EMBER_*`` variable):

* **Ember**: ``ember run _ember_minilm:app`` (``bench/_ember_minilm.py``): the flagship MiniLM
  deployment with Ember's defaults, its edges, its embedded cluster.
* **Ray Serve, stock**: ``serve run --address local <config>`` of ``bench/_rayserve_minilm.py``:
  ``@serve.deployment`` + ``@serve.batch`` as Ray's batching guide writes it, every option at
  Ray's default; the config file only sets the HTTP proxy to 127.0.0.1 and a free port.
* **Ray Serve, tuned**: the same with settings Ray documents: ``max_ongoing_requests=64``,
  access log off, ``RAY_SERVE_THROUGHPUT_OPTIMIZED=1``.

Same model code, the same batch (at most 32 texts, 5 ms wait), one replica; every contender
must return the same vector for the same text (max abs diff <= 1e-4). One text per request.

A round starts one contender, waits until it answers and its idle Ray workers are settled
(:func:`settle`: none busy over 2 s, whatever the contender), runs ``--warmup-s`` of untimed load at
c=32, ``--duration-s`` at c=1, ``--duration-s`` at c=32, and stops it with Ctrl-C (SIGINT,
then SIGTERM by PID for anything left). Rounds alternate the contenders (E, S, T, E, S, T...).
The load client is a process of its own (``python bench/_load.py``), the same for all.

Per contender and round, the same definitions for all:

* ``c1_p50_ms``: p50 latency at concurrency 1;
* ``c32_rps``: requests answered per second at concurrency 32 (closed loop);
* ``cpu_ms_per_request``: CPU (user + system) of the contender's whole family over the c=32
  run, divided by its requests: every process descended from the command we started (Ray's
  GCS, raylet, dashboard and its agents, the Serve controller, proxies or edges, replicas,
  idle workers) plus any process naming the same Ray session on its command line, found
  again at both reads so that reparented daemons count;
* ``mean_batch_per_request``: the size of the batch each request rode in, averaged over
  requests (sum of squared batch sizes / texts, counted by each deployment's handler).

Results: every round, the median and spread per contender, and the ratios of the medians
Ember / stock and Ember / tuned with their targets (req/s >= 1, CPU per request <= 1,
c=1 p50 <= 1).

Usage:
    .venv/bin/python bench/throughput.py [--short] [--rounds 3] [--duration-s 15]
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _harness as h
import _load
import httpx
import psutil

BIN = Path(sys.executable).parent
MAX_ABS_DIFF = 1e-4
PROBE_TEXT = 3
METRICS = ("c1_p50_ms", "c32_rps", "cpu_ms_per_request", "mean_batch_per_request")
#: (metric, comparison, target) of Ember / each Ray contender, on the medians.
TARGETS = (("c32_rps", ">=", 1.0), ("cpu_ms_per_request", "<=", 1.0),
           ("c1_p50_ms", "<=", 1.0))
IDLE_TITLE = "ray::IDLE"
SETTLE_WINDOW_S = 2.0
SETTLED_CPU_S = 0.02
SETTLE_CAP_S = 120.0
LOOPBACK = (h.HOST, "::ffff:127.0.0.1", "::1")
ENV_KEPT = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "USER")
TUNED_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}
TUNED_DEPLOYMENT = {"name": "MiniLMServe", "max_ongoing_requests": 64}
TUNED_LOGGING = {"enable_access_log": False}


@dataclass(frozen=True)
class Contender:
    key: str
    label: str
    body: str  # a :data:`_load.BODIES` key
    how: str  # what the results say about its settings


CONTENDERS = (
    Contender("ember", "Ember", "ember", "ember run _ember_minilm:app, Ember's defaults"),
    Contender("stock", "Ray Serve, stock", "object",
              "serve run, every Ray Serve option at its default"),
    Contender("tuned", "Ray Serve, tuned", "object",
              "serve run, max_ongoing_requests=64, access log off, "
              "RAY_SERVE_THROUGHPUT_OPTIMIZED=1"),
)


def clean_env(threads: int) -> dict[str, str]:
    """The environment every contender starts with: nothing of this process's Ray or Ember
    settings, the same torch threads."""
    env = {k: os.environ[k] for k in ENV_KEPT if k in os.environ}
    env.update(PYTHONPATH=f"{h.ROOT / 'src'}:{h.ROOT / 'bench'}",
               OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               BENCH_TORCH_THREADS=str(threads))
    return env


def serve_config(port: int, tuned: bool) -> dict[str, Any]:
    """``serve run``'s config file: the proxy on 127.0.0.1:port, the tuned options."""
    app: dict[str, Any] = {"name": "minilm", "route_prefix": "/embed",
                           "import_path": "_rayserve_minilm:app"}
    if tuned:
        app.update(deployments=[TUNED_DEPLOYMENT], logging_config=TUNED_LOGGING)
    return {"proxy_location": "HeadOnly", "http_options": {"host": h.HOST, "port": port},
            "applications": [app]}


def launch(contender: Contender, port: int, threads: int, workdir: Path) -> h.ServerProcess:
    """Start ``contender`` on ``port`` as its users would, in a session of its own."""
    env = clean_env(threads)
    if contender.key == "ember":
        argv = [str(BIN / "ember"), "run", "_ember_minilm:app", "--port", str(port)]
    else:
        config = workdir / f"serve-{contender.key}.yaml"
        config.write_text(json.dumps(serve_config(port, contender.key == "tuned"), indent=2))
        argv = [str(BIN / "serve"), "run", "--address", "local", str(config)]
        if contender.key == "tuned":
            env.update(TUNED_ENV)
    return h.ServerProcess(argv, env, inherit_env=False, cwd=workdir)


def embed_once(url: str, contender: Contender, deadline: h.Deadline) -> list[float] | None:
    """The probe text's vector, or None while the server does not answer 200."""
    try:
        reply = httpx.post(url, content=_load.BODIES[contender.body](PROBE_TEXT),
                           headers=_load.JSON_HEADERS, timeout=deadline.timeout(30.0))
    except httpx.HTTPError:
        return None
    return list(reply.json()["embedding"]) if reply.status_code == 200 else None


def wait_answering(server: h.ServerProcess, url: str, contender: Contender,
                   deadline: h.Deadline) -> list[float]:
    """Until the model answers (its replica is up); the probe text's vector."""
    vector: list[float] | None = None

    def answered() -> bool:
        nonlocal vector
        if server.proc.poll() is not None:
            tail = server.log.read_text(errors="replace")[-1500:] if server.log else ""
            raise RuntimeError(f"{contender.label} exited with {server.proc.returncode}: {tail}")
        vector = embed_once(url, contender, deadline)
        return vector is not None

    h.wait_until(answered, f"{contender.label} answering", deadline, cap_s=300.0, poll_s=0.5)
    assert vector is not None  # answered() returned True
    return vector


def stats(url: str, deadline: h.Deadline) -> dict[str, int]:
    reply = httpx.get(url + "/stats", timeout=deadline.timeout(30.0))
    reply.raise_for_status()
    return {k: int(v) for k, v in reply.json().items()}


def load(url: str, contender: Contender, c: int, duration_s: float,
         deadline: h.Deadline) -> dict[str, Any]:
    client = _load.LoadClient(url, contender.body, c, duration_s)
    return client.run(deadline.timeout(duration_s + 180.0))


def measured_c32(server: h.ServerProcess, url: str, contender: Contender, args: Any,
                 deadline: h.Deadline) -> dict[str, Any]:
    """The c=32 run with the family's CPU and the handler's batch counts around it."""
    client = _load.LoadClient(url, contender.body, 32, args.duration_s)
    before, family_before = stats(url, deadline), server.family()
    cpu_before = h.cpu_seconds(family_before)
    result = client.run(deadline.timeout(args.duration_s + 180.0))
    family = server.family()
    cpu_s = h.cpu_seconds(family) - cpu_before
    after = stats(url, deadline)
    d = {k: after[k] - before[k] for k in ("calls", "items", "items_sq")}
    n = result["requests"]
    tree = {p.pid for p in server.tree()}
    return {"result": result, "cpu_s": cpu_s,
            "cpu_ms_per_request": cpu_s * 1000.0 / n if n else None,
            "mean_batch_per_request": d["items_sq"] / d["items"] if d["items"] else None,
            "mean_batch_per_call": d["items"] / d["calls"] if d["calls"] else None,
            "handler_counts": d, "family_processes": len(family),
            "family_outside_tree": len({p.pid for p in family} - tree)}


def non_loopback_listeners(server: h.ServerProcess) -> list[str]:
    """Listening TCP sockets of the family not on 127.0.0.1 (Ray's own ports included)."""
    out: set[str] = set()
    for proc in server.family():
        try:
            conns = proc.net_connections(kind="tcp")
        except psutil.Error:
            continue
        out.update(f"{c.laddr.ip}:{c.laddr.port}" for c in conns
                   if c.status == psutil.CONN_LISTEN and c.laddr.ip not in LOOPBACK)
    return sorted(out)


def idle_workers_cpu(server: h.ServerProcess) -> dict[int, float]:
    """CPU seconds so far of each idle Ray worker (``ray::IDLE``) of the family."""
    out = {}
    for proc in server.family():
        with contextlib.suppress(psutil.Error):
            if " ".join(proc.cmdline()).startswith(IDLE_TITLE):
                out[proc.pid] = h.cpu_seconds([proc])
    return out


def settle(server: h.ServerProcess, deadline: h.Deadline) -> float:
    """Until no idle Ray worker of the family is busy; seconds waited.

    A cluster replaces the workers its replicas took with fresh idle ones, which import
    their libraries for seconds after the model first answers (Ember's warm runtime imports
    torch into them). Busy means more than :data:`SETTLED_CPU_S` of CPU in
    :data:`SETTLE_WINDOW_S`: an absolute amount, which a busy process exceeds even when the
    host's other work leaves it little of a core. The same rule for every contender.
    """
    def settled() -> bool:
        before = idle_workers_cpu(server)
        time.sleep(SETTLE_WINDOW_S)
        after = idle_workers_cpu(server)
        return all(after[pid] - before.get(pid, 0.0) < SETTLED_CPU_S for pid in after)

    try:
        return h.wait_until(settled, "idle workers settled", deadline, cap_s=SETTLE_CAP_S,
                            poll_s=0.0)
    except RuntimeError:
        return SETTLE_CAP_S  # measured anyway; the round records how long it waited


def one_round(contender: Contender, args: Any, deadline: h.Deadline,
              workdir: Path) -> dict[str, Any]:
    """Start ``contender``, measure it, stop it; its figures for this round."""
    port, started = h.free_port(), time.monotonic()
    server = launch(contender, port, args.torch_threads, workdir)
    url = f"http://{h.HOST}:{port}/embed"
    try:
        vector = wait_answering(server, url, contender, deadline)
        startup_s = time.monotonic() - started
        settle_s = settle(server, deadline)
        load(url, contender, 32, args.warmup_s, deadline)
        c1 = load(url, contender, 1, args.duration_s, deadline)
        c32 = measured_c32(server, url, contender, args, deadline)
        listeners = non_loopback_listeners(server)
    finally:
        server.interrupt()
    errors = c1["errors"] + c32["result"]["errors"]
    return {"contender": contender.key, "c1_p50_ms": c1["p50_ms"],
            "c32_rps": c32["result"]["throughput_rps"],
            "cpu_ms_per_request": c32["cpu_ms_per_request"],
            "mean_batch_per_request": c32["mean_batch_per_request"],
            "mean_batch_per_call": c32["mean_batch_per_call"],
            "c1_p99_ms": c1["p99_ms"], "c32_p50_ms": c32["result"]["p50_ms"],
            "c32_p99_ms": c32["result"]["p99_ms"], "c32_requests": c32["result"]["requests"],
            "errors": errors, "first_error": c1["first_error"] or c32["result"]["first_error"],
            "startup_s": round(startup_s, 1), "settle_s": round(settle_s, 1),
            "family_processes": c32["family_processes"],
            "family_outside_tree": c32["family_outside_tree"],
            "non_loopback_listeners": listeners, "vector": vector}


def spread(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "values": values}


def summarise(rounds: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per contender: median, min, max and every round's value of each metric."""
    out: dict[str, dict[str, Any]] = {}
    for c in CONTENDERS:
        rows = [r for r in rounds if r["contender"] == c.key]
        out[c.key] = {"label": c.label, "how": c.how, "rounds": len(rows)}
        for metric in METRICS:
            values = [r[metric] for r in rows if r[metric] is not None]
            out[c.key][metric] = spread(values) if values else None
    return out


def ratios(summary: dict[str, dict[str, Any]],
           rounds: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Ember / stock and Ember / tuned of each metric's median, with the targets, and the
    same ratio within each round (the contenders of one round ran minutes apart)."""
    out: dict[str, dict[str, Any]] = {}
    by_round = {(r["round"], r["contender"]): r for r in rounds}
    for peer in ("stock", "tuned"):
        for metric in METRICS:
            ember, other = summary["ember"][metric], summary[peer][metric]
            value = h.ratio(ember and ember["median"], other and other["median"])
            per_round = [h.ratio(by_round[n, "ember"][metric], by_round[n, peer][metric])
                         for n, key in by_round if key == "ember" and (n, peer) in by_round]
            row: dict[str, Any] = {"value": value, "per_round": per_round}
            for name, op, target in TARGETS:
                if name == metric:
                    met = value is not None and (value >= target if op == ">=" else value <= target)
                    row.update(target=f"{op} {target:g}", met=met)
            out[f"ember/{peer} {metric}"] = row
    return out


def check_same_model(rounds: list[dict[str, Any]]) -> float:
    """Max abs difference of every round's probe vector from the first; raises if too big."""
    ref = rounds[0]["vector"]
    diff = max(max(abs(a - b) for a, b in zip(ref, r["vector"], strict=True)) for r in rounds)
    if diff > MAX_ABS_DIFF:
        raise RuntimeError(f"contenders disagree on the same text: max abs diff {diff:.2e}")
    return float(diff)


def print_report(summary: dict[str, dict[str, Any]], ratio_rows: dict[str, Any]) -> None:
    def cell(row: dict[str, Any], metric: str, spec: str) -> str:
        s = row[metric]
        return "-" if s is None else (f"{s['median']:{spec}} ({s['min']:{spec}}-"
                                      f"{s['max']:{spec}})")

    print("\nMiniLM, one text per request; median (min-max) over rounds")
    h.print_table([["contender", "c=1 p50 ms", "c=32 req/s", "CPU ms/req", "batch/req"]] + [
        [row["label"], cell(row, "c1_p50_ms", ".1f"), cell(row, "c32_rps", ".1f"),
         cell(row, "cpu_ms_per_request", ".2f"), cell(row, "mean_batch_per_request", ".1f")]
        for row in summary.values()])
    print()
    h.print_table([["ratio", "value", "target", "met"]] + [
        [name, h.fmt(r["value"], ".2f"), r.get("target", ""), str(r.get("met", ""))]
        for name, r in ratio_rows.items()])


def with_retry(contender: Contender, args: Any, deadline: h.Deadline, workdir: Path,
               rnd: int, failures: list[str]) -> dict[str, Any]:
    """:func:`one_round`, started once more if the contender failed to start or run (Ray's
    node start times out on an overloaded host); each failure is kept in ``failures``."""
    try:
        return one_round(contender, args, deadline, workdir)
    except RuntimeError as exc:
        if isinstance(exc, h.DeadlineExceeded):
            raise
        failures.append(f"round {rnd} {contender.key}: {str(exc)[-300:]}")
        print(f"  round {rnd} {contender.label} failed, once more: {str(exc)[-200:]}",
              flush=True)
        return one_round(contender, args, deadline, workdir)


def run(args: Any, deadline: h.Deadline, rounds: list[dict[str, Any]],
        workdir: Path, failures: list[str]) -> None:
    """Alternating rounds into ``rounds``, each appended as soon as it is measured."""
    for rnd in range(1, args.rounds + 1):
        for contender in CONTENDERS:
            row = with_retry(contender, args, deadline, workdir, rnd, failures)
            rounds.append({"round": rnd, **row})
            print(f"  round {rnd}/{args.rounds} {contender.label:<17} c1 p50 "
                  f"{h.fmt(row['c1_p50_ms'], '.1f')} ms, c32 {h.fmt(row['c32_rps'], '.1f')} "
                  f"req/s, {h.fmt(row['cpu_ms_per_request'], '.2f')} CPU ms/req, batch/req "
                  f"{h.fmt(row['mean_batch_per_request'], '.1f')}, {row['errors']} errors, "
                  f"up in {row['startup_s']} s, settled in {row['settle_s']} s", flush=True)


def report(rounds: list[dict[str, Any]], doc: dict[str, Any]) -> None:
    """The summary and ratios of the rounds measured (all of them, or those before a
    failure: ``complete`` says which)."""
    doc["rounds"] = rounds
    if not rounds:
        return
    doc["same_model_max_abs_diff"] = check_same_model(rounds)
    for row in rounds:
        row.pop("vector", None)
    doc["contenders"] = summary = summarise(rounds)
    if all(summary[c.key]["rounds"] for c in CONTENDERS):
        doc["ratios"] = ratio_rows = ratios(summary, rounds)
        print_report(summary, ratio_rows)


def main() -> int:
    parser = h.parser(__doc__, deadline_s=2700)
    parser.add_argument("--rounds", type=int, help="alternating rounds (3; short 1)")
    parser.add_argument("--duration-s", type=float, help="seconds per concurrency (15; 6)")
    parser.add_argument("--warmup-s", type=float, help="untimed c=32 load first (5; 2)")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="torch threads of every contender (1)")
    args = h.pick(parser.parse_args(), rounds=(3, 1), duration_s=(15.0, 6.0),
                  warmup_s=(5.0, 2.0))
    doc: dict[str, Any] = {"model": "all-MiniLM-L6-v2", "config": {
        "rounds": args.rounds, "duration_s": args.duration_s, "warmup_s": args.warmup_s,
        "torch_threads": args.torch_threads, "batch": {"max_size": 32, "max_wait_ms": 5},
        "contenders": {c.key: c.how for c in CONTENDERS}, "env_kept": list(ENV_KEPT)}}
    errors: list[str] = []
    rounds: list[dict[str, Any]] = []
    failures: list[str] = doc.setdefault("retried_failures", [])
    with tempfile.TemporaryDirectory(prefix="bench-throughput-") as workdir, \
            h.deadline_run(args.deadline_s, errors) as deadline:
        h.section("throughput", errors,
                  lambda: run(args, deadline, rounds, Path(workdir), failures))
    h.section("report", errors, lambda: report(rounds, doc))
    doc.update(complete=not errors, errors=errors)
    h.write_results("throughput", doc, short=args.short)
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
