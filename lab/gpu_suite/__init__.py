"""The GPU suite (bench/gpu_suite.py): what the torch engine costs and how exact it is, on the model
shapes a GPU verifier serves, and what that buys through real gRPC. Each part is a module here:
models.py (shapes with random weights), passes.py (pass times), exactness.py (hybrid against
cloud-only token ids), capacity.py (edges against one GPU), report.py (JSON, markdown, plot)."""
