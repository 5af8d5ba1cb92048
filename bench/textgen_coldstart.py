"""Generation from zero replicas at model size: Ember against Ray Serve as its users run it.

Each trial starts one contender fresh, alone on the machine, in a process tree and a Ray
cluster of its own (``throughput.launch``'s filtered environment, one torch thread), waits
until it serves and holds no replica of the model, gives the page cache the trial's state
and memory the same wait (``_sizes_limits.settle``), then times one streamed greedy request
of ``TOKENS`` tokens from send to the first token's bytes (``ttft_s``) and to the last
(``total_s``), and stops the contender by PID. Rounds alternate the order.

* **Ember**: ``ember run ember.deployments.textgen:app`` with ``EMBER_TEXTGEN_MODEL`` the
  folder's ``file://`` URL (the weights through the loaders, mapped from the node cache,
  which one untimed load fills before the trials) and ``EMBER_WARM_POOL=0``: the
  deployment's own replica answers (the warm pool would answer from a process that already
  holds the model: a warm hit, not a cold start). ``POST /v1/completions``, streamed.
* **Ray Serve**: ``serve run _rayserve_textgen:build model_dir=<folder>``: a deployment that
  calls ``from_pretrained`` in its constructor and streams ``generate()``, scaled to zero
  as Ray Serve documents it (``min_replicas: 0``, the rest at Ray's defaults).

Paths: ``disk_warm`` (every file either reads is in the page cache) and ``disk_cold``
(evicted with ``posix_fadvise(DONTNEED)``). The folder is ``bench/textgen_sizes.py``'s: the
size ladder's rung hard-linked beside a tokenizer that names every id.

Usage:
    .venv/bin/python bench/textgen_coldstart.py [--size 2gb] [--trials 3] [--short]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _harness as h
import _sizes_limits as limits
import httpx
import textgen_sizes as sizes
import throughput as tp

PROMPT = "def main():\n    "
TOKENS = 8
CONTENDERS = ("ember", "rayserve")
QUIET_S = 3.0  # after the contender is up and at zero, before the page cache is set


def launch(contender: str, folder: Path, port: int, cache: Path, workdir: Path
           ) -> h.ServerProcess:
    env = tp.clean_env(1)
    if contender == "ember":
        env.update(EMBER_TEXTGEN_MODEL=folder.as_uri() + "/", EMBER_WARM_POOL="0",
                   EMBER_CACHE_DIR=str(cache), EMBER_ADMIN_LOOPBACK="1")
        argv = [str(tp.BIN / "ember"), "run", "ember.deployments.textgen:app",
                "--port", str(port)]
    else:
        config = workdir / "serve-textgen.yaml"
        config.write_text(json.dumps({
            "proxy_location": "HeadOnly", "http_options": {"host": h.HOST, "port": port},
            "applications": [{"name": "textgen", "route_prefix": "/",
                              "import_path": "_rayserve_textgen:build",
                              "args": {"model_dir": str(folder)}}]}))
        argv = [str(tp.BIN / "serve"), "run", "--address", "local", str(config)]
    return h.ServerProcess(argv, env, inherit_env=False, cwd=workdir)


def wait_at_zero(contender: str, url: str, server: h.ServerProcess,
                 deadline: h.Deadline) -> None:
    """Until the contender serves and holds no replica of the model."""
    if contender == "ember":
        server.wait_ready(f"{url}/readyz", deadline)
        h.wait_until(lambda: _ember_replicas(url) == 0, "TextGen at zero", deadline)
    else:
        h.wait_until(lambda: _routes(url, server), "the app's route", deadline, poll_s=0.5)
    time.sleep(QUIET_S)


def _ember_replicas(url: str) -> int | None:
    try:
        loads = httpx.get(f"{url}/-/status", timeout=5).json()["deployments"]
    except (httpx.HTTPError, ValueError, KeyError):
        return None
    return next((int(d["replicas_running"]) + int(d["replicas_starting"]) for d in loads
                 if d["deployment"] == "TextGen"), None)


def _routes(url: str, server: h.ServerProcess) -> bool:
    if server.proc.poll() is not None:
        raise RuntimeError(f"serve run exited with {server.proc.returncode}")
    try:
        return "/" in httpx.get(f"{url}/-/routes", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return False


def timed_request(contender: str, url: str, folder: Path) -> dict[str, Any]:
    """One streamed request from send: seconds to the first token's text and to the end."""
    if contender == "ember":
        target = f"{url}/v1/completions"
        body: dict[str, Any] = {"model": folder.name, "prompt": PROMPT, "max_tokens": TOKENS,
                                "temperature": 0, "stream": True, "ignore_eos": True}
    else:
        target, body = f"{url}/", {"prompt": PROMPT, "max_tokens": TOKENS}
    texts: list[str] = []
    first: float | None = None
    sent = time.perf_counter()
    with httpx.stream("POST", target, json=body, timeout=600) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"{contender}: {reply.status_code} {reply.read()[:300]!r}")
        for piece in (_sse_texts(reply) if contender == "ember" else reply.iter_text()):
            if piece and first is None:
                first = time.perf_counter()
            texts.append(piece)
    done = time.perf_counter()
    return {"ttft_s": round((first or done) - sent, 4), "total_s": round(done - sent, 4),
            "text": "".join(texts), "cold_start": reply.headers.get("x-ember-cold-start")}


