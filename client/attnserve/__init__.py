"""attnserve's Python client: multi-head attention over gRPC, numpy in and out, no torch needed."""

from attnserve._aio import AsyncClient
from attnserve._codec import decode_tensor, encode_tensor
from attnserve._errors import AttnServeError
from attnserve._sync import Client
from attnserve._types import AttendResult, ModelInfo, Request, Timing

__all__ = [
    "AsyncClient",
    "AttendResult",
    "AttnServeError",
    "Client",
    "ModelInfo",
    "Request",
    "Timing",
    "decode_tensor",
    "encode_tensor",
]
__version__ = "0.1.0"
