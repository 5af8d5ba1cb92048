"""Run the load-test scenarios against a local Ember and write a report (``make loadtest``).

    python loadtests/run.py [--short] [--app module:app] [--overload-app file.py:app]
        [--chaos-app file.py:app] [--rollout-app file.py:app] [--textgen-app module:app]
        [--out DIR]

Starts ``ember run`` on a free 127.0.0.1 port with ``EMBER_SCALEDOWN_AFTER_S`` short (so
the coldstart scenario does not wait minutes for zero replicas), runs ``coldstart`` and
``steady`` against ``--app``, ``coldstart-own`` against ``--app`` served without the warm
pool (the deployment's own replica, from the warm runtime, with a budget), then
``overload`` against ``--overload-app``, ``chaos`` (replicas SIGKILLed under load) and
``edge-chaos`` (edges SIGKILLed under load) against ``--chaos-app``, ``rollout`` (a
candidate version rolled out 5 -> 100% under load) against ``--rollout-app``,
``coldstart-lm`` (a ladder causal LM from zero, page cache cold) against ``--lm-app``, and
``textgen`` (streamed completions, TTFT and inter-token budgets) against ``--textgen-app`` (a
server per app and environment, shared by scenarios that name the same: by default the last
six share ``loadtests/server_app.py``), each as a headless locust
subprocess. Meanwhile a thread records ``/-/status`` every 0.5 s. Then it writes
``DIR/index.html`` (budgets, latency and replicas over time) next to locust's CSV and
HTML reports, and exits 1 if any scenario missed a budget. ``--short`` is the CI version:
few users, about 15 s of load per scenario (30 s for the chaos ones, which need time for two
kills and their recoveries).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import report

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
FLAGSHIP = "ember.deployments.embeddings:app"
#: Overload, chaos, rollout, coldstart-lm and textgen each drive their own deployment of one
#: app, on one server (``loadtests/server_app.py``).
OVERLOAD_APP = CHAOS_APP = ROLLOUT_APP = TEXTGEN_APP = LM_APP = "loadtests/server_app.py:app"
SAMPLE_EVERY_S = 0.5


@dataclass(frozen=True)
class Scenario:
    name: str
    target: str  # the option naming its app: "app", "overload_app", "chaos_app", "textgen_app"
    args: tuple[str, ...]
    timeout_s: float  # a hard stop for the locust process, beyond its own bounds
    locustfile: str = ""  # loadtests/<this>.py; the scenario's name when empty
    server_env: tuple[tuple[str, str], ...] = ()  # the server's environment, added


#: The own-replica cold start: no warm pool, so the deployment's own replica serves the burst,
#: from a pre-started worker (the warm runtime). Its budget, 3 s for the slowest cold request
#: under load, sits under the fresh-process figure in README (4.6-6.2 s for the flagship on 2
#: cores) and well above the idle figure (0.5-1.0 s), for a shared CI machine.
NO_POOL = (("EMBER_WARM_POOL", "0"),)
OWN_REPLICA_ARGS = ("--expect-path", "replica-warm-runtime", "--budget-cold-max-ms", "3000")


def bench_module(name: str) -> Any:
    """A module of ``bench/`` (the ladder's models, the benchmarks' shared harness)."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "bench"))


def coldstart_lm(short: bool, folder: Path, env: tuple[tuple[str, str], ...]) -> Scenario:
    """The 2 GB ladder model from zero with the page cache cold, in both forms (the short one
    waits less for zero). Its budgets: the slowest cold request under 20 s on 2 cores (the
    size bench measures 2.3 s from request to first answer, README, run 15), the load's GB/s at
    least 0.3x the disk's, measured in the same run, and no more than 10 major page faults
    in a cold answer's forward (the scenario's defaults)."""
    args = ("-u", "2", "--run-time", "300s", "--warm-requests", "2",
            "--zero-wait-s", "60" if short else "120", "--weights-dir", str(folder),
            "--budget-cold-max-ms", "20000", "--budget-disk-share", "0.3")
    return Scenario("coldstart-lm", "lm_app", args, 420 if short else 600, server_env=env,
                    locustfile="coldstart_lm")


