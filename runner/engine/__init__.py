"""The engine: what runs a model on documents (worker actor, model loading, summarisation, generation,
KV caches). It knows nothing of the coordinator or of what people watch: it reports through return
values and Ray metrics."""

import logging

# bitsandbytes and torchao (the `quant` extra) log, on import, the optional kernels they do not find,
# and torch the enums torchao registers: transformers imports torchao whenever it is installed, so
# every kvbatch command would print them
for _name in ("torchao", "torch.utils._pytree", "bitsandbytes.backends.cpu.ops"):
    logging.getLogger(_name).setLevel(logging.ERROR)
