"""The control plane: autoscaling policy, its Ray adapter, floors, warm pool, replicas, cold starts.

Nothing here imports :mod:`ember.edge`.
"""