def scenarios(short: bool) -> list[Scenario]:
    """The nine scenarios; ``short`` keeps CI to a few users and seconds each.

    Those of ``server_app.py`` share its server, so they share its environment too: the
    causal LM's weights, and no warm pool. coldstart-lm runs before textgen: each replica
    takes one of the two CPUs, with the others' floors beside them, so the LM's must be
    gone (``--scaledown-s`` idle) before TextGen's can start, and the LM's cold start meets
    no other replica starting."""
    folder = bench_module("model_ladder").ensure("2gb")
    env = (("EMBER_CAUSAL_LM_WEIGHTS", folder.as_uri()), *NO_POOL)
    plan = [replace(s, server_env=env) if s.target != "app" else s for s in _scenarios(short)]
    textgen = next(i for i, s in enumerate(plan) if s.name == "textgen")
    plan.insert(textgen, coldstart_lm(short, folder, env))
    return plan


def _scenarios(short: bool) -> list[Scenario]:
    if short:
        return [
            Scenario("coldstart", "app", ("-u", "4", "--run-time", "90s", "--warm-requests", "2",
                                          "--zero-wait-s", "60"), 240),
            Scenario("coldstart-own", "app", ("-u", "4", "--run-time", "90s",
                                              "--warm-requests", "2", "--zero-wait-s", "60",
                                              *OWN_REPLICA_ARGS), 240, "coldstart", NO_POOL),
            Scenario("steady", "app", ("-u", "4", "-r", "2", "--run-time", "15s"), 240),
            Scenario("overload", "overload_app", ("-u", "12", "-r", "12", "--run-time", "15s"),
                     240),
            # Kills at 10 s and 20 s; a recovery still under way at 30 s is waited for. Both
            # kills must happen: a run that kills once has not shown a second recovery.
            Scenario("chaos", "chaos_app", ("-u", "6", "-r", "6", "--run-time", "30s",
                                            "--kill-every-s", "10", "--budget-min-kills", "2"),
                     120),
            # An edge killed drops what is in flight on it, at most one request per user per
            # kill (the budget). Kills at 12 s and 24 s: an edge is back in about 4 s, so each
            # kill still meets a settled pair of edges (the full form kills every 20 s).
            Scenario("edge-chaos", "chaos_app", ("-u", "6", "-r", "6", "--run-time", "30s",
                                                 "--kill", "edge", "--kill-every-s", "12",
                                                 "--budget-min-kills", "2"), 120, "chaos"),
            Scenario("rollout", "rollout_app", ("-u", "6", "-r", "6", "--every-s", "4",
                                                "--run-time", "150s"), 200),
            Scenario("textgen", "textgen_app", ("-u", "4", "-r", "4", "--run-time", "15s"), 240),
        ]
    return [
        Scenario("coldstart", "app", ("-u", "8", "--run-time", "180s", "--warm-requests", "5"),
                 600),
        Scenario("coldstart-own", "app", ("-u", "8", "--run-time", "180s", "--warm-requests",
                                          "5", *OWN_REPLICA_ARGS), 600, "coldstart", NO_POOL),
        Scenario("steady", "app", ("-u", "8", "-r", "1", "--run-time", "60s"), 400),
        Scenario("overload", "overload_app", ("-u", "24", "-r", "24", "--run-time", "30s"), 400),
        Scenario("chaos", "chaos_app", ("-u", "12", "-r", "4", "--run-time", "90s",
                                        "--kill-every-s", "20"), 400),
        Scenario("edge-chaos", "chaos_app", ("-u", "12", "-r", "4", "--run-time", "90s",
                                             "--kill", "edge", "--kill-every-s", "20"), 400,
                 "chaos"),
        Scenario("rollout", "rollout_app", ("-u", "12", "-r", "4", "--every-s", "15",
                                            "--run-time", "300s"), 400),
        Scenario("textgen", "textgen_app", ("-u", "16", "-r", "4", "--run-time", "60s"), 400),
    ]


class ServerError(RuntimeError):
    pass


