"""The HTTP server's own settings (the generation's are EdgeConfig's): flags of `edge serve`."""
from __future__ import annotations

from dataclasses import dataclass

from ...common.security.tls import check_plaintext


@dataclass(frozen=True)
class ServeOptions:
    """How `hybridspec edge serve` listens and how much work it takes on."""

    host: str = "127.0.0.1"  # interface to listen on; 0.0.0.0 exposes the server to the network
    port: int = 8000  # 0 picks a free port (printed in the ready line)
    max_concurrent: int = 4  # generations that run at once, each on its own worker thread
    max_queued: int = 16  # further generation requests that wait for a slot; beyond them: 429
    max_body_bytes: int = 1 << 20  # larger request bodies get 413 before they are parsed
    served_model_name: str = ""  # the model id clients name; "" = the target's directory or file name
    warmup_tokens: int = 32  # tokens the start-up generation decodes; 0 skips it
    access_log: bool = False  # one uvicorn log line per request
    http_tls_cert: str = ""  # PEM certificate chain: serve HTTPS (with http_tls_key)
    http_tls_key: str = ""  # its private key
    api_keys: str = ""  # credentials file (hybridspec token add): every /v1/ request needs one of its keys
    insecure: bool = False  # allow plain HTTP on a non-loopback host (logged as a warning)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_concurrent < 1 or self.max_queued < 0:
            raise ValueError("max_concurrent must be >= 1 and max_queued >= 0")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.warmup_tokens < 0:
            raise ValueError(f"warmup_tokens must be >= 0, got {self.warmup_tokens}")
        if bool(self.http_tls_cert) != bool(self.http_tls_key):
            raise ValueError("http_tls_cert and http_tls_key go together: give both or neither")
        check_plaintext(self.host, self.tls, self.insecure, "the HTTP server")

    @property
    def tls(self) -> bool:
        """True when the server speaks HTTPS."""
        return bool(self.http_tls_cert)
