"""The gRPC face of the cloud: servicer, front-door and replica-endpoint servers, admission, access rules, quotas and Prometheus metrics. No tensors."""
