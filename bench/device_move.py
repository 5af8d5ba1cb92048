"""The GPU warm pool's move of a parked model to the device, against ``module.to(device)``.

The GPU pool keeps a GPU deployment's tensors in pinned host memory and moves them to the
device through two pinned staging buffers on the first request at zero
(``ember.control.device_snapshot``). The peer is what a replica does without it:
``model.to(device)`` from ordinary (pageable) host tensors. Both move the MiniLM flagship's
encoder (90 MB of float32); trials alternate; medians and GB/s reported.

Needs a CUDA device: without one there is no host-to-device link to measure (``.to("cpu")``
of a CPU model copies nothing), so the script says so and writes no results.

Usage:
    .venv/bin/python bench/device_move.py [--short] [--trials 7]
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from typing import Any

import _harness as h
import torch

from ember.control.device_snapshot import DeviceSnapshot
from ember.deployments.embeddings import load_encoder


class _Holder:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peer_once(host_model: torch.nn.Module, device: torch.device) -> float:
    model = copy.deepcopy(host_model)  # pageable host tensors, as a fresh replica has them
    started = time.perf_counter()
    model.to(device)
    _sync(device)
    took = time.perf_counter() - started
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return took


def main() -> int:
    parser = h.parser(__doc__, deadline_s=600)
    parser.add_argument("--trials", type=int, default=None)
    args = h.pick(parser.parse_args(), trials=(7, 3))
    if not torch.cuda.is_available():
        print("no CUDA device here: nothing to measure, no results written", flush=True)
        return 0
    device = torch.device("cuda")
    host_model = load_encoder(torch.device("cpu"))
    nbytes = sum(t.numel() * t.element_size()
                 for t in [*host_model.parameters(), *host_model.buffers()])
    snapshot = DeviceSnapshot(_Holder(copy.deepcopy(host_model)))
    ember_s, peer_s = [], []
    for _ in range(args.trials):
        move = snapshot.to_device()
        assert move is not None
        ember_s.append(move.seconds)
        snapshot.park()
        peer_s.append(_peer_once(host_model, device))
    ember, peer = statistics.median(ember_s), statistics.median(peer_s)
    summary: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device), "pinned": True, "bytes": nbytes,
        "trials": args.trials,
        "ember_median_s": ember, "peer_median_s": peer,
        "ember_gb_per_s": nbytes / ember / 1e9, "peer_gb_per_s": nbytes / peer / 1e9,
        "peer_over_ember": peer / ember,
        "raw": {"ember_s": ember_s, "peer_s": peer_s},
    }
    print(f"device={summary['device']} pinned={summary['pinned']} bytes={nbytes}", flush=True)
    h.print_table([["", "median s", "GB/s"],
                   ["Ember (pinned, staged)", h.fmt(ember, ".4f"),
                    h.fmt(summary["ember_gb_per_s"], ".2f")],
                   ["module.to(device)", h.fmt(peer, ".4f"),
                    h.fmt(summary["peer_gb_per_s"], ".2f")]])
    h.write_results("device_move", summary, short=args.short)
    return 0


if __name__ == "__main__":
    sys.exit(main())
