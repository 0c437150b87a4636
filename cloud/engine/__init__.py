"""Inference engines the core drives through one protocol: a forward pass over many sessions' feeds, and their KV caches."""
