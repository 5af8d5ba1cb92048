"""Cold starts at real model sizes: ladder models of 0.5, 2 and 6 GB, request to first answer.

For each size (``bench/model_ladder.py``), through Ember's edges on a local Ray cluster, a
``causal_lm`` deployment scaled to zero is sent one ``POST /lm`` (one forward pass) per
trial, on four paths:

1. ``disk_warm``: the node cache's blobs, every page in the page cache, as a replica's cold
   read left them (dropped, then mapped and populated with the deployment's loader
   options: the size of the page-cache folios that read leaves decides what mapping them
   costs, see ``bench/page_reads.py``);
2. ``disk_cold``: the same blobs with their pages dropped (``POSIX_FADV_DONTNEED``, checked
   with ``mincore``) before the trial, and the origin's files with them, as before each peer's
   cold load (runs before commit 219dc1b kept the files resident for the
   replica's trial only, and its read met a page cache fuller by the model's size);
3. ``regional``: the same files from an S3-protocol server on loopback (moto, O(range)
   ranged GETs), the node cache emptied before the trial;
4. ``second_replica``: a second deployment of the same model and cache cold-starts while
   the first one is held by a warm floor (no requests): it maps the first one's page-cache
   pages.

The same run measures the limits on the same files (cold sequential read, page-cache read,
the S3 server's ceiling with a plain parallel ranged-GET client; ``_sizes_limits.py``) and
the peers a user would pick, each building the same model from the same files in a worker
that has imported torch and transformers once (``_sizes_peer.py``), Ember's own load
(``ember``) among them. Rounds alternate Ember's cluster trial and the peers; medians. On
``disk_warm`` each peer's timed load follows a cold load of its own (untimed, kept as
``own_cold_read``), so it finds the pages as its own reads left them.

Each cold trial starts from a node at rest: no replica of the deployment, and the warm
runtime's idle workers back and done importing (the one the last trial took is replaced a
few seconds later; a trial that met it importing would time that import). The second
replica's start follows its first replica's at once, so it may still meet one.

The cluster's warm-runtime workers preload what ``ember run`` preloads for the app (the
deployment's module, with transformers' model code), so ``weights`` is the load itself; each
trial records the modules its replica still imported in ``setup()`` (``setup_imports``).

Every timed load (trials and peers alike) first waits the same time for the memory freed
before it (``_sizes_limits.settle``): on a VM that hands freed memory back to its host, a
load right after another one freed its model reuses that memory for less, and the order of
the contenders would decide the race.

The S3 ceiling is measured again before each ``regional`` trial (the machine is shared and
its speed moves); the ``regional`` limit is the median of those measurements.

Usage:
    .venv/bin/python bench/coldstart_sizes.py [--short] [--sizes 0.5gb 2gb] [--trials 3]
        [--paths regional ...]

``--paths`` runs a subset of the paths and writes ``coldstart_sizes_<paths>[.short].json``
beside the full file instead of replacing it. ``--huge-pages on|off`` runs every Ember load
with ``LoaderConfig(huge_pages=True|False)`` instead of the default ``"auto"`` (off on a
machine whose balloon reports free pages, as this project's VM); ``on`` adds ``_huge_pages``
to the file's name.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _harness as h
import _serving
import _sizes_limits as lim
import httpx
import model_ladder
import psutil

from ember.loaders import LoaderConfig

TOKENS = [1, 306, 496, 445, 124, 289]  # under the tiny rung's vocabulary of 512
PEERS_DISK = ("ember", "from_pretrained", "load_file", "fastsafetensors", "runai")
PEERS_S3 = ("ember", "runai", "s3_download+from_pretrained")
PATHS = ("disk_cold", "disk_warm", "regional", "second_replica")
S3_OPTIONS = {"key": "testing", "secret": "testing"}


@functools.cache
def preload() -> tuple[str, ...]:
    """What ``ember run`` preloads for a causal-LM app: the deployment's module, which imports
    transformers' model code; the architecture's module is left to ``setup()``, as for users."""
    from ember.cluster.runtime import app_modules
    from ember.deployments.causal_lm import causal_lm_app

    return tuple(app_modules(causal_lm_app("file:///unused")))


class Peers:
    """One peer worker process: imports once, loads on command."""

    def __init__(self, endpoint: str) -> None:
        env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint,
               "AWS_EC2_METADATA_DISABLED": "true",
               "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0"}
        script = Path(__file__).resolve().parent / "_sizes_peer.py"
        self.proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        self.endpoint = endpoint
        self.ready = self._answer()

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the peer worker died")
        return dict(json.loads(line))

    def load(self, loader: str, folder: Path, url: str = "",
             options: dict[str, Any] | None = None) -> dict[str, Any]:
        assert self.proc.stdin is not None
        command = {"loader": loader, "folder": str(folder), "url": url,
                   "endpoint": self.endpoint, "options": options}
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


class Rung:
    """One size's files, URLs, caches and deployments."""

    def __init__(self, size: str, work: Path, endpoint: str,
                 huge_pages: bool | str = "auto") -> None:
        self.size = size
        self.folder = model_ladder.ensure(size)
        self.files = sorted(self.folder.glob("*.safetensors"))
        self.bytes = sum(p.stat().st_size for p in self.files)
        tag = size.replace(".", "")
        self.app = f"sizes-{tag}"
        self.names = {"a": f"LM{tag}", "b": f"LM{tag}b", "r": f"LM{tag}r"}
        self.disk_cache = work / f"node-{tag}"
        self.reg_cache = work / f"node-{tag}-regional"
        self.disk_opts = {"cache_dir": str(self.disk_cache), "min_free_bytes": 0,
                          "huge_pages": huge_pages}
        self.s3_opts = {"cache_dir": str(self.reg_cache), "min_free_bytes": 0,
                        "huge_pages": huge_pages,
                        "range_bytes": 8 << 20, "max_concurrency": 8,
                        "storage_options": {**S3_OPTIONS,
                                            "client_kwargs": {"endpoint_url": endpoint}}}
        self.s3_url = lim.upload(endpoint, "ladder", size, self.folder)
        from ember.loaders import resolve

        resolve(self.folder.as_uri(), config=self.disk_opts)
        self.blobs = sorted(p for p in self.disk_cache.glob("*/blobs/*") if p.is_file())

    def build(self) -> Any:
        import ember
        from ember.deployments.causal_lm import causal_lm_deployment

        common = {"num_cpus": _serving.REPLICA_CPUS, "scaledown_after_s": _serving.SCALEDOWN_S}
        url = self.folder.as_uri()
        return ember.App([
            causal_lm_deployment(url, deployment=self.names["a"], route="/lm",
                                 loader_options=self.disk_opts, **common),
            causal_lm_deployment(url, deployment=self.names["b"], route="/lm-b",
                                 loader_options=self.disk_opts, **common),
            causal_lm_deployment(self.s3_url, deployment=self.names["r"], route="/lm-r",
                                 loader_options=self.s3_opts, **common),
        ], name=self.app, warm_pool=0)


