"""The cloud side: a verifier that owns the target model and per-session KV caches, served over gRPC."""
