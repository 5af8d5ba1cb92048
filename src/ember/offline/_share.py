"""Batch work through the online deployment's replicas, at low priority.

With ``share`` set, a job's workers do not build the model themselves: each is a light
Ray Data actor that sends slices of its batch to the running deployment through a Ray
Serve ``DeploymentHandle``, the path the ingress uses. Before each slice it reads the
ingress's ``/-/status`` (at most every ``poll_interval_s``), waits while online requests
are in flight (:func:`~ember.offline._policy.should_yield`), and sizes the slice
so that it holds a replica no longer than the budget allows
(:func:`~ember.offline._policy.offline_batch_size`). Requests sent through the
handle bypass the ingress, so the status numbers are online traffic only.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import httpx
import pyarrow as pa  # type: ignore[import-not-found,import-untyped,unused-ignore]

from ember.errors import OfflineError
from ember.offline._config import ShareOptions
from ember.offline._mapping import BatchRunner, Outcome, map_table
from ember.offline._policy import Throttle

logger = logging.getLogger("ember.offline")

#: Sends retried on a full queue or a replica being replaced, before the job gives up.
_SEND_RETRIES = 50


def online_depth(client: httpx.Client, url: str, deployment: str) -> int | None:
    """Ongoing + queued online requests of ``deployment``, or None if unknown."""
    try:
        reply = client.get(f"{url}/-/status")
        reply.raise_for_status()
        rows = reply.json()["deployments"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
    for row in rows:
        if row.get("deployment") == deployment:
            return int(row.get("ongoing", 0)) + int(row.get("queued", 0))
    return None


def online_app(share: ShareOptions, deployment: str) -> str:
    """The app name the ingress at ``share.url`` serves ``deployment`` in.

    Raises:
        OfflineError: when the ingress cannot be read or does not serve ``deployment``.
    """
    url = share.url
    try:
        reply = httpx.get(f"{url}/-/status", timeout=share.status_timeout_s,
                          headers=share.headers())
        reply.raise_for_status()
        status = reply.json()
    except (httpx.HTTPError, ValueError) as exc:
        raise OfflineError(detail=f"cannot read {url}/-/status: {exc}") from exc
    names = [row.get("deployment") for row in status.get("deployments", [])]
    if deployment not in names:
        raise OfflineError(detail=f"{url} does not serve deployment {deployment!r} (it serves"
                           f" {names}); share with the app that runs it")
    return str(status["app"])


class OnlineMapper:
    """Ray Data callable class: maps batches through the online deployment, online first.

    Args:
        app_name: Ray Serve application of the deployment.
        deployment: Deployment name.
        attr: Batch-form or tensor-form handler.
        tensor: Whether the handler takes a tensor whose rows are the items.
        share: Budget, thresholds and the ingress URL.
        max_batch_bytes: Most input bytes per call.
        max_batch: Most items per call (the deployment's own batch size).
    """

    def __init__(self, app_name: str, deployment: str, attr: str, tensor: bool,
                 share: ShareOptions, max_batch_bytes: int, max_batch: int,
                 item_type: Any = Any) -> None:
        from ray import serve

        self._handle = serve.get_deployment_handle(deployment, app_name=app_name)
        self._deployment, self._attr, self._tensor = deployment, attr, tensor
        self._share = share
        self._client = httpx.Client(timeout=share.status_timeout_s, headers=share.headers())
        self._warned = False
        self.throttle = Throttle(share)
        self._polled_at = -float("inf")
        self._max_batch = max_batch
        self._item_type = item_type
        self._runner = BatchRunner(self._send, max_batch_bytes, (deployment, attr))

    def __call__(self, batch: pa.Table) -> pa.Table:
        return map_table(batch, self, self._item_type)

    def run(self, items: list[Any], sizes: list[int]) -> list[Outcome]:
        """Outcomes of ``items``, sent in throttled slices."""
        outcomes: list[Outcome] = []
        start = 0
        while start < len(items):
            size = self._wait_for_room(len(items) - start)
            started = time.monotonic()
            outcomes.extend(self._runner.run(items[start : start + size],
                                             sizes[start : start + size]))
            self.throttle.record(size, time.monotonic() - started)
            start += size
        return outcomes

    def _wait_for_room(self, left: int) -> int:
        while True:
            if time.monotonic() - self._polled_at >= self._share.poll_interval_s:
                depth = online_depth(self._client, self._share.url, self._deployment)
                if depth is None and not self._warned:
                    logger.warning("cannot read %s/-/status; batch work waits until it can",
                                   self._share.url)
                self._warned = depth is None
                self.throttle.observe(depth)
                self._polled_at = time.monotonic()
            size = self.throttle.next_batch_size(min(left, self._max_batch))
            if size:
                return size
            time.sleep(self._share.poll_interval_s)

    def _send(self, items: list[Any]) -> list[Any]:
        from ray.exceptions import RayActorError
        from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

        body: Any = items
        if self._tensor:
            import torch

            body = torch.tensor(items, dtype=torch.float32)
        for _ in range(_SEND_RETRIES):
            try:
                return list(self._handle.ember_call.remote(self._attr, body).result())
            except (BackPressureError, DeploymentUnavailableError, RayActorError):
                # The deployment is full or replacing a replica: not the rows' fault.
                time.sleep(self._share.poll_interval_s)
        raise OfflineError(detail=f"deployment {self._deployment!r} stayed unavailable for"
                           f" {_SEND_RETRIES} tries")
