"""The HTTP server's own settings (the generation's are EdgeConfig's): flags of `edge serve`."""
from __future__ import annotations

from dataclasses import dataclass

from ...common.config import check_fields, setting
from ...common.protocol.channel import DEFAULT_HOST
from ...common.security.tls import check_plaintext


@dataclass(frozen=True)
class ServeOptions:
    """How `hybridspec edge serve` listens and how much work it takes on."""

    host: str = setting(DEFAULT_HOST, "interface to listen on; 0.0.0.0 exposes the server to the network")
    port: int = setting(8000, "HTTP port; 0 = a free one (printed in the ready line)", ge=0, le=65535)
    max_concurrent: int = setting(4, "generations that run at once, each on its own worker thread", ge=1)
    max_queued: int = setting(16, "further generation requests that wait for a slot; beyond them: 429", ge=0)
    max_body_bytes: int = setting(1 << 20, "larger request bodies get 413 before they are parsed", ge=1024)
    served_model_name: str = setting("", "the model id clients name; empty: the target's directory or file name")
    warmup_tokens: int = setting(32, "tokens the start-up generation decodes; 0 skips it", ge=0)
    access_log: bool = setting(False, "one log line per request")
    http_tls_cert: str = setting("", "PEM certificate chain: serve HTTPS (with http_tls_key)")
    http_tls_key: str = setting("", "PEM private key of http_tls_cert")
    api_keys: str = setting("", "credentials file (hybridspec token add): every /v1/ request needs one of its "
                                "keys")
    # Also EdgeConfig's `insecure` in `edge serve`: one flag allows plaintext on both of its links.
    insecure: bool = setting(False, "allow plaintext across the network: plain HTTP on a non-loopback host "
                                    "(logged as a warning) and the edge's token to a non-loopback cloud")

    def __post_init__(self) -> None:
        check_fields(self)
        if bool(self.http_tls_cert) != bool(self.http_tls_key):
            raise ValueError("http_tls_cert and http_tls_key go together: give both or neither")
        check_plaintext(self.host, self.tls, self.insecure, "the HTTP server")

    @property
    def tls(self) -> bool:
        """True when the server speaks HTTPS."""
        return bool(self.http_tls_cert)