def wait_zero(rung: Rung, key: str, base: str, deadline: h.Deadline) -> None:
    name = rung.names[key]
    h.wait_until(lambda: _serving.replicas(rung.app, name) == 0, f"{name} at zero", deadline)
    h.wait_until(lambda: _serving.ingress_view(base, name) == 0, f"edge: {name} at zero",
                 deadline)
    time.sleep(1.0)
    _serving.wait_warm_runtime(deadline)


def post(url: str, deadline: h.Deadline) -> tuple[dict[str, Any], float, dict[str, float]]:
    start = time.perf_counter()
    reply = httpx.post(url, json=TOKENS, timeout=deadline.timeout(600))
    took = time.perf_counter() - start
    if reply.status_code != 200:
        raise RuntimeError(f"POST {url} -> {reply.status_code}: {reply.text[:300]}")
    return reply.json(), took, _serving.cold_header(reply)[1]


def cluster_trial(rung: Rung, path: str, base: str, deadline: h.Deadline) -> dict[str, Any]:
    """One cold request on ``path``; its anatomy, load report and memory."""
    key = {"regional": "r", "second_replica": "b"}.get(path, "a")
    wait_zero(rung, key, base, deadline)
    out: dict[str, Any] = {}
    if path == "disk_cold":
        # The origin's files too, as each peer's cold round drops them: left resident, the
        # replica read into a page cache fuller by the model's size, and reclaimed as it read.
        out["resident_after_drop_bytes"] = lim.drop(rung.files + rung.blobs)
    elif path == "disk_warm":
        read_as_a_replica(rung)
    elif path == "regional":
        shutil.rmtree(rung.reg_cache, ignore_errors=True)
    out["settle_s"] = lim.settle(rung.bytes)
    if path == "second_replica":
        return {**out, **second_replica(rung, base, deadline)}
    route = {"regional": "/lm-r"}.get(path, "/lm")
    body, took, phases = post(base + route, deadline)
    out.update(total_s=took, phases_s=phases, load=body["load"], memory=body["memory"],
               **_forwards(body))
    if path == "disk_warm":
        out["forward_s"] = post(base + route, deadline)[1]  # the same replica, warm
    return out


