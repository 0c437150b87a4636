"""One replica's serving core: sessions, the scheduler that packs each forward pass, and the verify round that applies the rules. No gRPC, no Ray."""
