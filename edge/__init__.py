"""The edge side: a drafter LM proposes blocks, a gRPC client gets them verified, a worker loops."""