def read_as_a_replica(rung: Rung) -> None:
    """Drop the blobs' pages, then read them in as a replica's cold load does (its mapping
    and advice, then populate), and unmap: the page cache a warm start finds."""
    from ember.loaders._reader import buffer_address
    from ember.loaders._tensors import MappedFile
    from ember.loaders.pages import populate

    if lim.drop(rung.blobs):
        raise RuntimeError("pages stayed resident after the drop")
    cfg = LoaderConfig(**rung.disk_opts)
    for blob in rung.blobs:
        mapped = MappedFile(blob, cfg.max_header_bytes, huge_pages=cfg.maps_huge())
        populate([(buffer_address(mapped.buffer), len(mapped.buffer))])
        mapped.buffer.close()


def _forwards(body: dict[str, Any]) -> dict[str, Any]:
    """The cold request's own forward (timed in the replica) and how many the replica ran."""
    return {"first_forward_s": body.get("forward_s"), "forwards": body.get("forwards"),
            "first_forward_faults": body.get("forward_faults"),
            "first_forward_cpu_s": body.get("forward_cpu_s"),
            "setup_imports": body.get("setup_imports")}


def second_replica(rung: Rung, base: str, deadline: h.Deadline) -> dict[str, Any]:
    """B cold-starts while A holds the model: A is kept by a warm floor (Ember's lease), not
    by requests, whose forwards would take CPU from B's start, the more so the larger the
    model (a 6 GB forward reads every weight)."""
    first, _, _ = post(base + "/lm", deadline)
    lease = f"{base}/-/warm/{rung.names['a']}"
    httpx.post(lease, params={"for": "600", "floor": 1}, timeout=30).raise_for_status()
    try:
        lim.settle(0)  # A's first request may have freed memory as it ran
        # A took an idle worker; as every other trial, B starts once its replacement has
        # imported, or B's start would share the cores with that import.
        _serving.wait_refilled(deadline)
        body, took, phases = post(base + "/lm-b", deadline)
        pss = {}
        for label, pid in (("a", first["pid"]), ("b", body["pid"])):
            info = psutil.Process(pid).memory_full_info()
            pss[label] = {"rss_bytes": info.rss, "pss_bytes": info.pss}
    finally:
        httpx.delete(lease, timeout=30)
    return {"total_s": took, "phases_s": phases, "load": body["load"],
            "memory": body["memory"], "both_replicas": pss, "a_held_by": "warm floor",
            **_forwards(body)}


