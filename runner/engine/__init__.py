"""The engine: what runs a model on documents (worker actor, model loading, summarisation, generation,
KV caches). It knows nothing of the coordinator or of what people watch: it reports through return
values and Ray metrics."""
