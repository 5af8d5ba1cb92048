"""Cold starts, measured: phases of one replica's start and of one cold request.

A cold request is one that arrived while its deployment had no running replica. Its time
is broken into phases, each exported as a Prometheus histogram and sent back to the caller
in the ``X-Ember-Cold-Start`` header (milliseconds)::

    X-Ember-Cold-Start: total=412;path=pool;queue=0;start=0;import=0;weights=118;warmup=21

* ``queue``: request arrival until the replica's process existed (the autoscaler's
  detection and Ray's scheduling);
* ``start``: process creation until Ember's code was imported (Ray worker start);
* ``import``: until the replica's constructor ran (unpickling the class imports torch
  and the deployment's module);
* ``weights``: the deployment's ``setup()``, which loads the weights;
* ``warmup``: its ``warmup()``, run before the replica reports ready;
* ``route``: only for a request served by the deployment's own new replica, from the
  replica's ready (or the request's arrival, if later) until the edge's router could send
  to it: Serve's controller noticing the replica, and its broadcast of the new replica set
  reaching the edge. The rest of ``total`` is the request's own work and its way back;
* ``device``: only for a GPU deployment served by the GPU pool, the move of its model from
  pinned host memory to the device (``device_snapshot.py``); absent when nothing moved;
* ``adapter``: only for a generation request naming a LoRA adapter its replica had not
  loaded, the adapter's load (fetch, check, put into the model); a request that met only
  that has ``path=adapter`` (``ember.edge._asgi.note_adapter_load``);
* ``path``: ``replica`` (the deployment's own replica started), ``pool`` (a pre-warmed
  pool replica built the model for it while the deployment's own replica started) or
  ``pool-warm``: the pool already held the constructed model (``preload=True``, or built
  for an earlier request). That is a warm hit in a shared process, not a cold start; it is
  reported beside the cold paths because the request still met zero replicas.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field

#: When this module was first imported in this process: the end of the "start" phase.
IMPORTED_AT = time.time()

PHASES = ("queue", "start", "import", "weights", "warmup")
#: Phases a request may have on one path only; the header names them when measured.
EXTRA_PHASES = ("route", "device")


#: ``path`` of a request the warm pool answered with a model it had built before the request.
POOL_WARM = "pool-warm"


def pool_path(arrived_at: float, timeline: ReplicaTimeline | None) -> str:
    """``pool-warm`` if the pool's model was ready before the request arrived, else ``pool``.

    Example:
        >>> t = ReplicaTimeline(process_started_at=1.0, imported_at=2.0, init_started_at=3.0,
        ...                     ready_at=4.0, prewarmed=True)
        >>> pool_path(5.0, t), pool_path(3.5, t)
        ('pool-warm', 'pool')
    """
    ready = timeline is not None and 0 < timeline.ready_at <= arrived_at
    return POOL_WARM if ready else "pool"


def process_started_at() -> float:
    """Wall-clock creation time of this process (Linux ``/proc``; else now)."""
    try:
        import psutil

        return float(psutil.Process(os.getpid()).create_time())
    except Exception:  # psutil missing or /proc unreadable: no start phase rather than none
        return IMPORTED_AT


@dataclass
class ReplicaTimeline:
    """Wall-clock marks of one replica's start, recorded inside the replica."""

    process_started_at: float
    imported_at: float
    init_started_at: float
    setup_s: float = 0.0
    warmup_s: float = 0.0
    ready_at: float = 0.0
    prewarmed: bool = False  # True in a pool process: nothing was started for the request
    device_s: float = 0.0  # the GPU pool's host-to-device move for this request, if any

    def as_dict(self) -> dict[str, float | bool]:
        return asdict(self)


@dataclass
class ColdStartReport:
    """Phases of one cold request, in seconds."""

    total_s: float
    path: str
    phases: dict[str, float] = field(default_factory=dict)

    def header(self) -> str:
        """The ``X-Ember-Cold-Start`` value, in milliseconds."""
        parts = [f"total={self.total_s * 1000:.0f}", f"path={self.path}"]
        parts += [f"{name}={self.phases.get(name, 0.0) * 1000:.0f}" for name in PHASES]
        parts += [f"{name}={self.phases[name] * 1000:.0f}" for name in EXTRA_PHASES
                  if name in self.phases]
        return ";".join(parts)

    def as_dict(self) -> dict[str, object]:
        return {"total_s": round(self.total_s, 4), "path": self.path,
                "phases": {k: round(v, 4) for k, v in self.phases.items()}}


def report(arrived_at: float, answered_at: float, timeline: ReplicaTimeline | None,
           path: str, placed_at: float | None = None) -> ColdStartReport:
    """Phases of a cold request from its arrival, its answer and the serving replica's marks.

    Args:
        arrived_at: wall-clock time the edge received the request.
        answered_at: wall-clock time its answer came back.
        timeline: marks of the replica that served it, if known.
        path: ``replica`` or ``pool``.
        placed_at: wall-clock time the edge's router first had the new replica to send to
            (``replica`` path only); gives the ``route`` phase.

    Example:
        >>> t = ReplicaTimeline(process_started_at=10.5, imported_at=11.0,
        ...                     init_started_at=12.0, setup_s=0.5, warmup_s=0.1)
        >>> report(10.0, 13.0, t, "replica").phases["import"]
        1.0
        >>> t.ready_at = 12.6
        >>> round(report(10.0, 13.0, t, "replica", placed_at=12.75).phases["route"], 2)
        0.15
    """
    total = max(0.0, answered_at - arrived_at)
    if timeline is None:
        return ColdStartReport(total, path)
    phases = _start_phases(arrived_at, timeline)
    if path == "replica" and placed_at and timeline.ready_at > 0 and not timeline.prewarmed:
        phases["route"] = max(0.0, placed_at - max(timeline.ready_at, arrived_at))
    return ColdStartReport(total, path, phases)


def _start_phases(arrived_at: float, timeline: ReplicaTimeline) -> dict[str, float]:
    """The phases of the replica's start that the request waited for."""
    if timeline.prewarmed or timeline.init_started_at < arrived_at:
        # The process existed before the request: only the setup it ran for it counts.
        ran_setup = timeline.init_started_at >= arrived_at
        phases = {"queue": 0.0, "start": 0.0, "import": 0.0,
                  "weights": timeline.setup_s if ran_setup else 0.0,
                  "warmup": timeline.warmup_s if ran_setup else 0.0}
        if timeline.device_s > 0:
            phases["device"] = timeline.device_s
        return phases
    if timeline.imported_at < arrived_at:
        # A pre-started worker (the warm runtime) became the replica: it had imported
        # everything before the request; Serve's scale-up and the actor's creation in it
        # are the queue.
        return {"queue": max(0.0, timeline.init_started_at - arrived_at), "start": 0.0,
                "import": 0.0, "weights": timeline.setup_s, "warmup": timeline.warmup_s}
    return {
        "queue": max(0.0, timeline.process_started_at - arrived_at),
        "start": max(0.0, timeline.imported_at - max(timeline.process_started_at, arrived_at)),
        "import": max(0.0, timeline.init_started_at - timeline.imported_at),
        "weights": timeline.setup_s,
        "warmup": timeline.warmup_s,
    }
