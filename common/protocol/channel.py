"""gRPC settings both ends must agree on: where the front door listens by default, the largest message,
and how often idle streams ping."""
from __future__ import annotations

# Where `cloud serve` listens and an edge dials when nobody says otherwise.
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 50051
DEFAULT_CLOUD_ADDRESS = f"{DEFAULT_HOST}:{DEFAULT_PORT}"

# A block of 32 positions with a full-vocabulary q over 49k tokens is about 11 MB; nothing either side
# legitimately sends is larger, and a bigger message is refused before it is read into memory.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
# Edges hold long-lived streams across idle stretches; keepalive pings find dead peers. The server
# accepts pings this often (it refuses more frequent ones), so both sides use the same period.
KEEPALIVE_TIME_MS = 30_000
KEEPALIVE_TIMEOUT_MS = 10_000

SHARED_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
]
