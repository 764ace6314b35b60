"""Domain errors. Each carries its gRPC status code: this hierarchy is the one mapping table."""

from __future__ import annotations

import grpc


class ServingError(Exception):
    """An error the caller should see, with the status code it maps to."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(ServingError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class ModelNotFound(ServingError):
    code = grpc.StatusCode.NOT_FOUND


class QueueFull(ServingError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExpired(ServingError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class ShuttingDown(ServingError):
    code = grpc.StatusCode.UNAVAILABLE


class ModelNotReady(ServingError):
    code = grpc.StatusCode.UNAVAILABLE


class Unauthenticated(ServingError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(ServingError):
    code = grpc.StatusCode.PERMISSION_DENIED


class BatchFailed(ServingError):
    """The worker raised while running the batch this request was in."""

    code = grpc.StatusCode.INTERNAL


class ConfigError(ValueError):
    """A configuration or weights file that cannot be served; raised at start-up."""


class PortUnavailable(ConfigError):
    """A port the server was told to listen on cannot be bound (taken, or not this host's)."""


# A status message travels in the response trailers, which gRPC caps (8 KiB by default): however it
# was built, one that would not fit is cut here, so an error can never turn into RESOURCE_EXHAUSTED.
MAX_STATUS_CHARS = 2048


def clip(text: str, limit: int = 64, quote: bool = True) -> str:
    """Client-supplied text as it may appear in a status message or a log line: quoted (unless it
    names a field, as at the start of a message), at most `limit` characters of it (a name of 20,000
    characters must not come back 20,000 long)."""
    show = repr if quote else str
    return show(text) if len(text) <= limit else show(text[:limit]) + f"… ({len(text)} characters)"


def shape_text(shape) -> str:
    """A client-supplied shape for a message: at most 8 dimensions shown."""
    dims = list(shape)
    return str(dims) if len(dims) <= 8 else f"[{', '.join(map(str, dims[:8]))}, …] ({len(dims)} dimensions)"


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The (code, message) a caller sees for an exception; unexpected ones are INTERNAL."""
    if isinstance(exc, ServingError):
        message = exc.message
        if len(message) > MAX_STATUS_CHARS:
            message = message[: MAX_STATUS_CHARS - 1] + "…"
        return exc.code, message
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}"
