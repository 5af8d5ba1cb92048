"""Apps the integration tests serve: core, faults, features, pool, offline.

Ray workers import these deployments by module name (``apps.core``, ...): pytest's
``pythonpath`` puts ``tests/integration`` on ``sys.path``, and ``ember.cluster.runtime``
passes the driver's user paths to the local cluster's workers through ``PYTHONPATH``.
Keep them light: every replica imports its module.
"""
