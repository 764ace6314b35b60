"""Which requests of a CPU batch compute together: a batch of mixed lengths runs as groups of similar length.

A batch runs padded to its longest query and key, so every request in it pays for that length: a
batch of L=1..128 (mean 56) padded to 128 computed 2.3x the tokens it needed, under a key-padding
mask that takes torch's slower masked path, and took 2.6x as long as running each sequence alone
(BENCHMARKS.md, eighth pass). Separate calls are not free either: each costs a fixed ~40-60 µs
on this CPU, whatever its size. So the requests, longest first, join the current group while the
padded group costs less than closing it and starting another would (one more call), by
`compute_macs`'s count. A batch of equal lengths, the common case, is one group and costs one pass
over its requests. The groups then compute one after another in one call into torch where the torch
can script it (worker.py, compute/scripted.py), so a group costs the GIL no second wait.

On CUDA a batch stays one group: its kernels are launch-bound at these sizes and one batch is one
host-to-device copy (staging.py); this rule was measured on the CPU only.
"""

from __future__ import annotations

from attnserve_server.domain import AttentionRequest, ModelSpec, compute_macs

# What one more torch call costs, in the multiply-adds the CPU does meanwhile: ~40-60 µs at 48-90
# M multiply-adds per ms (one or two threads; BENCHMARKS.md, eighth pass).
CALL_MACS = 3_000_000
# A group of mixed lengths needs a key-padding mask, and torch's masked path costs this much more
# than the unmasked one (fused MHA, E=256: 16 sequences padded to 128 took 1.3x as long with a mask).
MASKED_COST = 1.3


def _cost(spec: ModelSpec, sequences: int, query_len: int, key_len: int, padded: bool) -> float:
    macs = compute_macs(spec, sequences, query_len, key_len)
    return macs * MASKED_COST if padded else macs


def length_groups(spec: ModelSpec, requests: list[AttentionRequest]) -> list[list[AttentionRequest]]:
    """The batch's requests in groups, each to run as one padded batch: [requests] itself when they
    are of one length."""
    first = requests[0]
    query_len, key_len = first.query_len, first.key_len
    if all(r.query_len == query_len and r.key_len == key_len for r in requests):
        return [requests]
    order = sorted(requests, key=lambda r: (r.query_len, r.key_len), reverse=True)
    groups: list[list[AttentionRequest]] = []
    current: list[AttentionRequest] = []
    n = longest = widest = 0
    padded = False
    cost = 0.0
    for r in order:
        b, length, keys = r.sequences, r.query_len, r.key_len
        if current:
            mixed = padded or length != longest or keys != widest
            joined = _cost(spec, n + b, longest, max(widest, keys), mixed)
            apart = cost + compute_macs(spec, b, length, keys) + CALL_MACS
            if joined <= apart:
                current.append(r)
                n, widest, padded, cost = n + b, max(widest, keys), mixed, joined
                continue
            groups.append(current)
        current = [r]
        n, longest, widest, padded = b, length, keys, False
        cost = compute_macs(spec, b, length, keys)
    groups.append(current)
    return groups
