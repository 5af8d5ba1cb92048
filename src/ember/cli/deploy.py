"""``ember deploy APP --k8s``: print the KubeRay ``RayService`` that serves an app, with the
Redis its GCS keeps its state in (``--redis-address`` names an existing one instead), and the
``NetworkPolicy`` that keeps Ray's ports to the cluster's own pods.

The manifest is built by ``cluster/k8s.py`` from the app's deployments and this process's
``EMBER_*`` settings; apply it with ``kubectl apply -f -``. The app is imported here only to
read its deployments: on the cluster, Ray Serve imports it again from the image.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from importlib import metadata

from ember.errors import ConfigError


def cmd_deploy(args: argparse.Namespace) -> int:
    from ember.app.targets import load_app
    from ember.cluster import k8s

    if not args.k8s:
        print("ember deploy writes a Kubernetes manifest: add --k8s. To serve on a running "
              "Ray cluster, set RAY_ADDRESS and use `ember run`.", file=sys.stderr)
        return 2
    app = load_app(args.target)
    try:
        shape = k8s.ClusterShape(
            image=args.image, namespace=args.namespace, head_cpus=args.head_cpus,
            head_memory_gib=args.head_memory_gib, worker_cpus=args.worker_cpus,
            worker_memory_gib=args.worker_memory_gib, worker_gpus=args.worker_gpus,
            port=args.port,
        )
    except ValueError as exc:  # pydantic's ValidationError
        raise ConfigError(str(exc)) from None
    items = k8s.manifests(app, args.target, shape, environ=os.environ,
                          ray_version=metadata.version("ray"),
                          redis_address=args.redis_address,
                          opened=[field for field in k8s.OPENING_SETTINGS
                                  if getattr(args, field)])
    print(json.dumps(k8s.to_list(items), indent=2) if args.json
          else k8s.to_yaml_documents(items), end="")
    if args.json:
        print()
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``deploy``.

    Example:
        >>> parser = argparse.ArgumentParser(prog="ember")
        >>> register(parser.add_subparsers())
        >>> parser.parse_args(["deploy", "m:app", "--k8s"]).worker_cpus
        4
    """
    deploy = sub.add_parser("deploy", help="print a Kubernetes (KubeRay RayService) manifest")
    deploy.add_argument("target", help="module:app, importable in the image")
    deploy.add_argument("--k8s", action="store_true", help="write a KubeRay RayService")
    deploy.add_argument("--image", default=f"ember-serve:{metadata.version('ember-serve')}",
                        help="container image with Ray, Ember and the app installed")
    deploy.add_argument("--namespace", default=None)
    deploy.add_argument("--head-cpus", type=int, default=2)
    deploy.add_argument("--head-memory-gib", type=float, default=8.0)
    deploy.add_argument("--worker-cpus", type=int, default=4, help="CPUs of each worker pod")
    deploy.add_argument("--worker-memory-gib", type=float, default=16.0)
    deploy.add_argument("--worker-gpus", type=int, default=1,
                        help="GPUs of each pod of the GPU group, made when a deployment needs one")
    deploy.add_argument("--port", type=int, default=None, help="default: $EMBER_PORT or 8000")
    deploy.add_argument("--json", action="store_true", help="JSON instead of YAML")
    deploy.add_argument("--redis-address", default=None, metavar="HOST:PORT",
                        help="an existing Redis for the GCS's fault tolerance (default: the "
                        "manifest runs one)")
    deploy.add_argument("--admin-loopback", action="store_true",
                        help="let admin routes answer loopback callers with no admin key on the "
                        "cluster (EMBER_ADMIN_LOOPBACK; a shell's value is never carried)")
    deploy.add_argument("--allow-unauthenticated", action="store_true",
                        help="let the edge serve with no API key (EMBER_ALLOW_UNAUTHENTICATED; "
                        "a shell's value is never carried)")
    deploy.set_defaults(func=cmd_deploy)
