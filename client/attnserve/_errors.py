"""The client's one error type: a gRPC status code and the server's message."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import grpc


class AttnServeError(Exception):
    """A call failed: `code` is the gRPC status, `message` the server's explanation."""

    def __init__(self, code: grpc.StatusCode, message: str, request_id: str = "") -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> AttnServeError:
        # grpc.RpcError raised by a call is also a grpc.Call with code() and details().
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = error.details() if hasattr(error, "details") else str(error)
        return cls(code or grpc.StatusCode.UNKNOWN, details or "")


_CODE_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def status_code_from_number(number: int) -> grpc.StatusCode:
    return _CODE_BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)


@contextmanager
def translate_errors() -> Iterator[None]:
    """Turns a failed call's grpc.RpcError into AttnServeError (works around awaits too)."""
    try:
        yield
    except grpc.RpcError as error:
        raise AttnServeError.from_rpc_error(error) from None