def peer_round(peers: Peers, rung: Rung, path: str, work: Path, base: str,
               deadline: h.Deadline) -> dict[str, Any]:
    """Every peer once on ``path``'s conditions."""
    out: dict[str, Any] = {}
    names = PEERS_S3 if path == "regional" else PEERS_DISK
    # A live replica maps the blobs (mapped pages cannot be dropped), and the regional one
    # holds its weights' memory, which the memory check would count against the peer.
    if path in ("disk_cold", "regional"):
        wait_zero(rung, "r" if path == "regional" else "a", base, deadline)
    for name in names:
        options: dict[str, Any] | None = rung.disk_opts
        url = ""
        left, first = None, None
        if path == "disk_cold":
            left = lim.drop(rung.files + rung.blobs)
        elif path == "disk_warm":
            # The pages as this peer's own cold read leaves them, as Ember's trial finds
            # them (read_as_a_replica): their folio size decides what mapping them costs.
            # The live replica's mapping keeps the blobs resident (``ember``'s cold read
            # is then warm, on the pages that replica's cold read left): recorded.
            left = lim.drop(rung.files + rung.blobs)
            lim.settle(rung.bytes)
            first = peers.load(name, rung.folder, url=url, options=options)
        elif path == "regional":
            scratch = work / f"peer-cache-{rung.size}"
            shutil.rmtree(scratch, ignore_errors=True)
            options = {**rung.s3_opts, "cache_dir": str(scratch)}
            url = rung.s3_url
        lim.settle(rung.bytes)  # the peer before it freed a model: see _sizes_limits
        out[name] = peers.load(name, rung.folder, url=url, options=options)
        if left is not None:  # a peer that found pages resident did not load cold (first)
            out[name]["resident_after_drop_bytes"] = left
        if first is not None:
            out[name]["own_cold_read"] = first
        print(f"    peer {name:<28} {out[name]}", flush=True)
    return out


def limits(rung: Rung, endpoint: str) -> dict[str, Any]:
    keys = [(f"{rung.size}/{p.name}", p.stat().st_size) for p in rung.files]
    return {"disk_cold": lim.disk_bandwidth(rung.blobs),
            "page_cache": lim.pagecache_bandwidth(rung.blobs),
            "s3": lim.s3_ceiling(endpoint, "ladder", keys)}


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def _spread(values: list[float]) -> list[float] | None:
    return [round(min(values), 4), round(max(values), 4)] if values else None


def summarise(rung: Rung, path: str, trials: list[dict[str, Any]], peer_rounds: list[Any],
              lims: dict[str, Any]) -> dict[str, Any]:
    """One row: medians, the limit for ``path``, peers, ratios against the targets."""
    totals = [t["total_s"] for t in trials]
    weights = [t["phases_s"].get("weights", 0.0) for t in trials]
    pages = [t["load"]["phases_s"].get("pages_read", 0.0) for t in trials]
    read = [t["load"]["read_bytes"] for t in trials]
    anatomy = {k: _median([t["phases_s"].get(k, 0.0) for t in trials])
               for k in ("queue", "start", "import", "weights", "warmup", "route")}
    anatomy["load"] = {k: _median([t["load"]["phases_s"].get(k, 0.0) for t in trials])
                       for k in trials[0]["load"]["phases_s"]} if trials else {}
    peers = {n: _median([r[n]["seconds"] for r in peer_rounds if "seconds" in r.get(n, {})])
             for n in (peer_rounds[0] if peer_rounds else {})}
    errors = {n: r[n]["error"] for r in peer_rounds for n in r if "error" in r[n]}
    gbps = {"disk_cold": lims["disk_cold"]["gbps"], "regional": lims["s3"]["gbps"],
            "disk_warm": lims["page_cache"]["gbps"],
            "second_replica": lims["page_cache"]["gbps"]}[path]
    limit_s = rung.bytes / (gbps * 1e9)
    forward = _median([t["forward_s"] for t in trials if "forward_s" in t])
    first = [t["first_forward_s"] for t in trials if t.get("first_forward_s") is not None]
    # Request to a replica ready to compute: the request's own forward taken out, so that a
    # start can be compared across sizes whose forward passes differ.
    starts = [t["total_s"] - t["first_forward_s"] for t in trials
              if t.get("first_forward_s") is not None]
    if path == "disk_warm" and forward is not None:
        limit_s += forward
    row: dict[str, Any] = {
        "size": rung.size, "size_gb": round(rung.bytes / 1e9, 3), "path": path,
        "bytes": rung.bytes, "total_s": _median(totals), "total_spread_s": _spread(totals),
        "weights_s": _median(weights), "weights_gbps": round(rung.bytes / _median(weights) / 1e9,
                                                             3) if _median(weights) else None,
        "pages_read_s": _median(pages), "read_bytes": _median([float(r) for r in read]),
        "limit_s": round(limit_s, 4), "limit_gbps": gbps, "forward_s": forward,
        "first_forward_s": _median(first), "start_s": _median(starts),
        "anatomy_s": anatomy, "peers": peers, "peer_errors": errors,
        "trials": trials, "peer_rounds": peer_rounds,
    }
    row["ratios"] = ratios(row, path)
    return row


