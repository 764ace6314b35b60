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


class BatchFailed(ServingError):
    """The worker raised while running the batch this request was in."""

    code = grpc.StatusCode.INTERNAL


class ConfigError(ValueError):
    """A configuration or weights file that cannot be served; raised at start-up."""


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The (code, message) a caller sees for an exception; unexpected ones are INTERNAL."""
    if isinstance(exc, ServingError):
        return exc.code, exc.message
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}"
