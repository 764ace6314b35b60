"""attnserve's server: multi-head attention over gRPC, batched on device workers.

Needs the server extra (pip install 'attnserve[server]'). Importing the package is
cheap; torch loads when a server class is first used, so `attnserve infer` runs
with the client alone.
"""

from __future__ import annotations

from typing import Any

__all__ = ["AttnServer", "ModelSettings", "ServerSettings", "load_settings"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'attnserve_server' has no attribute {name!r}")
    try:
        import torch  # noqa: F401
    except ImportError as exc:
        raise ImportError("attnserve's server needs torch: pip install 'attnserve[server]'") from exc
    from attnserve_server import app, settings

    return getattr(app if name == "AttnServer" else settings, name)
