"""A batch's bytes in and out: every request's inputs into one buffer, the batch's outputs split per request.

In: on the CPU, the requests are packed into one buffer, zero-padded to the longest (one copy each;
none for a lone request), and viewed as a tensor. On CUDA every input of the batch
(query, key, value, key mask) is written into one page-locked slab and crosses to the device in a
single host-to-device copy; the kernels read views of it.
Out: the output (and weights) come back to the host once, and each request's answer is one slice
of it: a view of the batch's memory on the CPU (its response's framing copies it once), bytes of
its own where the batch's memory is reused (CUDA's pinned slab), or, for a request that brought room
for its answer (an edge process's arena region), written there (`answers_of`, `write_into`).

Inputs are packed with memoryview slice assignment: a memcpy that keeps the GIL. The worker thread
shares the GIL with the event loop, and giving it up for longer than a moment lets a busy loop take
it, after which the worker waits up to the switch interval (5 ms) to have it back. bytes.join gives
it up while it copies more than 1 MiB (sixteen W1 requests): at concurrency 32 the join cost 1.2 ms
a batch, almost all of it that wait (BENCHMARKS.md, tenth pass). For the same reason a batch makes
as few torch calls as it can.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence

import numpy as np
import torch

from attnserve_server.domain import AnswerRoom, AttentionRequest, HostTensor, aligned

_ALIGN = 256  # bytes: each region of the slab starts aligned for vectorised kernels

# torch.from_numpy and torch.frombuffer warn, once per process each, that an array or buffer over
# message bytes is read-only. The kernels never write to their inputs, so spend those warnings here.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.from_numpy(np.frombuffer(b"\0\0\0\0", dtype=np.float32))
    torch.frombuffer(b"\0\0\0\0", dtype=torch.float32)


@functools.cache
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


def over_bytes(part: HostTensor, dtype: torch.dtype) -> torch.Tensor:
    """A request's input [B, T, D] as a tensor over its own bytes: no copy (the kernels only read it)."""
    if not part.data:  # frombuffer takes no empty buffer
        return torch.empty(part.shape, dtype=dtype)
    return torch.frombuffer(part.data, dtype=dtype).view(part.shape)


def answer_bytes(rows: np.ndarray, view: bool) -> bytes | memoryview:
    """An answer's bytes: with `view`, a byte view of `rows` where they are contiguous (the response's
    framing then makes the one copy, edge/framing.py); else bytes of their own."""
    return memoryview(rows).cast("B") if view and rows.flags.c_contiguous else rows.tobytes()


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's elements as numpy (bf16 as uint16 bit patterns); no copy."""
    view = storage_of(t.dtype)[1]
    return (t if view == t.dtype else t.view(view)).numpy()


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


_zeros = memoryview(bytes(1 << 16))  # padding's source; replaced by a larger one when a row needs it


def _zeros_of(nbytes: int) -> memoryview:
    global _zeros
    if len(_zeros) < nbytes:
        _zeros = memoryview(bytes(nbytes))
    return _zeros[:nbytes]


