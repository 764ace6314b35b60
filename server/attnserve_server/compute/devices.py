"""Resolves configured device names to torch devices."""

from __future__ import annotations

import torch

from attnserve_server.errors import ConfigError


def resolve_devices(names: tuple[str, ...]) -> list[torch.device]:
    """auto: every visible GPU, else the CPU; cuda: cuda:0; duplicates dropped, order kept."""
    cuda = torch.cuda.is_available()
    count = torch.cuda.device_count() if cuda else 0
    devices: list[torch.device] = []
    for name in names:
        if name == "auto":
            found = [torch.device("cuda", i) for i in range(count)] or [torch.device("cpu")]
        elif name == "cpu":
            found = [torch.device("cpu")]
        else:
            index = int(name.partition(":")[2] or 0)
            if index >= count:
                # Never a silent CPU fallback: a deployment that asked for a GPU must not serve without one.
                why = (
                    ""
                    if cuda
                    else (
                        f"; torch {torch.__version__} sees no usable CUDA device (a CPU build of torch, no GPU, "
                        "or a driver older than its CUDA runtime)"
                    )
                )
                raise ConfigError(
                    f"device {name!r}: {count} CUDA device(s) visible{why}; use 'auto' or 'cpu' to allow the CPU"
                )
            found = [torch.device("cuda", index)]
        devices.extend(d for d in found if d not in devices)
    return devices
