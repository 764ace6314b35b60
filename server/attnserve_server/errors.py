"""Domain errors. Each carries the status its caller gets: this hierarchy is the one mapping table.

A status is the name of a gRPC status code ("UNAVAILABLE"), the codes of every API served (the
native one and KServe v2 over gRPC). It is kept as a name so that this module, and the batching and
compute code that raise these errors, import no gRPC; the edge turns it into a `grpc.StatusCode`.
"""

from __future__ import annotations


class ServingError(Exception):
    """An error the caller should see, with the status it maps to."""

    status: str = "INTERNAL"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(ServingError):
    status = "INVALID_ARGUMENT"


class NotFound(ServingError):
    status = "NOT_FOUND"


class ModelNotFound(NotFound):
    pass


class AlreadyExists(ServingError):
    status = "ALREADY_EXISTS"


class FailedPrecondition(ServingError):
    """The call is well formed, but the server is not set up for it."""

    status = "FAILED_PRECONDITION"


class Unimplemented(ServingError):
    """A method or feature of a protocol that this server does not serve."""

    status = "UNIMPLEMENTED"


class QueueFull(ServingError):
    status = "RESOURCE_EXHAUSTED"


class UnsentAnswers(ServingError):
    """The caller's connection holds too many answers its client has not read (edge/outbox.py)."""

    status = "RESOURCE_EXHAUSTED"


class DeadlineExpired(ServingError):
    status = "DEADLINE_EXCEEDED"


class ShuttingDown(ServingError):
    status = "UNAVAILABLE"

    @classmethod
    def of_model(cls, name: str) -> ShuttingDown:
        """A model's refusal of a new request while the server drains, in the same words whichever
        process refuses it (the model in one process, an edge process reading the engine's board)."""
        return cls(f"model {name!r}: the server is shutting down and takes no new requests")


class ModelNotReady(ServingError):
    status = "UNAVAILABLE"


class Unauthenticated(ServingError):
    status = "UNAUTHENTICATED"


class PermissionDenied(ServingError):
    status = "PERMISSION_DENIED"


class BatchFailed(ServingError):
    """The worker raised while running the batch this request was in."""

    status = "INTERNAL"


class DeviceOutOfMemory(ServingError):
    """The device ran out of memory for this request's computation: one that fits the batch memory budget,
    but not what the device had free then (other batches, fragmentation). Retry later, or smaller."""

    status = "RESOURCE_EXHAUSTED"


class WorkerLost(ServingError):
    """A worker's device can compute no more (a CUDA error that outlives its batch poisons the process's
    context): its batcher stops and the server exits non-zero, for the orchestrator to restart it. The
    callers are told UNAVAILABLE, which clients retry, on another replica or on this one restarted."""

    status = "UNAVAILABLE"


class BatcherStopped(ServingError):
    """The model's batcher stopped (its runner died): the server is stopping, to be restarted."""

    status = "UNAVAILABLE"


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
    """A client-supplied shape for a message: at most 8 dimensions shown (and read: a shape of millions
    costs no more than one of 8)."""
    count = len(shape)
    dims = list(shape[:8])
    return str(dims) if count <= 8 else f"[{', '.join(map(str, dims))}, …] ({count} dimensions)"


def size_text(nbytes: float) -> str:
    """A number of bytes for a message: in MiB, or in KiB below one MiB."""
    return f"{nbytes / 2**20:,.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:,.1f} KiB"


def status_of(exc: BaseException) -> tuple[str, str]:
    """The (status name, message) a caller sees for an exception; unexpected ones are INTERNAL."""
    if isinstance(exc, ServingError):
        message = exc.message
        if len(message) > MAX_STATUS_CHARS:
            message = message[: MAX_STATUS_CHARS - 1] + "…"
        return exc.status, message
    return "INTERNAL", f"internal error: {type(exc).__name__}"
