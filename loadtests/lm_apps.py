"""The coldstart-lm scenario's app: the causal LM in the folder ``EMBER_CAUSAL_LM_WEIGHTS``
names (``loadtests/run.py`` sets it to a ladder model), from zero, without the warm pool."""

from __future__ import annotations

import os

from ember.deployments.causal_lm import causal_lm_app

app = causal_lm_app(os.environ["EMBER_CAUSAL_LM_WEIGHTS"], name="causal-lm")