def _sse_texts(reply: httpx.Response) -> Any:
    for line in reply.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            choices = json.loads(line[6:]).get("choices") or [{}]
            yield choices[0].get("text", "")


def trial(contender: str, path: str, folder: Path, cache: Path) -> dict[str, Any]:
    deadline = h.Deadline(600)
    port = h.free_port()
    url = f"http://{h.HOST}:{port}"
    with tempfile.TemporaryDirectory(prefix="bench-textgen-") as work:
        server = launch(contender, folder, port, cache, Path(work))
        try:
            wait_at_zero(contender, url, server, deadline)
            files = sizes.files_read(folder, cache)
            if path == "disk_cold":
                limits.drop(files)
            else:
                limits.pagecache_bandwidth(files)
            limits.settle(sum(p.stat().st_size for p in folder.glob("*.safetensors")))
            return timed_request(contender, url, folder)
        finally:
            server.interrupt()


def fill_node_cache(folder: Path, cache: Path) -> None:
    """One untimed load through the loaders: the node cache holds the blobs after it."""
    sizes.run_child("ember", folder, {**os.environ, "EMBER_CACHE_DIR": str(cache),
                                      "OMP_NUM_THREADS": "1", "PYTHONPATH": str(sizes.HERE)})


def row(size: str, path: str, trials: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    med = {c: {k: round(statistics.median(t[k] for t in trials[c]), 3)
               for k in ("ttft_s", "total_s")} for c in CONTENDERS}
    texts = {t["text"] for c in CONTENDERS for t in trials[c]}
    return {"size": size, "path": path, "medians": med,
            "ttft_ratio_rayserve_over_ember": round(med["rayserve"]["ttft_s"]
                                                    / med["ember"]["ttft_s"], 2),
            "same_text": len(texts) == 1, "trials": trials}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="2gb")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--short", action="store_true", help="0.5gb, two trials")
    args = parser.parse_args()
    size, trials = ("0.5gb", 2) if args.short else (args.size, args.trials)
    folder = sizes.folder_for(size)
    cache = folder.parent.parent / "textgen-node-cache"
    fill_node_cache(folder, cache)
    rows = []
    for path in ("disk_warm", "disk_cold"):
        got: dict[str, list[dict[str, Any]]] = {c: [] for c in CONTENDERS}
        for r in range(trials):
            for contender in (CONTENDERS if r % 2 == 0 else CONTENDERS[::-1]):
                got[contender].append(trial(contender, path, folder, cache))
                print(f"{size} {path} {contender}: {got[contender][-1]['ttft_s']:.2f} s",
                      flush=True)
        rows.append(row(size, path, got))
    for r in rows:
        print(f"{r['size']} {r['path']}: ttft Ember {r['medians']['ember']['ttft_s']:.2f} s, "
              f"Ray Serve {r['medians']['rayserve']['ttft_s']:.2f} s "
              f"({r['ttft_ratio_rayserve_over_ember']:.2f}x; same text: {r['same_text']})")
    name = "textgen_coldstart.short.json" if args.short else "textgen_coldstart.json"
    out = {"benchmark": "textgen_coldstart", "size": size, "trials": trials, "rows": rows,
           "tokens": TOKENS, "host": h.host_facts(args.short), "complete": True}
    (sizes.RESULTS / name).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {sizes.RESULTS / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
