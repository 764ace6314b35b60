"""A batch's bytes in and out: every request's inputs into one buffer, the batch's outputs split per request.

In: on the CPU, requests of equal lengths are joined (one copy; none for a single request) and
viewed as a tensor; mixed lengths go into one zero-padded buffer. On CUDA every input of the batch
(query, key, value, key mask) is written into one page-locked slab and crosses to the device in a
single host-to-device copy; the kernels read views of it.
Out: the output (and weights) come back to the host once, and each request's answer is one slice
of it as bytes.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import torch

from attnserve_server.domain import AttentionRequest, HostTensor

_ALIGN = 256  # bytes: each region of the slab starts aligned for vectorised kernels

# torch.frombuffer warns, once per process, that message bytes are read-only. The kernels never
# write to their inputs, so spend that warning here.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0\0\0\0", dtype=torch.float32)


def storage_of(dtype: torch.dtype) -> tuple[np.dtype, torch.dtype]:
    """The numpy type that holds a torch dtype's bytes, and the torch view that numpy can hold."""
    if dtype == torch.bfloat16:
        return np.dtype(np.int16), torch.int16  # numpy has no bf16: move its bit patterns
    return torch.empty(0, dtype=dtype).numpy().dtype, dtype


def host_tensor(t: torch.Tensor) -> HostTensor:
    """A CPU tensor [B, T, D] as request bytes (warm-up, benchmarks and tests build requests so)."""
    _, view = storage_of(t.dtype)
    b, length, d = t.shape
    return HostTensor(t.contiguous().view(view).numpy().tobytes(), (b, length, d))


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's elements as numpy (bf16 as uint16 bit patterns); no copy."""
    return t.view(storage_of(t.dtype)[1]).numpy()


class Slab:
    """A grow-only byte buffer reused batch after batch (page-locked when it feeds a GPU).

    Safe to reuse because each belongs to one worker lane, which runs one batch at a time and
    synchronizes before its next.
    """

    def __init__(self, pinned: bool) -> None:
        self._pinned = pinned
        self._buffer = torch.empty(0, dtype=torch.uint8)

    @property
    def capacity(self) -> int:
        return self._buffer.numel()

    def take(self, nbytes: int) -> torch.Tensor:
        if nbytes > self._buffer.numel():
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pinned)
        return self._buffer[:nbytes]


def _fill(region: np.ndarray, parts: Sequence[HostTensor], storage: np.dtype) -> None:
    """Writes [B_i, T_i, D] parts into region [sum B_i, T, D], zero padding past each T_i."""
    length = region.shape[1]
    offset = 0
    for part in parts:
        b, t, d = part.shape
        region[offset : offset + b, :t] = np.frombuffer(part.data, dtype=storage).reshape(b, t, d)
        if t < length:
            region[offset : offset + b, t:] = 0
        offset += b


def key_mask(requests: Sequence[AttentionRequest], n: int, s: int) -> np.ndarray | None:
    """[N, S] bool, True for keys to ignore (the requests' own padding and the batch's), or None."""
    if all(r.key_padding is None and r.key_len == s for r in requests):
        return None
    mask = np.zeros((n, s), dtype=np.bool_)
    offset = 0
    for r in requests:
        b, length = r.sequences, r.key_len
        if r.key_padding is not None:
            mask[offset : offset + b, :length] = r.key_padding
        mask[offset : offset + b, length:] = True
        offset += b
    return mask


class Stager:
    """Turns a batch's requests into the kernels' input tensors on one device."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype
        self._storage = storage_of(dtype)[0]
        self._cuda = device.type == "cuda"
        self.slab = Slab(pinned=True) if self._cuda else None

    def _cpu(self, parts: Sequence[HostTensor], length: int) -> torch.Tensor:
        n = sum(p.shape[0] for p in parts)
        width = parts[0].shape[2]
        if all(p.shape[1] == length for p in parts):
            # Equal lengths: one join (no copy for a single request) and one view.
            data = parts[0].data if len(parts) == 1 else b"".join([p.data for p in parts])
            return torch.frombuffer(data, dtype=self.dtype).view(n, length, width)
        padded = np.empty((n, length, width), dtype=self._storage)
        _fill(padded, parts, self._storage)
        return torch.from_numpy(padded).view(self.dtype)

    def stage(
        self,
        roles: Sequence[tuple[Sequence[HostTensor], int]],
        mask: np.ndarray | None,
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """roles: (parts, padded length) per float input, in order. Returns their tensors and the mask's."""
        if not self._cuda:
            tensors = [self._cpu(parts, length) for parts, length in roles]
            return tensors, None if mask is None else torch.from_numpy(mask)
        # CUDA: plan one slab, fill it with numpy, one host-to-device copy, views on the device.
        itemsize = self._storage.itemsize
        layout: list[tuple[int, int, tuple[int, int, int]]] = []  # (offset, bytes, shape) per role
        offset = 0
        for parts, length in roles:
            shape = (sum(p.shape[0] for p in parts), length, parts[0].shape[2])
            nbytes = shape[0] * shape[1] * shape[2] * itemsize
            layout.append((offset, nbytes, shape))
            offset += -(-nbytes // _ALIGN) * _ALIGN
        mask_at = offset
        total = offset + (0 if mask is None else mask.size)
        host = self.slab.take(total)  # type: ignore[union-attr]
        host_np = host.numpy()
        for (parts, _), (at, nbytes, shape) in zip(roles, layout, strict=True):
            _fill(host_np[at : at + nbytes].view(self._storage).reshape(shape), parts, self._storage)
        if mask is not None:
            host_np[mask_at:total] = mask.reshape(-1).view(np.uint8)
        dev = host.to(self.device, non_blocking=True)
        tensors = []
        for at, nbytes, shape in layout:
            tensors.append(dev[at : at + nbytes].view(self.dtype).view(shape))
        dev_mask = None if mask is None else dev[mask_at:total].view(torch.bool).view(mask.shape)
        return tensors, dev_mask


def split(batch: np.ndarray, requests: Sequence[AttentionRequest], key_axis: bool) -> list[bytes]:
    """Each request's rows of a batch output as bytes, cut to its own query (and key) length.

    batch is [N, ..., L, W] (output) or [N, ..., L, S] (weights, key_axis=True). One copy per request.
    """
    out = []
    offset = 0
    length = batch.shape[-2]
    for r in requests:
        rows = batch[offset : offset + r.sequences]
        if r.query_len < length:
            rows = rows[..., : r.query_len, :]
        if key_axis and r.key_len < batch.shape[-1]:
            rows = rows[..., : r.key_len]
        out.append(rows.tobytes())
        offset += r.sequences
    return out
