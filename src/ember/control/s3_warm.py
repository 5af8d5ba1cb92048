"""Imported by warm-runtime workers after the app's modules (``warm_runtime.preload_modules``):
parse botocore's S3 model once, while the worker is idle.

A replica that loads ``s3://`` weights builds a botocore client first. The first client of a
process parses the S3 service model and its endpoint rules: 0.13-0.4 s of CPU on the loading
replica here, a quarter of a 0.5 GB load from S3 on loopback. Built on the same session, the
next client takes milliseconds (``ember.loaders._source_s3``).

Only a worker whose imports already brought in botocore does it (``transformers`` does, by
way of ``accelerate``; so does ``s3fs``): it costs such a worker about 0.1-0.2 s of CPU while
idle and 15 MB, and a worker without botocore is not made to import it (another 0.3 s).
"""

from __future__ import annotations

import sys


def _warm() -> bool:
    if "botocore" not in sys.modules:
        return False
    # ember.loaders brings torch: only for an app that reads weights (see torch_warm.py).
    from ember.loaders import warm_s3_client

    return warm_s3_client()


WARMED = _warm()