class Server:
    """``ember run TARGET`` as a child process (in its own session), stopped by its PID."""

    def __init__(self, target: str, log_path: Path, scaledown_s: float,
                 env: tuple[tuple[str, str], ...] = ()) -> None:
        self.target, self.log_path, self.scaledown_s = target, log_path, scaledown_s
        self.env = dict(env)
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self, timeout_s: float) -> str:
        # Below the ephemeral range: a port Ray's servers take by binding 0 cannot be it.
        port = bench_module("_harness").free_port()
        self.url = f"http://127.0.0.1:{port}"
        # The status sampler calls /-/status from loopback: the local-development opt-in.
        env = {**os.environ, "EMBER_SCALEDOWN_AFTER_S": str(self.scaledown_s),
               "EMBER_ADMIN_LOOPBACK": "1", "PYTHONUNBUFFERED": "1", **self.env}
        cmd = [sys.executable, "-m", "ember.cli", "run", self.target,
               "--host", "127.0.0.1", "--port", str(port)]
        with self.log_path.open("wb") as log:
            # Own session: if SIGTERM is not enough, the SIGKILL reaches Ray's children too.
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        print(f"[run] started `ember run {self.target}` (pid {self.proc.pid}) on {self.url}",
              flush=True)
        self._wait_ready(timeout_s)
        return self.url

    def _wait_ready(self, timeout_s: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"`ember run {self.target}` exited with {self.proc.returncode}"
                                  f":\n{self.log_tail()}")
            if "Press Ctrl-C" in self.log_path.read_text(errors="replace") and self._ready():
                return
            time.sleep(0.5)
        raise ServerError(f"`ember run {self.target}` not ready in {timeout_s:g}s:\n"
                          f"{self.log_tail()}")

    def _ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/readyz", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self, grace_s: float = 90.0) -> None:
        """SIGTERM (Ember shuts Serve and Ray down), then SIGKILL to the session if stuck."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            print(f"[run] pid {self.proc.pid} ignored SIGTERM for {grace_s:g}s; killing it",
                  flush=True)
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        print(f"[run] stopped `ember run {self.target}` (exit {self.proc.returncode})",
              flush=True)


class StatusRecorder(threading.Thread):
    """Samples ``/-/status`` every 0.5 s into ``samples``, one row per deployment."""

    def __init__(self, url: str, server: str, samples: list[dict[str, Any]]) -> None:
        super().__init__(daemon=True, name=f"status-{server}")
        self.url, self.server, self.samples = url, server, samples
        self.done = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=2.0) as client:
            while not self.done.is_set():
                # A missed sample is a gap in the plot, not a failed run.
                with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
                    self.samples.extend(self.sample(client))
                self.done.wait(SAMPLE_EVERY_S)

    def sample(self, client: httpx.Client) -> list[dict[str, Any]]:
        now = time.time()
        rows = client.get(f"{self.url}/-/status").json()["deployments"]
        return [{"t": now, "server": self.server, "deployment": r["deployment"],
                 "running": r["replicas_running"], "starting": r["replicas_starting"],
                 "ongoing": r["ongoing"], "queued": r["queued"]} for r in rows]

    def stop(self) -> None:
        self.done.set()
        self.join(timeout=10)


def locust_command(scenario: Scenario, url: str, out: Path) -> list[str]:
    name = scenario.name
    locustfile = HERE / f"{scenario.locustfile or name}.py"
    return [sys.executable, "-m", "locust", "-f", str(locustfile), "--headless",
            "-H", url, "--csv", str(out / name), "--csv-full-history",
            "--html", str(out / f"{name}.html"), "--only-summary",
            "--budget-report", str(out / f"{name}_budgets.json"),
            "--requests-log", str(out / f"{name}_requests.csv"), *scenario.args]


def wait_or_stop(proc: subprocess.Popen[bytes], timeout_s: float) -> tuple[int, bool]:
    """Wait for locust; past ``timeout_s`` SIGTERM it (it still writes its reports)."""
    try:
        return proc.wait(timeout=timeout_s), False
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=30), True
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait(timeout=30), True


def run_scenario(scenario: Scenario, url: str, server: Server, out: Path) -> dict[str, Any]:
    print(f"[run] {scenario.name}: locust {' '.join(scenario.args)}", flush=True)
    started = time.time()
    with (out / f"{scenario.name}.log").open("wb") as log:
        proc = subprocess.Popen(locust_command(scenario, url, out), cwd=ROOT,
                                stdout=log, stderr=subprocess.STDOUT)
        code, timed_out = wait_or_stop(proc, scenario.timeout_s)
    budget_file = out / f"{scenario.name}_budgets.json"
    result = json.loads(budget_file.read_text()) if budget_file.is_file() else {}
    error = f"locust ran past {scenario.timeout_s:g}s and was stopped" if timed_out else None
    run = {"name": scenario.name, "app": server.target, "server": server.target,
           "started": started, "ended": time.time(), "exit_code": code, "error": error,
           "budgets": result.get("budgets", []),
           "passed": code == 0 and bool(result.get("passed")) and not timed_out}
    for b in run["budgets"]:
        shown = b.get("detail") or ("-" if b["measured"] is None else f"{b['measured']:g}")
        limit = f"{'>=' if b['at_least'] else '<='} {b['limit']:g}{b['unit']}"
        print(f"    {'ok' if b['passed'] else 'MISSED':6} {b['name']}: {shown} ({limit})",
              flush=True)
    print(f"[run] {scenario.name}: {'PASS' if run['passed'] else 'FAIL'} (exit {code}, "
          f"{run['ended'] - started:.0f} s)", flush=True)
    return run


def not_run(scenario: Scenario, target: str, error: str) -> dict[str, Any]:
    now = time.time()
    return {"name": scenario.name, "app": target, "server": target, "started": now,
            "ended": now, "exit_code": None, "error": error, "budgets": [], "passed": False}


def serve_and_run(target: str, group: list[Scenario], args: argparse.Namespace,
                  samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One server for ``group``; always stopped, whatever happens to the scenarios."""
    out = args.out
    env = group[0].server_env
    label = "_".join([target, *(f"{k}-{v}" for k, v in env)])
    label = label.replace("/", "_").replace(":", "_")[-120:]
    server = Server(target, out / f"server-{label}.log", args.scaledown_s, env)
    recorder: StatusRecorder | None = None
    try:
        url = server.start(args.startup_timeout_s)
        recorder = StatusRecorder(url, target, samples)
        recorder.start()
        return [run_scenario(s, url, server, out) for s in group]
    except ServerError as exc:
        print(f"[run] {exc}", file=sys.stderr, flush=True)
        return [not_run(s, target, str(exc).splitlines()[0]) for s in group]
    finally:
        if recorder is not None:
            recorder.stop()
        server.stop()


