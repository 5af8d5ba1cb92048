"""The app the overload, chaos, edge-chaos, rollout, coldstart-lm and textgen scenarios share.

Each scenario drives a deployment of its own (``apps.py``'s three, the shipped ``TextGen``,
and the causal LM in the folder ``EMBER_CAUSAL_LM_WEIGHTS`` names), and they run one after
another, so one ``ember run`` serves them all: two Ray clusters' starts and stops fewer per
run than a server per app. The warm pool is off, so every answer comes from one of the
deployment's own replicas, and the causal LM's cold start is its own replica's.

Each replica imports only its deployment's module: ``apps.py``'s stay light (no torch), so
the chaos scenarios' replacements start as fast as on a server of their own.

    EMBER_CAUSAL_LM_WEIGHTS=file:///path/to/model ember run loadtests/server_app.py:app
"""

from __future__ import annotations

import os

import ember
from ember.deployments import textgen
from ember.deployments.causal_lm import causal_lm_deployment

import apps

app = ember.App(
    [*apps.DEPLOYMENTS, textgen.TextGen,
     causal_lm_deployment(os.environ["EMBER_CAUSAL_LM_WEIGHTS"])],
    name="loadtests",
    protocols=textgen.app.protocols,
    warm_pool=0,
)
