"""The HTTP edge: ingress app, pure ASGI middleware, dispatch to replicas, protocols, metrics."""
