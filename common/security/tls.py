"""Transport security for every hybridspec listener and channel: PEM files to gRPC credentials, and the
rule for when plaintext is allowed.

Servers re-read their certificate and key when the files change (checked at each new connection's
handshake), so a rotated certificate (cert-manager, a mounted Kubernetes secret) is served without a
restart. Plaintext is the default only on loopback: a server bound to any other address needs TLS or
an explicit `insecure`, which is logged as a warning.
"""
from __future__ import annotations

import ipaddress
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from ..config import ConfigError

log = logging.getLogger(__name__)

LOOPBACK_NAMES = ("localhost", "ip6-localhost")


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and localhost (a wildcard such as 0.0.0.0 is not loopback)."""
    host = host.strip("[]").lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_plaintext(host: str, tls: bool, insecure: bool, what: str) -> str | None:
    """ConfigError if `what` would serve plaintext on a non-loopback `host` without `insecure`; the
    warning to log if it does so with `insecure`; None when there is nothing to say."""
    if tls or is_loopback(host):
        return None
    if not insecure:
        raise ConfigError(f"{what} would listen on {host} without TLS: give it a certificate and key, "
                          f"bind 127.0.0.1, or pass --insecure to serve plaintext anyway")
    return (f"{what} listens on {host} WITHOUT TLS (--insecure): tokens and prompts cross the network in "
            f"plaintext; use this only on a network you trust")


def read_pem(path: str, what: str) -> bytes:
    """A PEM file's bytes; ConfigError naming `what` if it cannot be read or holds no PEM block."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{what} {path} cannot be read: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{what} {path} is not a PEM file")
    return data


@dataclass(frozen=True)
class ServerTLS:
    """A server's certificate chain and key, and (for mutual TLS) the CA its clients' certificates
    must chain to. All empty: plaintext."""

    cert: str = ""  # PEM certificate chain, server certificate first
    key: str = ""  # PEM private key of that certificate
    client_ca: str = ""  # PEM CA bundle; set = every client must present a certificate it signed

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ConfigError("tls_cert and tls_key go together: give both or neither")
        if self.client_ca and not self.cert:
            raise ConfigError("tls_client_ca (mutual TLS) needs tls_cert and tls_key too")

    @property
    def enabled(self) -> bool:
        """True when the server speaks TLS."""
        return bool(self.cert)

    def check_files(self) -> None:
        """ConfigError, naming the file, unless every file can be read now (before anything starts)."""
        if self.enabled:
            self._configuration()

    def grpc_credentials(self):
        """gRPC server credentials that re-read the files whenever they change."""
        import grpc

        stamps = {"last": self._stamps()}

        def fetch():  # called by gRPC at each handshake: None keeps the current certificate
            stamps_now = self._stamps()
            if stamps_now == stamps["last"]:
                return None
            try:
                configuration = self._configuration()
            except ConfigError as exc:  # mid-rotation or broken: keep serving the last good one
                log.error("%s; keeping the certificate loaded before", exc)
                return None
            stamps["last"] = stamps_now
            log.info("TLS certificate reloaded from %s", self.cert)
            return configuration

        return grpc.dynamic_ssl_server_credentials(self._configuration(), fetch,
                                                   require_client_authentication=bool(self.client_ca))

    def _configuration(self):
        import grpc

        pair = (read_pem(self.key, "tls_key"), read_pem(self.cert, "tls_cert"))
        roots = read_pem(self.client_ca, "tls_client_ca") if self.client_ca else None
        return grpc.ssl_server_certificate_configuration([pair], root_certificates=roots)

    def _stamps(self) -> tuple:
        def stamp(path: str):
            try:
                st = os.stat(path)
            except OSError:
                return None
            return st.st_mtime_ns, st.st_size, st.st_ino

        return tuple(stamp(p) for p in (self.cert, self.key, self.client_ca) if p)


@dataclass(frozen=True)
class ClientTLS:
    """How a client checks the server and (for mutual TLS) proves itself. `enabled` False: plaintext."""

    enabled: bool = False
    ca: str = ""  # PEM CA bundle the server's certificate must chain to; "" = the system's roots
    cert: str = ""  # PEM client certificate chain, for servers that require mutual TLS
    key: str = ""  # its private key
    server_name: str = ""  # the name the server's certificate must carry; "" = the host dialled

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ConfigError("tls_cert and tls_key go together: give both or neither")

    def channel_credentials(self):
        """gRPC channel credentials for these files (read now: ConfigError if one cannot be)."""
        import grpc

        return grpc.ssl_channel_credentials(
            root_certificates=read_pem(self.ca, "tls_ca") if self.ca else None,
            private_key=read_pem(self.key, "tls_key") if self.key else None,
            certificate_chain=read_pem(self.cert, "tls_cert") if self.cert else None)