def ratios(row: dict[str, Any], path: str) -> dict[str, Any]:
    """Each target as a ratio (>= 1 meets it except where the name says otherwise)."""
    out: dict[str, Any] = {}
    peers = {k: v for k, v in row["peers"].items() if v and k != "ember"}
    ember = row["peers"].get("ember")
    if peers and ember:
        best = min(peers.values())
        out["best_peer"] = min(peers, key=lambda k: peers[k])
        out["best_peer_over_ember_load"] = round(best / ember, 3)  # target >= 1.0
        fp = peers.get("from_pretrained") or peers.get("s3_download+from_pretrained")
        if fp:
            out["from_pretrained_over_ember_load"] = round(fp / ember, 3)  # target >= 5
    if path == "disk_cold" and row["weights_s"]:
        out["bandwidth_share_weights_phase"] = round(row["limit_s"] / row["weights_s"], 3)
        if row["pages_read_s"]:
            out["bandwidth_share_page_reads"] = round(row["limit_s"] / row["pages_read_s"], 3)
    if path == "regional" and row["weights_s"]:
        out["ceiling_share_weights_phase"] = round(row["limit_s"] / row["weights_s"], 3)
    if path == "disk_warm" and row["total_s"]:
        out["total_over_limit"] = round(row["total_s"] / row["limit_s"], 3)  # target <= 1.3
    return out


