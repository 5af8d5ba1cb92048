"""The flagship's answer model, in a module that imports no torch.

The edges validate answers with the routes' models, so unpickling a route imports the
module that defines its models; defined beside the encoder, they made every edge import
torch (two seconds and 250 MB each under the warm runtime's light workers).
"""

from __future__ import annotations

from pydantic import BaseModel


class Embedding(BaseModel):
    """One text's unit-norm embedding and the tokens the model read for it."""

    embedding: list[float]
    tokens: int
