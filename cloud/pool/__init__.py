"""The verifier pool: Ray actors hosting replicas, routing each session to the replica holding its cache, and the backends the API calls. No protobuf, no tensors."""
