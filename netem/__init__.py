"""Network link emulation for experiments: a user-space TCP relay (delay, jitter, bandwidth, loss,
stalls, recorded latency traces) and, where the kernel has sch_netem, a tc netem backend."""
