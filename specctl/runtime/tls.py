"""TLS contexts for servers (--tls-cert/--tls-key) and clients (--tls-ca)."""

from __future__ import annotations

import ssl

from specctl.errors import ConfigError


def server_context(cert: str | None, key: str | None) -> ssl.SSLContext | None:
    if not cert and not key:
        return None
    if not (cert and key):
        raise ConfigError("TLS needs both --tls-cert and --tls-key")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load TLS certificate {cert} / key {key}: {exc}") from None
    return context


def tls_failure(host: str, port: int, exc: ssl.SSLError) -> str:
    """What a failed TLS connection means for the one who asked for it (--tls-ca)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return (f"TLS with {host}:{port} failed: its certificate does not verify against --tls-ca "
                f"({exc.verify_message})")
    return (f"TLS with {host}:{port} failed ({exc.reason or exc}): does it serve TLS (--tls-cert)? "
            "For a server without TLS drop --tls-ca")


def client_context(ca: str | None) -> ssl.SSLContext | None:
    if not ca:
        return None
    try:
        return ssl.create_default_context(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load TLS CA file {ca}: {exc}") from None
