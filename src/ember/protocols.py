"""Client APIs Ember serves on top of deployments.

Example:
    >>> from ember.protocols import OpenAIEmbeddings
    >>> OpenAIEmbeddings(deployment="MiniLM", attr="embed", model="all-MiniLM-L6-v2",
    ...                  dimensions=384)
    OpenAIEmbeddings(model='all-MiniLM-L6-v2' -> MiniLM.embed)
"""

from __future__ import annotations

from ember.edge.protocols import Gateway, Protocol
from ember.edge.protocols.oip import OpenInferenceProtocol, TensorModel, TensorSpec
from ember.edge.protocols.openai import OpenAIEmbeddings
from ember.edge.protocols.openai_generation import (
    ChatMessage,
    GenerateRequest,
    OpenAIGeneration,
)

__all__ = [
    "ChatMessage",
    "Gateway",
    "GenerateRequest",
    "OpenAIEmbeddings",
    "OpenAIGeneration",
    "OpenInferenceProtocol",
    "Protocol",
    "TensorModel",
    "TensorSpec",
]
