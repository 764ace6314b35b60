"""TLS for the gRPC port (reloaded without dropping connections) and bearer-token authorisation.

TLS: a certificate and key, and optionally a client CA, which makes client certificates required
(mTLS). The files are read again when they change, or on SIGHUP, for every new handshake; open
connections keep the certificate they were made with.

Tokens: the server keeps only SHA-256 hashes, each with the models it may use ("*": all), from a file
or a variable, one per line: `<sha256 hex of the token> <model,model|*>`, `#` comments. A request
presents `authorization: Bearer <token>` metadata (what tritonclient's `headers=` sends). The
presented token is hashed and compared against every entry in constant time, and never logged.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import logging
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

from attnserve_server.errors import ConfigError, PermissionDenied, Unauthenticated

log = logging.getLogger(__name__)

ALL_MODELS = "*"
# The models the current call's token may use; None when tokens are not required.
allowed_models: contextvars.ContextVar[frozenset[str] | None] = contextvars.ContextVar("allowed_models", default=None)


def check_model_allowed(model: str) -> None:
    """Raises PERMISSION_DENIED if the call's token may not use `model` (a no-op without tokens)."""
    allowed = allowed_models.get()
    if allowed is not None and ALL_MODELS not in allowed and model not in allowed:
        raise PermissionDenied(f"model: the token presented may not use model {model[:64]!r}")


def token_hash(token: str) -> str:
    """What the tokens file holds for a token (the same as `printf %s "$TOKEN" | sha256sum`)."""
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class _Entry:
    digest: bytes
    models: frozenset[str]


class TokenAuth:
    """Bearer tokens, known by their SHA-256 hashes."""

    def __init__(self, entries: list[_Entry]) -> None:
        if not entries:
            raise ConfigError("auth tokens: no token is configured, so no call could pass")
        self._entries = entries

    @classmethod
    def parse(cls, text: str, source: str) -> TokenAuth:
        entries = []
        for number, raw in enumerate(text.replace(";", "\n").splitlines(), start=1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            digest, _, models = line.partition(" ")
            digest = digest.removeprefix("sha256:")
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest.lower()):
                raise ConfigError(f"{source} line {number}: expected the SHA-256 hex of a token, then its models")
            names = frozenset(m.strip() for m in (models.strip() or ALL_MODELS).split(",") if m.strip())
            entries.append(_Entry(bytes.fromhex(digest), names))
        return cls(entries)

    def authenticate(self, metadata) -> frozenset[str]:
        """The models the call's token may use; raises UNAUTHENTICATED without a known token."""
        token = None
        for key, value in metadata or ():
            if key == "authorization" and isinstance(value, str) and value[:7].lower() == "bearer ":
                token = value[7:].strip()
        if not token:
            raise Unauthenticated(
                "authorization: this server needs a bearer token (metadata 'authorization: Bearer …')"
            )
        presented = hashlib.sha256(token.encode()).digest()
        found: frozenset[str] | None = None
        for entry in self._entries:  # every entry, whatever matches: the time says nothing of which
            if hmac.compare_digest(presented, entry.digest):
                found = entry.models
        if found is None:
            raise Unauthenticated("authorization: the bearer token is not known to this server")
        return found


def token_auth(tokens_file: str | None, tokens: str | None) -> TokenAuth | None:
    """The token table from the settings, or None when tokens are not required."""
    if tokens_file is None and tokens is None:
        return None
    text = ""
    if tokens_file is not None:
        try:
            text = Path(tokens_file).read_text()
        except OSError as exc:
            raise ConfigError(f"auth_tokens_file {tokens_file}: {exc.strerror}") from None
    return TokenAuth.parse(f"{text}\n{tokens or ''}", tokens_file or "auth_tokens")


def _read(path: str, setting: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{setting} {path}: {exc.strerror}") from None


def check_pem(cert: str, key: str, client_ca: bytes | None) -> None:
    """Refuses a certificate and key that do not load as a pair (not PEM, a key for another certificate,
    an encrypted key), or a client CA that holds no certificate, as OpenSSL reads them. gRPC only says
    that it could not add the port, which read as a port in use."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key, password=lambda: b"")  # an encrypted key fails, never prompts
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(
            f"tls_cert, tls_key: cannot load them as a PEM certificate and its key ({_why(exc)})"
        ) from None
    if client_ca is not None:
        try:
            context.load_verify_locations(cadata=client_ca.decode("ascii", "replace"))
        except (ssl.SSLError, ValueError) as exc:
            raise ConfigError(f"tls_client_ca: cannot load it as PEM certificates ({_why(exc)})") from None


def _why(exc: BaseException) -> str:
    return str(getattr(exc, "reason", None) or getattr(exc, "strerror", None) or exc)


class ReloadingTLS:
    """Server credentials whose certificate, key and client CA are read again when a file changes
    (or after `reload()`, which SIGHUP calls), for the next handshake."""

    def __init__(self, cert: str, key: str, client_ca: str | None) -> None:
        self._paths = [cert, key] + ([client_ca] if client_ca else [])
        self._cert, self._key, self._client_ca = cert, key, client_ca
        self._stamp = self._mtimes()
        self._forced = False
        self.credentials = grpc.dynamic_ssl_server_credentials(
            self._configuration(), self._fetch, require_client_authentication=client_ca is not None
        )

    def _mtimes(self) -> tuple[float, ...]:
        try:
            return tuple(os.stat(p).st_mtime_ns for p in self._paths)
        except OSError:
            return ()

    def _configuration(self) -> grpc.ServerCertificateConfiguration:
        pair = (_read(self._key, "tls_key"), _read(self._cert, "tls_cert"))
        ca = _read(self._client_ca, "tls_client_ca") if self._client_ca else None
        check_pem(self._cert, self._key, ca)
        return grpc.ssl_server_certificate_configuration([pair], root_certificates=ca)

    def reload(self) -> None:
        self._forced = True

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """Called by gRPC before each handshake: a new configuration, or None to keep the current one."""
        stamp = self._mtimes()
        if not self._forced and stamp == self._stamp:
            return None
        self._forced, self._stamp = False, stamp
        try:
            return self._configuration()
        except ConfigError as exc:  # a file half-written or removed: keep serving with the last good certificate
            log.warning("TLS files changed but cannot be used (%s); the last good certificate stays", exc)
            return None
