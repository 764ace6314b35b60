"""The projections' matrix products: on the CPU oneDNN with weights packed once, or torch's own where that is
faster (`cpu_matmul: auto`); torch's own elsewhere.

torch's `F.linear` multiplies float32 on the CPU with MKL's sgemm, whatever the CPU. oneDNN (which
torch ships, and calls for its own bfloat16 products) picks kernels by the CPU's instruction sets, and
a weight reordered once into its blocked layout saves the per-call repacking. Measured in-process
(BENCHMARKS.md, thirty-fourth pass, AMD EPYC Zen 4): W1's whole attention 5-12% cheaper a sequence
on one thread at batches 4-32 (10-16% on two; the same at batch 1), WL's 17-28% on two; bfloat16
projections 3-11%. Results match torch's to float32 rounding (max |difference| ~2e-7 on W1).

Below ONEDNN_MIN_ROWS rows a product goes to `F.linear` all the same: there oneDNN's fixed cost per
call outweighs its kernels (one L=1 request: 90 µs against 50 on torch's fused kernel; L=16, 8%
slower; from L=32 a tie).

`cpu_matmul: aten` keeps torch's `F.linear` (an operator's escape hatch, and the reference the
tests compare against). CUDA always multiplies through torch (cuBLAS).

Which is faster depends on the CPU, though. On an AVX2-only AMD EPYC Zen 3 (family 25) MKL picks kernels of its
own, and oneDNN's products mostly cost 9-19% more than `F.linear`'s on one thread (W1's and WL's projections at
batches 1-32; a tie on two). Under perf_analyzer, in pairs of fresh servers (BENCHMARKS.md, sixty-ninth pass),
`F.linear` served WL at concurrency 32 1.15x what oneDNN served (5 runs, 16 of 16 pairs), cross attention with a
key_value of 32 tokens 1.06x (the median of 5 runs, 0.94-1.09), causal W1 1.01x (10 runs) and WL at concurrency
1 0.97x (2 runs, p50 the same). On the AVX2-only Zen 2 (family 23) oneDNN computed WL 6-15% cheaper and W1 by
batch either way (fifty-third pass), and the tiled path under load tied (1.02x, fifty-fifth). So
`cpu_matmul: auto` (the default) is `aten` on AMD's family 25 where torch's kernels compute with AVX2 and not
AVX-512 (the Zen 3), and `onednn` elsewhere.
"""

from __future__ import annotations

import logging
import threading

import torch

from attnserve_server.compute.devices import cpu_family
from attnserve_server.settings import CPU_MATMULS

log = logging.getLogger(__name__)

# Fewer rows (sequences x tokens) than this multiply on torch's F.linear (the module docstring says why).
ONEDNN_MIN_ROWS = 64


def resolve_cpu_matmul(choice: str) -> str:
    """The products a model's `cpu_matmul` setting comes to on this CPU: "onednn" or "aten" (for "auto", the
    module docstring says which where)."""
    if choice not in CPU_MATMULS:
        raise ValueError(f"cpu_matmul: expected one of {', '.join(CPU_MATMULS)}, got {choice!r}")
    if choice != "auto":
        return choice
    if cpu_family() == ("AuthenticAMD", 25) and torch.backends.cpu.get_cpu_capability() == "AVX2":
        return "aten"
    return "onednn"


def _onednn_ops() -> tuple[object, object] | None:
    """torch's oneDNN linear ops (those its compiler emits for frozen CPU models), where this build has them."""
    if not torch.backends.mkldnn.is_available():
        return None
    ops = torch.ops.mkldnn
    try:
        return ops._reorder_linear_weight, ops._linear_pointwise
    except (AttributeError, RuntimeError):
        return None


class Linear:
    """One projection, y = x W^T + b: its weight and bias, and the operand a product of so many rows takes
    (`operand`); compute/scripted.py's `_linear` makes the product, on oneDNN or on `F.linear`.

    On the CPU with `onednn` the weight is packed at the first product (the worker's warm-up, for the
    projections every request uses; the first cross-attention request for W_Q and [W_K; W_V], or W_K and
    W_V apart where a request sends a key and a value of its own), so a model holds the packed copies
    it computes with, no others."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, cpu_matmul: str = "onednn") -> None:
        self.weight = weight
        self.bias = bias
        onednn = resolve_cpu_matmul(cpu_matmul) == "onednn"
        self._ops = _onednn_ops() if onednn and weight.device.type == "cpu" else None
        self._packed: torch.Tensor | None = None
        self._lock = threading.Lock()

    def _pack(self) -> torch.Tensor | None:
        with self._lock:
            if self._packed is not None or self._ops is None:
                return self._packed
            reorder, pointwise = self._ops
            try:
                packed = reorder(self.weight.detach().contiguous(), None)  # type: ignore[operator]
                # One product proves the kernel runs here (float16 needs AVX512-FP16 or AVX-NE-CONVERT,
                # bfloat16 AVX512-BW/VL/DQ or AVX-NE-CONVERT: an AVX2-only CPU has neither).
                probe = torch.zeros(1, self.weight.shape[1], dtype=self.weight.dtype)
                pointwise(probe, packed, self.bias, "none", [], "")  # type: ignore[operator]
            except RuntimeError as exc:
                log.info("oneDNN linear unavailable for %s here (%s): torch's F.linear instead", self.weight.dtype, exc)
                self._ops = None
                return None
            self._packed = packed
            return packed

    def takes(self, rows: int) -> bool:
        """Whether a product of `rows` rows runs on oneDNN (before the first product: where it will)."""
        return self._ops is not None and rows >= ONEDNN_MIN_ROWS

    def operand(self, rows: int) -> tuple[torch.Tensor, bool]:
        """The weight a product of `rows` rows multiplies by, and whether on oneDNN (then the packed weight,
        for its `_linear_pointwise` op) or on `F.linear` (the weight as given)."""
        if self.takes(rows):
            packed = self._packed if self._packed is not None else self._pack()
            if packed is not None:
                return packed, True
        return self.weight, False
