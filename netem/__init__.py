"""A user-space network link emulator (delay, jitter, bandwidth, loss, stalls) for experiments."""
