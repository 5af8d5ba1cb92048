"""transformers' model code, imported when this module is: before a replica's ``setup()``.

transformers' top-level names (``AutoModelForCausalLM``...) are lazy: importing them loads
almost nothing, and the model base (``modeling_utils``: about 2 s of imports on a 2-core
machine) loads in the first ``from_config`` or ``from_pretrained``, on the cold path. A
deployment module that serves transformers models imports this one, so that the warm
runtime's workers, which preload the deployment's module, have paid it before they become
replicas. What is left for ``setup()`` is the architecture's own module, a few ms.
"""

from __future__ import annotations

import transformers.generation.utils
import transformers.modeling_layers
import transformers.modeling_utils
import transformers.tokenization_utils_base

__all__ = ["transformers"]
