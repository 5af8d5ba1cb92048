"""The platform layer: decorator, config, ingress, autoscaling policy, runtime, CLI."""