def size_growth(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The second replica at the largest size over the smallest (target <= 1.5): request to
    first answer, and the start alone (the request's own forward, which grows with the model,
    taken out)."""
    found = sorted((r for r in rows if r["path"] == "second_replica"), key=lambda r: r["bytes"])
    if len(found) < 2:
        return None
    small, large = found[0], found[-1]
    out = {"sizes": [small["size"], large["size"]],
           "total": round(large["total_s"] / small["total_s"], 3)}
    if small.get("start_s") and large.get("start_s"):
        out["start"] = round(large["start_s"] / small["start_s"], 3)
    return out


def s3_round(rung: Rung, endpoint: str, lims: dict[str, Any]) -> None:
    """Measure the S3 ceiling again; the regional limit becomes the median of the rounds."""
    keys = [(f"{rung.size}/{p.name}", p.stat().st_size) for p in rung.files]
    rounds = lims["s3"].setdefault("rounds_gbps", [lims["s3"]["gbps"]])
    rounds.append(lim.s3_ceiling(endpoint, "ladder", keys)["gbps"])
    lims["s3"]["gbps"] = round(statistics.median(rounds), 3)


def run_size(rung: Rung, base: str, peers: Peers, trials: int, work: Path,
             deadline: h.Deadline, endpoint: str,
             paths: tuple[str, ...] = PATHS) -> list[dict[str, Any]]:
    print(f"{rung.size}: {rung.bytes / 1e9:.2f} GB in {len(rung.files)} shards", flush=True)
    lims = limits(rung, endpoint)
    print(f"  limits: disk {lims['disk_cold']['gbps']} GB/s, page cache "
          f"{lims['page_cache']['gbps']} GB/s, S3 {lims['s3']['gbps']} GB/s", flush=True)
    _serving.deploy_ember(rung.build(), deadline)
    if set(paths) - {"regional"}:
        post(base + "/lm", deadline)  # the first replica writes the node's snapshot record
    found: dict[str, list[dict[str, Any]]] = {p: [] for p in paths}
    peer_found: dict[str, list[Any]] = {p: [] for p in paths}
    for trial in range(trials):
        for path in paths:
            if path == "regional":
                s3_round(rung, endpoint, lims)
            got = cluster_trial(rung, path, base, deadline)
            found[path].append(got)
            print(f"  [{trial}] {path:<15} total {got['total_s']:.2f}s "
                  f"phases {got['phases_s']} load {got['load']['phases_s']}", flush=True)
            if path != "second_replica":
                peer_found[path].append(peer_round(peers, rung, path, work, base, deadline))
    from ray import serve

    serve.delete(rung.app)
    rows = [summarise(rung, p, found[p], peer_found[p], lims) for p in paths]
    for row in rows:
        if row["path"] == "second_replica":
            row["peers"] = {"note": "no peer shares pages between processes; see disk_warm"}
    for row in rows:
        row["limits"] = lims
    return rows


def main() -> int:
    parser = h.parser(__doc__, deadline_s=3600)
    parser.add_argument("--sizes", nargs="+", help="ladder sizes (0.5gb 2gb 6gb; short 0.5gb 2gb)")
    parser.add_argument("--trials", type=int, help="rounds per path (3; short 1)")
    parser.add_argument("--paths", nargs="+", choices=PATHS, help="a subset of the paths (all)")
    parser.add_argument("--huge-pages", choices=("auto", "on", "off"), default="auto",
                        help="LoaderConfig.huge_pages for Ember's loads (auto)")
    args = h.pick(parser.parse_args(), sizes=(["0.5gb", "2gb", "6gb"], ["0.5gb", "2gb"]),
                  trials=(3, 1))
    paths = tuple(p for p in PATHS if p in (args.paths or PATHS))
    huge_pages = {"on": True, "off": False}.get(args.huge_pages, "auto")
    deadline = h.install_deadline(args.deadline_s)
    rows: list[dict[str, Any]] = []
    errors: list[str] = []
    first_use = lim.first_use()
    print(f"memory at first use: {first_use}", flush=True)
    server, endpoint = lim.start_s3()
    work = Path(tempfile.mkdtemp(prefix="ember-sizes-"))
    peers: Peers | None = None
    try:
        peers = Peers(endpoint)
        base = _serving.start_serve(h.free_port(), preload=preload())
        for size in args.sizes:
            def one(size: str = size) -> None:
                rung = Rung(size, work, endpoint, huge_pages=huge_pages)
                assert peers is not None
                rows.extend(run_size(rung, base, peers, args.trials, work, deadline, endpoint,
                                     paths))
                shutil.rmtree(rung.disk_cache, ignore_errors=True)
                shutil.rmtree(rung.reg_cache, ignore_errors=True)
            h.section(size, errors, one)
    except h.DeadlineExceeded as exc:
        errors.append(f"DeadlineExceeded: {exc}")
    finally:
        h.clear_deadline()
        if peers is not None:
            peers.close()
        _serving.shutdown()
        server.kill()
        shutil.rmtree(work, ignore_errors=True)
    name = "coldstart_sizes" if paths == PATHS else "_".join(("coldstart_sizes", *paths))
    name += "_huge_pages" if huge_pages is True else ""
    h.write_results(name, {
        "complete": not errors, "errors": errors, "rows": rows,
        "second_replica_largest_over_smallest": size_growth(rows),
        "peer_worker": peers.ready if peers else None,
        "s3_server": "moto (loopback, own process, O(range) ranged GETs); no faster S3 server "
                     "installs here from PyPI, npm or Debian (MinIO, SeaweedFS, Garage and "
                     "versitygw are not packaged there; s3rver is slower than moto)",
        "config": {"sizes": args.sizes, "trials": args.trials, "paths": paths,
                   "tokens": len(TOKENS), "huge_pages": args.huge_pages,
                   "maps_huge": LoaderConfig(huge_pages=huge_pages).maps_huge(),
                   "preload": preload(), "replica_cpus": _serving.REPLICA_CPUS,
                   "settle_s": {"base": lim.SETTLE_BASE_S, "per_gb": lim.SETTLE_S_PER_GB}},
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "memory_first_use": first_use,
    }, short=args.short)
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
