"""Resolves configured device names to torch devices, and says what the CPU computes slowly."""

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


# CPU flags with which torch's CPU kernels (oneDNN) multiply float16 matrices natively.
FLOAT16_FLAGS = frozenset({"avx512_fp16", "amx_fp16"})
# On x86, oneDNN has bfloat16 kernels with any of these sets of flags (natively, or converting on AVX-512),
# and none with only AVX2.
BFLOAT16_FLAG_SETS = (frozenset({"avx512bw", "avx512vl", "avx512dq"}), frozenset({"avx_ne_convert"}))


def _first_cpu(path: str) -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        with open(path) as f:
            for line in f:
                if not line.strip():
                    if fields:
                        break
                    continue
                name, _, value = line.partition(":")
                fields[name.strip()] = value.strip()
    except OSError:
        pass
    return fields


def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (empty where there is no /proc/cpuinfo)."""
    return frozenset(_first_cpu(path).get("flags", "").split())


def cpu_family(path: str = "/proc/cpuinfo") -> tuple[str, int] | None:
    """The CPU's vendor and family as Linux lists them, e.g. ("AuthenticAMD", 23) for AMD's Zen to Zen 2
    (25 is Zen 3 and Zen 4); None where there is no /proc/cpuinfo or it names neither."""
    fields = _first_cpu(path)
    vendor, family = fields.get("vendor_id"), fields.get("cpu family", "")
    return (vendor, int(family)) if vendor and family.isdigit() else None


def float16_is_slow(flags: frozenset[str]) -> bool:
    """Whether float16 on this CPU runs without matrix instructions of its own: in torch that is
    ~10x slower than bfloat16 (W1 in-process, AVX-512 BF16 without FP16: 545 against 5681 req/s)."""
    return not flags & FLOAT16_FLAGS


def bfloat16_is_slow(flags: frozenset[str]) -> bool:
    """Whether this is an x86 CPU on which oneDNN has no bfloat16 kernels (AVX2 only): torch's bfloat16
    products then convert element by element. W1 in-process on an AMD EPYC Zen 2, one worker: 3.7x
    float32's time a sequence at batch 1, 6.3x at batch 16 (BENCHMARKS.md, fifty-third pass)."""
    return "sse2" in flags and not any(needed <= flags for needed in BFLOAT16_FLAG_SETS)
