"""transformers' model code, imported when this module is: before a replica's ``setup()``.

transformers' top-level names (``AutoModelForCausalLM``...) are lazy: importing them loads
almost nothing, and the model base (``modeling_utils``: 1.6-2 s of imports on a 2-core
machine) loads in the first ``from_config`` or ``from_pretrained``, on the cold path. A
deployment module that serves transformers models imports this one, so that the warm
runtime's workers, which preload the deployment's module, have paid it before they become
replicas. What is left for ``setup()`` is the architecture's own module, a few ms.

The cost: every worker of the local cluster imports what the workers preload, the edges and
Serve's controller included; this adds about 140 MiB of RSS to each (372 to 515 MiB,
measured here), for apps whose deployments import this module only.
"""

from __future__ import annotations

# Imported for the import itself; nothing here is used by name (ruff sees the four as one
# binding of ``transformers``, hence one noqa). tokenization_utils_base: the textgen
# backend's tokenizer.
import transformers.generation.utils
import transformers.modeling_layers
import transformers.modeling_utils
import transformers.tokenization_utils_base  # noqa: F401
