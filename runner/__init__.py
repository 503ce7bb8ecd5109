"""How a batch runs: CLI, coordinator (Ray + tenacity), worker actors, models, KV cache strategies."""

__version__ = "0.1.0"
