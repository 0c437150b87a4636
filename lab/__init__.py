"""Network-latency experiments: sweeps of edge-cloud strategies and baselines, results and reports."""