def write_samples(path: Path, samples: list[dict[str, Any]]) -> None:
    fields = ["t", "server", "deployment", "running", "starting", "ongoing", "queued"]
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(samples)


def clear_previous(out: Path, names: list[str]) -> None:
    """Remove the files an earlier run left, so the report never mixes two runs."""
    for name in names:
        for path in out.glob(f"{name}*"):
            path.unlink()
    for path in [*out.glob("server-*.log"), out / "index.html", out / "replicas.csv"]:
        path.unlink(missing_ok=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--short", action="store_true", help="CI version: short and light")
    parser.add_argument("--app", default=FLAGSHIP, help="app for coldstart and steady")
    parser.add_argument("--overload-app", default=OVERLOAD_APP,
                        help="app for overload: needs a deployment with a small max_queue")
    parser.add_argument("--chaos-app", default=CHAOS_APP,
                        help="app for chaos: a deployment of 2 replicas answering their PID")
    parser.add_argument("--rollout-app", default=ROLLOUT_APP,
                        help="app for rollout: a deployment with versions 1 and 2")
    parser.add_argument("--textgen-app", default=TEXTGEN_APP,
                        help="app for textgen: OpenAI completions over a streaming handler")
    parser.add_argument("--lm-app", default=LM_APP,
                        help="app for coldstart-lm: EMBER_CAUSAL_LM_WEIGHTS is set for it")
    parser.add_argument("--out", type=Path, default=HERE / "reports", help="report directory")
    parser.add_argument("--scaledown-s", type=float, default=3.0,
                        help="EMBER_SCALEDOWN_AFTER_S for the server (default 3)")
    parser.add_argument("--startup-timeout-s", type=float, default=300.0)
    args = parser.parse_args(argv)
    args.out = args.out.resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    plan = scenarios(args.short)
    clear_previous(args.out, [s.name for s in plan])
    groups: dict[tuple[str, tuple[tuple[str, str], ...]], list[Scenario]] = {}
    for scenario in plan:  # dicts keep order: --app's scenarios first
        key = (getattr(args, scenario.target), scenario.server_env)
        groups.setdefault(key, []).append(scenario)
    samples: list[dict[str, Any]] = []
    started = time.monotonic()
    runs = [run for (target, _), group in groups.items()
            for run in serve_and_run(target, group, args, samples)]
    write_samples(args.out / "replicas.csv", samples)
    title = "Ember load tests" + (" (short)" if args.short else "")
    index = report.write_report(args.out, runs, samples, title)
    passed = all(run["passed"] for run in runs)
    print(f"[run] {'PASS' if passed else 'FAIL'} in {time.monotonic() - started:.0f} s; "
          f"report: {index}", flush=True)
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