def pack(dest: memoryview, parts: Sequence[HostTensor], length: int, itemsize: int) -> None:
    """Writes [B_i, T_i, D] parts into `dest` (bytes) as [sum B_i, length, D], zero padding past each
    T_i. memoryview copies, so the GIL stays with the caller throughout (see the module's note)."""
    at = 0
    for part in parts:
        b, t, d = part.shape
        src = memoryview(part.data).cast("B")
        if t == length:
            dest[at : at + len(src)] = src
            at += len(src)
            continue
        row, pad = t * d * itemsize, (length - t) * d * itemsize
        zeros = _zeros_of(pad)
        for i in range(b):
            dest[at : at + row] = src[i * row : (i + 1) * row]
            dest[at + row : at + row + pad] = zeros
            at += row + pad


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

    def __init__(self, device: torch.device, dtype: torch.dtype, one_slab: bool | None = None) -> None:
        """`one_slab`: stage every input into one slab and copy that to the device at once; by default
        on CUDA only (the slab is page-locked there)."""
        self.device = device
        self.dtype = dtype
        self._storage = storage_of(dtype)[0]
        cuda = device.type == "cuda"
        self.slab = Slab(pinned=cuda) if (cuda if one_slab is None else one_slab) else None

    def _cpu(self, parts: Sequence[HostTensor], length: int) -> torch.Tensor:
        n = sum(p.shape[0] for p in parts)
        width = parts[0].shape[2]
        if len(parts) == 1 and parts[0].shape[1] == length:
            return over_bytes(parts[0], self.dtype)
        data = np.empty(n * length * width, dtype=self._storage)
        pack(memoryview(data).cast("B"), parts, length, self._storage.itemsize)
        t = torch.from_numpy(data.reshape(n, length, width))
        return t if t.dtype == self.dtype else t.view(self.dtype)

    def stage(
        self,
        roles: Sequence[tuple[Sequence[HostTensor], int]],
        mask: np.ndarray | None,
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """roles: (parts, padded length) per float input, in order. Returns their tensors and the mask's."""
        if self.slab is None:
            tensors = [self._cpu(parts, length) for parts, length in roles]
            return tensors, None if mask is None else torch.from_numpy(mask)
        # One slab (CUDA): plan it, pack every input into it, one host-to-device copy, views on the device.
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
        host = self.slab.take(total)
        dest = memoryview(host.numpy())
        for (parts, length), (at, nbytes, _) in zip(roles, layout, strict=True):
            pack(dest[at : at + nbytes], parts, length, itemsize)
        if mask is not None:
            dest[mask_at:total] = memoryview(np.ascontiguousarray(mask)).cast("B")
        dev = host.to(self.device, non_blocking=True)
        tensors = []
        for at, nbytes, shape in layout:
            tensors.append(dev[at : at + nbytes].view(self.dtype).view(shape))
        dev_mask = None if mask is None else dev[mask_at:total].view(torch.bool).view(mask.shape)
        return tensors, dev_mask


def request_rows(
    batch: np.ndarray, requests: Sequence[AttentionRequest], key_axis: bool
) -> list[tuple[np.ndarray, bool]]:
    """Each request's rows of a batch output, cut to its own query (and key) length, as views of the
    batch, and whether they were cut. batch is [N, ..., L, W] (output) or [N, ..., L, S] (weights,
    key_axis=True)."""
    out: list[tuple[np.ndarray, bool]] = []
    offset = 0
    length = batch.shape[-2]
    width = batch.shape[-1]
    for r in requests:
        rows = batch[offset : offset + r.sequences]
        cut = False
        if r.query_len < length:
            rows, cut = rows[..., : r.query_len, :], True
        if key_axis and r.key_len < width:
            rows, cut = rows[..., : r.key_len], True
        out.append((rows, cut))
        offset += r.sequences
    return out


def split(
    batch: np.ndarray, requests: Sequence[AttentionRequest], key_axis: bool, views: bool = False
) -> list[bytes | memoryview]:
    """Each request's rows of a batch output (`request_rows`) as its answer's bytes.

    A request's rows are copied into bytes of their own, unless `views` (the batch's memory is not
    reused: a CPU output) and they are contiguous already, a request not cut shorter than the batch:
    then its answer is a byte view of the batch, and the response's framing makes the one copy
    (edge/framing.py).
    """
    return [answer_bytes(rows, views and not cut) for rows, cut in request_rows(batch, requests, key_axis)]


def answers_of(
    output: np.ndarray, weights: np.ndarray | None, requests: Sequence[AttentionRequest], views: bool
) -> list[tuple[bytes | memoryview, bytes | memoryview | None, bool]]:
    """Each request's answer from its batch's output (and weights): (output, weights, in place). A request
    that brought room for its answer has it written there when it fits (`write_into`); any other gets
    its rows as bytes, by `split`'s rule for `views`."""
    out_rows = request_rows(output, requests, key_axis=False)
    w_rows = None if weights is None else request_rows(weights, requests, key_axis=True)
    answers: list[tuple[bytes | memoryview, bytes | memoryview | None, bool]] = []
    for i, r in enumerate(requests):
        rows, cut = out_rows[i]
        w = None if w_rows is None else w_rows[i]
        placed = None if r.answer_into is None else write_into(r.answer_into, rows, None if w is None else w[0])
        if placed is not None:
            answers.append((placed[0], placed[1], True))
        else:
            w_bytes = None if w is None else answer_bytes(w[0], views and not w[1])
            answers.append((answer_bytes(rows, views and not cut), w_bytes, False))
    return answers


def write_into(
    room: AnswerRoom, output: np.ndarray, weights: np.ndarray | None
) -> tuple[memoryview, memoryview | None] | None:
    """Writes an answer into the room its request brought (AttentionRequest.answer_into): the output
    from the start, the weights from the next aligned offset. Returns the two byte views, or None when the answer
    does not fit or the room was closed (nothing is written then). numpy makes the copies without
    holding the GIL (all but the smallest), so the lane that writes keeps no other thread of the engine
    waiting. Unlike packing (the module's note), giving the GIL up here costs the lane little: only an
    engine behind edge processes brings rooms, and its event loop serves no gRPC, so it is seldom busy
    long enough to keep the lane from taking the GIL back."""
    out_n = output.nbytes
    w_at = aligned(out_n)
    end = out_n if weights is None else w_at + weights.nbytes
    with room as view:
        if view is None or end > view.nbytes:
            return None
        _copy_into(view[:out_n], output)
        if weights is None:
            return view[:out_n], None
        _copy_into(view[w_at:end], weights)
        return view[:out_n], view[w_at:end]


def _copy_into(dest: memoryview, rows: np.ndarray) -> None:
    np.copyto(np.frombuffer(dest, dtype=rows.dtype).reshape(rows.shape), rows)
