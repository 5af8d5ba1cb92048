"""The flagship's answer model, in a module that imports no torch.

The edges validate answers with the routes' models, so unpickling a route imports the
module that defines its models; defined beside the encoder, they made every edge import
torch (its import time and its memory in each), which the edges otherwise never need.
"""

from __future__ import annotations

from pydantic import BaseModel


class Embedding(BaseModel):
    """One text's unit-norm embedding and the tokens the model read for it."""

    embedding: list[float]
    tokens: int
