"""The platform layer: decorator, config, the edge, autoscaling policy, runtime, CLI."""
