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
                raise ConfigError(f"device {name!r}: {count} CUDA device(s) visible")
            found = [torch.device("cuda", index)]
        devices.extend(d for d in found if d not in devices)
    return devices
