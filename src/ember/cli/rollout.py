"""``ember rollout`` and ``ember rollback``: stepped rollouts of a version, run in the cluster.

The CLI only asks: the rollout runs in the cluster (``control/rollout_driver.py``) and goes
on after the command exits. ``ember rollout Embed --status`` reads where it is.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ember import settings
from ember.cli.serve import _admin_json
from ember.cluster.defaults import DEFAULT_HOST, default_port
from ember.control.floors import parse_duration


def parse_steps(text: str) -> list[int]:
    """``"5,25,50,100"`` -> ``[5, 25, 50, 100]``; the server checks that they rise to 100.

    Raises:
        ValueError: a step is not a whole number.
    """
    try:
        return [int(step) for step in text.split(",")]
    except ValueError:
        raise ValueError(f"--steps {text!r} is not whole percents, e.g. 5,25,50,100") from None


def render_rollout(rollout: dict[str, Any]) -> str:
    """A few lines on one rollout: where it is, how the versions compare, what happened."""
    spec = rollout["spec"]
    head = f"{spec['group']}: v{spec['stable']} -> v{spec['to']} {rollout['state']}"
    if rollout["state"] == "running":
        head += (f", step {rollout['step'] + 1}/{len(spec['steps'])} "
                 f"({rollout['share']}%), {rollout['phase']}")
    lines = [head]
    if rollout.get("reason"):
        lines.append(f"  reason: {rollout['reason']}")
    for role, figures in (rollout.get("judged") or {}).items():
        lines.append(f"  {role}: {figures['requests']:.0f} requests, "
                     f"{figures['error_rate']:.2%} 5xx, p99 {figures['p99_ms']:.1f} ms")
    lines += [f"  {event}" for event in rollout.get("history", [])]
    return "\n".join(lines)


def cmd_rollout(args: argparse.Namespace) -> int:
    path = f"/-/rollout/{args.deployment}"
    if args.status or args.to is None:
        answer = _admin_json(args, "GET", path)
    else:
        try:
            body = {"to": args.to, "steps": parse_steps(args.steps),
                    "every_s": parse_duration(args.every),
                    "max_error_rate": args.max_error_rate, "max_p99_ratio": args.max_p99_ratio}
        except ValueError as exc:
            print(exc, file=sys.stderr)
            return 2
        answer = _admin_json(args, "PUT", path, json=body)
    if isinstance(answer, int):
        return answer
    print(render_rollout(answer))
    return 0


def cmd_rollback(args: argparse.Namespace) -> int:
    answer = _admin_json(args, "POST", f"/-/rollback/{args.deployment}")
    if isinstance(answer, int):
        return answer
    shares = ", ".join(f"v{v} {w}%" for v, w in answer["weights"].items())
    print(f"{args.deployment}: rolled back; {shares}")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``rollout`` and ``rollback``."""
    url = settings.load().url or f"http://{DEFAULT_HOST}:{default_port()}"
    rollout = sub.add_parser("rollout", help="move traffic to a version in judged steps")
    rollout.add_argument("deployment")
    rollout.add_argument("--to", default=None, help="the candidate version")
    rollout.add_argument("--steps", default="5,25,50,100", help="percent per step, to 100")
    rollout.add_argument("--every", default="60s", help="how long each step holds: 60s, 5m")
    rollout.add_argument("--max-error-rate", type=float, default=0.01,
                         help="5xx rate the candidate may have above stable's")
    rollout.add_argument("--max-p99-ratio", type=float, default=1.5,
                         help="the candidate's p99 over stable's, at most")
    rollout.add_argument("--status", action="store_true", help="show the rollout and exit")
    rollout.add_argument("--url", default=url)
    rollout.set_defaults(func=cmd_rollout)
    rollback = sub.add_parser("rollback", help="end a rollout: all traffic back to stable")
    rollback.add_argument("deployment")
    rollback.add_argument("--url", default=url)
    rollback.set_defaults(func=cmd_rollback)
