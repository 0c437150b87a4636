"""Finding and loading models for either role: the embedded pair, HF and GGUF checkpoints, compact drafters and EAGLE heads."""
