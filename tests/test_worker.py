"""The device worker on its own: thread settings and what it reports for a batch."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import platform
import statistics
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from attnserve_server.compute import attention, linear, scripted
from attnserve_server.compute.attention import AttentionCompute
from attnserve_server.compute.devices import cpu_family, cpu_flags
from attnserve_server.compute.groups import length_groups
from attnserve_server.compute.staging import Stager, host_tensor, pack, split
from attnserve_server.compute.threads import (
    FIRST_SAMPLES,
    LONE_UNDER_LOAD,
    MIN_SPEEDUP,
    PROBE_BUDGET,
    PROBE_EVERY,
    SHORT_PROBE_FACTOR,
    SMALL_BATCH_MACS,
    CpuThreads,
    ThreadChooser,
)
from attnserve_server.compute.weights import random_projections
from attnserve_server.compute.worker import DeviceWorker
from attnserve_server.domain import AnswerRoom, AttentionRequest, HostTensor, aligned, compute_macs
from attnserve_server.errors import DeviceOutOfMemory, WorkerLost
from attnserve_server.metrics import Metrics
from attnserve_server.model import ServedModel, spec_from_settings
from attnserve_server.runtime import allocator, openmp, pyheap
from attnserve_server.settings import BatchingSettings, ModelSettings

from conftest import output_of, request, weights_of


def worker(
    torch_threads: int | None = None, small_batch_macs: int = SMALL_BATCH_MACS, min_speedup: float = MIN_SPEEDUP
) -> DeviceWorker:
    spec = spec_from_settings(ModelSettings(embed_dim=16, num_heads=2, device=("cpu",)))
    threads = CpuThreads(torch_threads, small_batch_macs, min_speedup)
    return DeviceWorker(spec, random_projections(spec, 0), torch.device("cpu"), threads)


@pytest.mark.parametrize("dtype", [np.float32, np.int16])  # int16: bfloat16's bit patterns
def test_pack_writes_each_sequence_at_its_place_and_zeros_past_its_length(dtype) -> None:
    rng = np.random.default_rng(0)
    arrays = [rng.integers(1, 100, size=shape).astype(dtype) for shape in ((2, 3, 4), (1, 5, 4), (3, 2, 4))]
    # Message bytes, and a typed memoryview (as an engine's arena might hand over): both pack alike.
    parts = [
        HostTensor(arrays[0].tobytes(), (2, 3, 4)),
        HostTensor(memoryview(arrays[1]), (1, 5, 4)),
        HostTensor(arrays[2].tobytes(), (3, 2, 4)),
    ]
    dest = np.full((6, 5, 4), -1, dtype=dtype)  # stale bytes, as a reused buffer holds
    pack(memoryview(dest).cast("B"), parts, 5, dest.itemsize)
    expected = np.zeros((6, 5, 4), dtype=dtype)
    expected[0:2, :3], expected[2:3], expected[3:6, :2] = arrays
    np.testing.assert_array_equal(dest, expected)


@pytest.mark.parametrize("one_slab", [False, True], ids=["cpu", "one slab, as on cuda"])
def test_staging_pads_every_input_and_carries_the_mask(one_slab: bool) -> None:
    # The one-slab layout is CUDA's (every input and the mask in one buffer, one copy to the device);
    # run here on the CPU, so it is checked where no GPU is.
    rng = np.random.default_rng(1)
    queries = [torch.from_numpy(rng.standard_normal((1, t, 8)).astype(np.float32)) for t in (3, 5)]
    keys = [torch.from_numpy(rng.standard_normal((1, s, 6)).astype(np.float32)) for s in (4, 2)]
    mask = np.array([[False, False, False, True], [False, False, True, True]])
    stager = Stager(torch.device("cpu"), torch.float32, one_slab=one_slab)
    for _ in range(2):  # the slab is reused: a second batch must not see the first's bytes
        (query, key), staged_mask = stager.stage(
            [([host_tensor(q) for q in queries], 5), ([host_tensor(k) for k in keys], 4)], mask
        )
        expected_q, expected_k = torch.zeros(2, 5, 8), torch.zeros(2, 4, 6)
        expected_q[0, :3], expected_q[1], expected_k[0], expected_k[1, :2] = queries[0], queries[1], keys[0], keys[1]
        assert torch.equal(query, expected_q) and torch.equal(key, expected_k)
        assert staged_mask is not None and np.array_equal(staged_mask.numpy(), mask)
        queries = [q + 1 for q in queries]


@pytest.mark.parametrize("views", [True, False], ids=["fresh output (cpu)", "reused slab (cuda)"])
def test_split_cuts_each_answer_and_views_only_memory_that_is_not_reused(views: bool) -> None:
    batch = np.arange(4 * 5 * 3, dtype=np.float32).reshape(4, 5, 3)
    # Two sequences of the full length, one cut to 2 of the batch's 5 positions, one of the full length.
    requests = [
        request(np.zeros((2, 5, 3), np.float32)),
        request(np.zeros((1, 2, 3), np.float32)),
        request(np.zeros((1, 5, 3), np.float32)),
    ]
    parts = split(batch, requests, key_axis=False, views=views)
    expected = [batch[0:2], batch[2:3, :2], batch[3:4]]
    for part, rows in zip(parts, expected, strict=True):
        assert bytes(part) == rows.tobytes()
    kinds = [type(p) for p in parts]
    # A view of a reused buffer would change under the answer when the next batch lands there.
    assert kinds == ([memoryview, bytes, memoryview] if views else [bytes, bytes, bytes])
    batch[:] = -1  # what a reused buffer's next batch does: copies keep their bytes
    for part, rows in zip(parts, expected, strict=True):
        assert (bytes(part) == rows.tobytes()) == (type(part) is memoryview)


def test_a_request_that_brings_room_for_its_answer_has_it_written_there() -> None:
    # An edge process's request brings a region of its arena (AnswerRoom): the worker writes the answer
    # there, output first and weights from the next aligned offset, on the batch path and a lone request's.
    w = worker()
    try:
        rng = np.random.default_rng(5)
        queries = [rng.standard_normal((1, n, 16)).astype(np.float32) for n in (3, 7, 7)]
        plain = w.run([request(q, need_weights=True) for q in queries])
        arena = memoryview(bytearray(3 * 4096))
        rooms = [AnswerRoom(arena[:4096]), None, AnswerRoom(arena[8192:])]
        placed = w.run(
            [
                dataclasses.replace(request(q, need_weights=True), answer_into=room)
                for q, room in zip(queries, rooms, strict=True)
            ]
        )
        for got, alone, room in zip(placed, plain, rooms, strict=True):
            assert got.in_place == (room is not None)
            np.testing.assert_array_equal(output_of(got), output_of(alone))
            np.testing.assert_array_equal(weights_of(got), weights_of(alone))
            if room is not None:
                assert bytes(room.view[: len(got.output)]) == bytes(alone.output)
                at = aligned(len(got.output))
                assert bytes(room.view[at : at + len(got.weights)]) == bytes(alone.weights)  # type: ignore[arg-type]
        assert bytes(arena[4096:8192]) == bytes(4096)  # the request without a room: nothing written for it
        lone_room = AnswerRoom(memoryview(bytearray(4096)))
        lone = w.run([dataclasses.replace(request(queries[0]), answer_into=lone_room)])[0]
        assert lone.in_place and bytes(lone.output) == bytes(w.run([request(queries[0])])[0].output)
        assert bytes(lone_room.view[: len(lone.output)]) == bytes(lone.output)
        # A room too small, or closed (its request given up on), is not written: the answer is bytes of its own.
        small = AnswerRoom(memoryview(bytearray(64)))
        closed = AnswerRoom(memoryview(bytearray(4096)))
        closed.close()
        answers = w.run(
            [
                dataclasses.replace(request(queries[1]), answer_into=small),
                dataclasses.replace(request(queries[2]), answer_into=closed),
            ]
        )
        assert [a.in_place for a in answers] == [False, False]
        assert bytes(small.view) == bytes(64) and bytes(closed.view) == bytes(4096)
        assert output_of(answers[1]).shape == (1, 7, 16)
    finally:
        w.close()


def test_closing_an_answer_room_waits_for_a_write_in_progress_and_stops_later_ones() -> None:
    room = AnswerRoom(memoryview(bytearray(8)))
    entered, proceed, closed = threading.Event(), threading.Event(), threading.Event()

    def write() -> None:
        with room as view:
            assert view is not None
            entered.set()
            assert proceed.wait(10)
            view[:] = b"answered"

    def close() -> None:
        room.close()
        closed.set()

    writer = threading.Thread(target=write)
    writer.start()
    assert entered.wait(10)
    closer = threading.Thread(target=close)
    closer.start()
    assert not closed.wait(0.2)  # the write in progress keeps the room open until it ends
    proceed.set()
    writer.join(10)
    closer.join(10)
    assert closed.is_set() and bytes(room.view) == b"answered"
    with room as view:
        assert view is None  # closed: no later write starts


def test_a_cpu_worker_computes_without_autograd_and_answers_the_same_twice() -> None:
    w = worker()
    try:
        query = np.random.default_rng(3).standard_normal((1, 4, 16)).astype(np.float32)
        first, second = w.run([request(query)])[0], w.run([request(query)])[0]
        assert type(first.output) is memoryview  # a view of the batch's own output
        np.testing.assert_array_equal(output_of(first), output_of(second))
        assert torch.is_grad_enabled()  # a caller's own thread: off only during the batch
        w.executor.submit(w.run, [request(query)]).result()
        assert w.executor.submit(torch.is_grad_enabled).result() is False  # off for good on the worker's
    finally:
        w.close()


def test_served_batches_and_warm_up_compute_in_inference_mode_and_a_callers_batch_too() -> None:
    w = worker()
    modes: list[bool] = []
    compute = w._compute

    class Recorded:
        def __call__(self, *args: object) -> object:
            modes.append(torch.is_inference_mode_enabled())
            return compute(*args)  # type: ignore[arg-type]

        def __getattr__(self, name: str) -> object:
            return getattr(compute, name)

    w._compute = Recorded()  # type: ignore[assignment]
    query = np.random.default_rng(4).standard_normal((1, 4, 16)).astype(np.float32)
    try:
        w.run([request(query)])  # a caller's thread (grad on): inference mode for the batch only
        assert modes == [True] and not torch.is_inference_mode_enabled() and torch.is_grad_enabled()
        # a served lane's thread: for good, as long as it serves
        served = w.executor.submit(w.serve, lambda run, done, **_: run([request(query)]), None)
        served.result()
        assert modes == [True, True]
        w.executor.submit(w.warmup).result()
        assert len(modes) > 2 and all(modes)
        # a thread with autograd off for good (as the event loop's, for solo runs: model.py), as it is
        w.executor.submit(w.run, [request(query)]).result()
        assert modes[-1] is False
    finally:
        w.close()


@pytest.mark.parametrize("bound", ["batch", "sequence"])
def test_warm_up_runs_the_unmasked_tiled_path_where_a_batch_reaches_it(monkeypatch: pytest.MonkeyPatch, bound) -> None:
    """W1 takes the CPU's tiled path unmasked from 8 sequences with the batch bound (compute/attention.py):
    warm-up runs such a batch, so the first one served does not pay for its first call. With the bound on
    each sequence no unmasked batch of L=64 or less reaches it."""
    tiled_calls: list[tuple[int, bool, bool]] = []
    tiled = AttentionCompute._tiled

    def recorded(self: AttentionCompute, query: torch.Tensor, key_padding: object, causal: bool) -> torch.Tensor:
        tiled_calls.append((query.shape[0], key_padding is None, causal))
        return tiled(self, query, key_padding, causal)  # type: ignore[arg-type]

    monkeypatch.setattr(AttentionCompute, "_tiled", recorded)
    # 8 heads of L=64: 128 KiB of scores a sequence, so 8 to a tiled batch (L=8's: 512); not where batches
    # hold 7; 2 heads: 32 KiB, so 32 to a batch, more than warm-up computes (WARM_TILED_MAX_SEQUENCES)
    for heads, largest, unmasked in ((8, 64, [(8, True, False)]), (8, 7, []), (2, 64, [])):
        settings = ModelSettings(
            embed_dim=64,
            num_heads=heads,
            device=("cpu",),
            cpu_fused_bound=bound,
            batching=BatchingSettings(max_batch_size=largest),
        )
        spec = spec_from_settings(settings)
        w = DeviceWorker(spec, random_projections(spec, 0), torch.device("cpu"))
        tiled_calls.clear()
        try:
            w.executor.submit(w.warmup).result()
        finally:
            w.close()
        assert [c for c in tiled_calls if c[1] and not c[2]] == (unmasked if bound == "batch" else [])
        assert any(not c[1] for c in tiled_calls) and any(c[2] for c in tiled_calls)  # masked, causal


def test_torch_threads_apply_on_the_worker_thread_itself() -> None:
    # OpenMP keeps the count per calling thread: setting it elsewhere would not reach the worker.
    w = worker(torch_threads=1)
    try:
        assert w.executor.submit(torch.get_num_threads).result() == 1
    finally:
        w.close()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="OS thread names are read from Linux's /proc")
def test_the_worker_thread_and_its_openmp_threads_carry_the_workers_name() -> None:
    # top -H, ps -L and profile.sh's table tell them apart by it; otherwise all show as the process.
    def named() -> set[int]:
        return {int(t) for t in os.listdir("/proc/self/task") if _comm(t) == "attn-cpu"}

    before = named()  # other tests' workers, and their OpenMP threads, may still be ending
    w = worker(torch_threads=2)
    try:
        a = torch.randn(512, 512)
        worker_tid = w.executor.submit(threading.get_native_id).result()
        # In a fresh process torch's first thread setting on the worker may already start OpenMP's thread.
        assert worker_tid in named() - before
        w.executor.submit(torch.mm, a, a).result()  # a parallel region: OpenMP's thread exists by now
        # Every thread the worker's thread started carries its name: OpenMP's, and in a fresh process
        # whichever else torch starts there on its first call (one more, here).
        assert len(named() - before - {worker_tid}) >= 1
    finally:
        w.close()


def _comm(tid: str) -> str | None:
    try:
        with open(f"/proc/self/task/{tid}/comm") as comm:
            return comm.read().strip()
    except OSError:  # the thread ended meanwhile
        return None


def test_a_batch_report_counts_tokens_and_padding() -> None:
    w = worker()
    try:
        requests = [
            request(np.random.randn(2, 3, 16).astype(np.float32)),
            request(np.random.randn(1, 5, 16).astype(np.float32)),
        ]
        answers = w.run(requests)
    finally:
        w.close()
    report = answers[0].batch
    assert all(a.batch is report for a in answers)  # one report, shared by the batch
    assert report.requests == 2 and report.sequences == 3 and report.tokens == 2 * 3 + 5
    # Real positions: 2 x (3 + 3) + 1 x (5 + 5) = 22 of 3 x (5 + 5) = 30 padded.
    assert abs(report.padding_fraction - (1 - 22 / 30)) < 1e-9
    assert [a.output_shape for a in answers] == [(2, 3, 16), (1, 5, 16)]
    assert [output_of(a).shape for a in answers] == [(2, 3, 16), (1, 5, 16)]


def w1_spec():
    return spec_from_settings(ModelSettings(device=("cpu",)))  # W1: E=256, 8 heads


def test_length_groups_join_equal_and_tiny_lengths_and_part_far_apart_ones() -> None:
    spec = w1_spec()

    def groups(lengths: list[int]) -> list[list[int]]:
        requests = [request(np.zeros((1, n, 256), np.float32)) for n in lengths]
        found = length_groups(spec, requests)
        assert sorted(id(r) for g in found for r in g) == sorted(map(id, requests))  # each request once
        return sorted(sorted(r.query_len for r in g) for g in found)

    assert groups([64] * 16) == [[64] * 16]  # the common case: one batch
    assert groups([128, 64, 64, 1]) == [[1], [64, 64], [128]]  # padding 1 or 64 to 128 costs more than a call
    assert groups([7, 3, 1, 2]) == [[1, 2, 3, 7]]  # padding a few tokens costs less than a call
    tiny = spec_from_settings(ModelSettings(embed_dim=16, num_heads=2, device=("cpu",)))
    mixed = [request(np.zeros((1, n, 16), np.float32)) for n in (3, 50, 9)]
    # A small model's whole batch is one call's worth of work: one group, longest first.
    assert length_groups(tiny, mixed) == [[mixed[1], mixed[2], mixed[0]]]


@pytest.mark.parametrize("need_weights", [False, True])
def test_a_batch_of_far_apart_lengths_runs_in_groups_and_answers_as_each_alone(
    need_weights: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four groups, each its own padded batch, computed in one call into torch (compute/scripted.py)."""
    spec = w1_spec()
    w = DeviceWorker(spec, random_projections(spec, 0), torch.device("cpu"), CpuThreads(1))
    lengths = [128, 64, 7, 64, 1, 100, 3]
    script, calls = scripted.SCRIPTED, []
    assert script is not None

    def counted(paths, tensors, flags):
        calls.append(paths)
        return script(paths, tensors, flags)

    monkeypatch.setattr(scripted, "SCRIPTED", counted)
    try:
        queries = [np.random.randn(1, n, 256).astype(np.float32) for n in lengths]
        requests = [request(q, need_weights=need_weights) for q in queries]  # weights per head
        batch = w.run(requests)
        assert len(calls) == 1 and len(calls[0]) == 4
        alone = [w.run([r])[0] for r in requests]
        assert len(calls) == 1  # one request alone: one call anyway
    finally:
        w.close()
    for together, itself in zip(batch, alone, strict=True):
        assert together.output_shape == itself.output_shape
        np.testing.assert_allclose(output_of(together), output_of(itself), rtol=1e-4, atol=1e-5)
        if need_weights:
            n = itself.output_shape[1]
            assert together.weights_shape == itself.weights_shape == (1, 8, n, n)
            np.testing.assert_allclose(weights_of(together), weights_of(itself), rtol=1e-4, atol=1e-6)
    report = batch[0].batch
    assert report.requests == len(lengths) and report.tokens == sum(lengths)
    # Padded within its groups only: {128}, {100}, {64, 64}, {7, 3, 1} -> 128 + 100 + 128 + 21.
    assert report.padded_tokens == 377
    assert report.padding_fraction == pytest.approx(1 - 2 * sum(lengths) / (2 * 377))


def test_cross_attention_of_far_apart_key_lengths_runs_in_groups_and_answers_as_each_alone() -> None:
    spec = w1_spec()
    w = DeviceWorker(spec, random_projections(spec, 0), torch.device("cpu"), CpuThreads(1))

    def cross(query_len: int, key_len: int) -> AttentionRequest:
        kv = host_tensor(torch.randn(1, key_len, 256))  # key_value: one X' for key and value
        return AttentionRequest(host_tensor(torch.randn(1, query_len, 256)), kv, kv, None, False, True, True, False)

    shapes = [(64, 256), (8, 3), (64, 64), (1, 200), (8, 5)]
    try:
        requests = [cross(q, k) for q, k in shapes]
        assert len(length_groups(spec, requests)) > 1
        batch = w.run(requests)
        alone = [w.run([r])[0] for r in requests]
    finally:
        w.close()
    for (q, k), together, itself in zip(shapes, batch, alone, strict=True):
        assert together.output_shape == (1, q, 256) and together.weights_shape == (1, q, k)  # averaged
        np.testing.assert_allclose(output_of(together), output_of(itself), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(weights_of(together), weights_of(itself), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("weights", ["none", "per_head", "averaged"])
@pytest.mark.parametrize(
    "path", ["fused kernel", "tiled", "tiled on oneDNN", "tiled op by op", "tiled on oneDNN op by op"]
)
def test_the_fused_and_tiled_paths_match_the_explicit_path(
    causal: bool, padded: bool, weights: str, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if path.startswith("tiled") and "oneDNN" not in path:  # every CPU batch that returns no weights takes it
        monkeypatch.setattr(attention, "FUSED_CPU_MAX_SCORE_BYTES", 0)
    monkeypatch.setattr(linear, "ONEDNN_MIN_ROWS", 1)  # "on oneDNN": these 21 rows too
    spec = spec_from_settings(ModelSettings(embed_dim=16, num_heads=2, device=("cpu",)))
    params = random_projections(spec, 0)
    matmul = "onednn" if "oneDNN" in path else "aten"
    fused = AttentionCompute(
        spec, params, tiled=path != "fused kernel", cpu_matmul=matmul, scripted=not path.endswith("op by op")
    )
    explicit = AttentionCompute(spec, params, fused=False, cpu_matmul="aten")  # torch's own products
    assert fused.fused and not explicit.fused
    x = torch.randn(3, 7, 16)
    padding = (torch.arange(7)[None, :] >= torch.tensor([7, 4, 1])[:, None]) if padded else None
    need, average = weights != "none", weights == "averaged"
    with torch.inference_mode():
        y1, w1 = fused(x, None, None, padding, causal, need, average)
        y2, w2 = explicit(x, None, None, padding, causal, need, average)
    torch.testing.assert_close(y1, y2, atol=1e-5, rtol=1e-5)
    if need:
        assert w1 is not None and w2 is not None and w1.shape == w2.shape
        torch.testing.assert_close(w1, w2, atol=1e-5, rtol=1e-5)
    else:
        assert w1 is None and w2 is None


@pytest.mark.parametrize("mask", ["causal", "padded", "none (a large batch)"])
def test_a_cpu_batch_on_the_tiled_path_makes_one_call_into_torch(mask: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scripted function computes the whole batch (projections, attention, the output's projection):
    nothing of it is called from Python; with `scripted=False`, or where this torch cannot script it, the same
    answer op by op, as for one sequence alone. Either way torch.nn.MultiheadAttention's answer."""
    monkeypatch.setattr(attention, "FUSED_CPU_MAX_SCORE_BYTES", 0)  # a large batch: the tiled path
    calls = []
    script = scripted.SCRIPTED
    assert script is not None  # this torch (the project's floor and up) scripts it

    def counted(*args):
        return calls.append(args) or script(*args)

    monkeypatch.setattr(scripted, "SCRIPTED", counted)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 20, 32, generator=g)
    padding = (torch.arange(20)[None, :] >= torch.tensor([20, 9, 1])[:, None]) if mask == "padded" else None
    causal = mask == "causal"
    compute, mha = compute_and_module(6)
    op_by_op, _ = compute_and_module(6, scripted=False)
    with torch.inference_mode():
        with monkeypatch.context() as m:  # attention called from Python fails
            m.setattr(scripted.F, "scaled_dot_product_attention", None)
            y, _ = compute(x, None, None, padding, causal, False, False)
            assert len(calls) == 1
            with pytest.raises(TypeError):
                op_by_op(x, None, None, padding, causal, False, False)
        y_op_by_op, _ = op_by_op(x, None, None, padding, causal, False, False)
        attn_mask = torch.ones(20, 20, dtype=torch.bool).triu(1) if causal else None
        expected, _ = mha(x, x, x, key_padding_mask=padding, attn_mask=attn_mask, need_weights=False)
    assert len(calls) == 1  # op by op: not scripted
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(y, y_op_by_op, atol=0, rtol=0)  # the same ops, as written
    monkeypatch.setattr(scripted, "SCRIPTED", None)  # a torch that cannot script it
    fallback, _ = compute_and_module(6)
    assert not fallback.scripted
    with torch.inference_mode():
        torch.testing.assert_close(fallback(x, None, None, padding, causal, False, False)[0], y, atol=0, rtol=0)
        monkeypatch.setattr(scripted, "SCRIPTED", counted)
        one = None if padding is None else padding[1:2]
        y1, _ = compute(x[1:2], None, None, one, causal, False, False)  # one sequence: op by op
    assert len(calls) == 1
    torch.testing.assert_close(y1, y[1:2], atol=1e-5, rtol=1e-4)


def test_a_scripted_path_that_fails_where_op_by_op_computes_is_turned_off_and_said_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A torch that scripts the paths but cannot run them: the batch is computed op by op, the scripted paths
    go off for the model with one warning. A batch that fails op by op too is the batch's own failure: its
    error, and the scripted paths stay on."""
    script = scripted.SCRIPTED
    assert script is not None

    def broken(*args):
        raise RuntimeError("the interpreter cannot run this")

    monkeypatch.setattr(scripted, "SCRIPTED", broken)
    compute, mha = compute_and_module(8)
    x = torch.randn(3, 20, 32)
    with torch.inference_mode():
        with monkeypatch.context() as m:  # op by op fails too: a batch's own failure
            m.setattr(scripted, "_tiled", broken)
            with pytest.raises(RuntimeError, match="cannot run this"):
                compute(x, None, None, None, True, False, False)
        assert compute.scripted
        with caplog.at_level(logging.WARNING, logger="attnserve_server.compute.attention"):
            y, _ = compute(x, None, None, None, True, False, False)
            y2, _ = compute(x, x[:, :13], x[:, :13], None, False, False, False)  # explicit: op by op at once
        expected, _ = mha(x, x, x, attn_mask=torch.ones(20, 20, dtype=torch.bool).triu(1), need_weights=False)
        expected2, _ = mha(x, x[:, :13], x[:, :13], need_weights=False)
    assert not compute.scripted
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(y2, expected2, atol=1e-5, rtol=1e-4)
    assert caplog.text.count("a scripted attention path failed where op by op computed the batch") == 1


def test_the_scripted_call_hands_back_every_tensor_it_was_given() -> None:
    """What keeps the call from taking the GIL inside (compute/scripted.py): the list of tensors from Python
    comes back, holding each of them, so none's last reference but Python's drops inside the call."""
    assert scripted.SCRIPTED is not None
    x, w, b, wo = torch.randn(2, 5, 8), torch.randn(24, 8), torch.randn(24), torch.randn(8, 8)
    with torch.inference_mode():
        outputs, weights, given = scripted.SCRIPTED([scripted.TILED], [[x, w, b, wo, None, None]], [[2, 1, 0, 0]])
    assert outputs[0].shape == (2, 5, 8) and weights == [None]
    assert len(given) == 1 and len(given[0]) == 6
    assert all(a is b for a, b in zip(given[0], [x, w, b, wo, None, None], strict=True))


@pytest.mark.parametrize("setting", [True, False])
def test_a_cpu_worker_computes_op_by_op_where_asked_or_where_torch_cannot_script_and_says_so(
    setting: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    spec = spec_from_settings(ModelSettings(embed_dim=32, num_heads=4, device=("cpu",), cpu_scripted=setting))
    for can in (True, False):
        if not can:
            monkeypatch.setattr(scripted, "SCRIPTED", None)
            monkeypatch.setattr(scripted, "UNSCRIPTED", "RuntimeError: no TorchScript here")
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="attnserve_server.compute.worker"):
            w = DeviceWorker(spec, random_projections(spec, 0), torch.device("cpu"))
        try:
            assert w._compute.scripted == (setting and can)
            said = "length groups, compute op by op, as this torch cannot script them (RuntimeError: no TorchScript"
            assert (said in caplog.text) == (setting and not can)  # asked for and not had
        finally:
            w.close()


@pytest.mark.parametrize("inputs", ["key_value", "key and value", "bare operation", "odd heads"])
@pytest.mark.parametrize("mask", ["none", "padded", "causal"])
def test_a_cpu_batch_on_the_explicit_path_makes_one_call_into_torch(
    inputs: str, mask: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The explicit path (cross attention of other lengths, the bare operation, self attention where the fused
    kernel cannot run) computes a batch in one scripted call, with or without the weights, and the answer op by
    op gives; one sequence alone computes op by op."""
    monkeypatch.setattr(linear, "ONEDNN_MIN_ROWS", 1)  # oneDNN's products where this CPU has them
    calls = []
    script = scripted.SCRIPTED
    assert script is not None
    monkeypatch.setattr(scripted, "SCRIPTED", lambda *args: calls.append(args) or script(*args))
    heads = 3 if inputs == "odd heads" else 4  # the fused kernel takes an even count only
    kind = "sdpa" if inputs == "bare operation" else "mha"
    spec = spec_from_settings(ModelSettings(kind=kind, embed_dim=24, num_heads=heads, device=("cpu",)))
    params = None if kind == "sdpa" else random_projections(spec, 7)
    one_call = AttentionCompute(spec, params)
    op_by_op = AttentionCompute(spec, params, scripted=False)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 10, 24, generator=g)
    s = 10 if inputs == "odd heads" else 13
    key = None if inputs == "odd heads" else torch.randn(3, s, 24, generator=g)
    value = key if inputs == "key_value" else None if key is None else torch.randn(3, s, 24, generator=g)
    padding = (torch.arange(s)[None, :] >= torch.tensor([s, 5, 1])[:, None]) if mask == "padded" else None
    causal = mask == "causal"
    with torch.inference_mode():
        with monkeypatch.context() as m:  # attention called from Python fails
            m.setattr(scripted.F, "scaled_dot_product_attention", None)
            y, _ = one_call(x, key, value, padding, causal, False, False)
        expected, _ = op_by_op(x, key, value, padding, causal, False, False)
        y_w, w = one_call(x, key, value, padding, causal, True, False)  # weights per head
        expected_y_w, expected_w = op_by_op(x, key, value, padding, causal, True, False)
        assert len(calls) == 2
        one_call(
            x[:1], key if key is None else key[:1], value if value is None else value[:1], None, causal, False, False
        )
    assert len(calls) == 2
    torch.testing.assert_close(y, expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(y_w, expected_y_w, atol=0, rtol=0)
    torch.testing.assert_close(w, expected_w, atol=0, rtol=0)


def fused_batches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the batches that take torch's fused kernel from now on, in turn (each batch's plan, as
    compute/scripted.py's `run` gets it)."""
    run, batches = scripted.run, []

    def counted(plans, one_call):
        batches.extend(t[0].shape[0] for path, t, _ in plans if path == scripted.FUSED)
        return run(plans, one_call)

    monkeypatch.setattr(scripted, "run", counted)
    return batches


def compute_and_module(seed: int, **options) -> tuple[AttentionCompute, torch.nn.MultiheadAttention]:
    """A CPU model (E=32, 4 heads) of seeded random weights, and torch's module holding the same weights."""
    spec = spec_from_settings(ModelSettings(embed_dim=32, num_heads=4, device=("cpu",)))
    params = random_projections(spec, seed)
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=True).eval()
    with torch.no_grad():
        mha.in_proj_weight.copy_(params.packed)
        mha.in_proj_bias.copy_(params.packed_bias)
        mha.out_proj.weight.copy_(params.out_weight)
        mha.out_proj.bias.copy_(params.out_bias)
    return AttentionCompute(spec, params, **options), mha


@pytest.mark.parametrize("matmul", ["onednn", "aten"])
@pytest.mark.parametrize("pair", ["key_value", "key and value"])
@pytest.mark.parametrize("weights", ["none", "per_head", "averaged"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("calls", ["one call", "op by op"])
def test_cross_attention_matches_torchs_module(
    matmul: str, pair: str, weights: str, causal: bool, calls: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The explicit path, one X' for keys and values (projected by [W_K; W_V] at once) or a key and a value
    of their own, against torch.nn.MultiheadAttention, on oneDNN's products (past ONEDNN_MIN_ROWS) and torch's,
    with or without the weights: in one call into torch (compute/scripted.py) or op by op, which compute the
    same answer to the bit."""
    script = scripted.SCRIPTED
    assert script is not None
    scripted_calls = []

    def counted(*args):
        return scripted_calls.append(args) or script(*args)

    monkeypatch.setattr(scripted, "SCRIPTED", counted)
    compute, mha = compute_and_module(3, cpu_matmul=matmul, scripted=calls == "one call")
    op_by_op = AttentionCompute(compute.spec, compute.params, cpu_matmul=matmul, scripted=False)
    fused = fused_batches(monkeypatch)  # a query of another length: never the fused kernel
    g = torch.Generator().manual_seed(1)
    x, kv = torch.randn(3, 40, 32, generator=g), torch.randn(3, 70, 32, generator=g)  # 120 and 210 rows
    key, value = (kv, kv) if pair == "key_value" else (kv, torch.randn(3, 70, 32, generator=g))
    padding = torch.arange(70)[None, :] >= torch.tensor([70, 33, 1])[:, None]
    need, average = weights != "none", weights == "averaged"
    future = torch.ones(40, 70, dtype=torch.bool).triu(1) if causal else None  # query i sees keys 0..i
    with torch.inference_mode():
        y, w = compute(x, key, value, padding, causal, need, average)
        y2, w2 = op_by_op(x, key, value, padding, causal, need, average)
        expected, expected_w = mha(
            x, key, value, key_padding_mask=padding, attn_mask=future, need_weights=need, average_attn_weights=average
        )
    assert len(scripted_calls) == (1 if calls == "one call" else 0)
    assert fused == []
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(y, y2, atol=0, rtol=0)
    if need:
        assert w is not None and w2 is not None
        torch.testing.assert_close(w, expected_w, atol=1e-6, rtol=1e-4)
        torch.testing.assert_close(w, w2, atol=0, rtol=0)
    else:
        assert w is None and w2 is None
    if matmul == "onednn" and linear._onednn_ops() is not None:
        projection = compute._kv if pair == "key_value" else compute._k
        assert projection is not None and projection._packed is not None  # the product that ran was oneDNN's


@pytest.mark.parametrize("mask", ["none", "padded", "causal"])
@pytest.mark.parametrize("weights", ["none", "per_head", "averaged"])
def test_cross_attention_as_long_as_the_query_takes_the_fused_kernel_where_it_pays(
    mask: str, weights: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One X' (key_value) of the query's length: on the CPU torch's fused kernel computes it, unmasked or
    with weights, as it would self attention; a masked batch without weights takes the explicit path. Either
    way torch.nn.MultiheadAttention's answer."""
    compute, mha = compute_and_module(5)
    calls = fused_batches(monkeypatch)
    g = torch.Generator().manual_seed(2)
    x, kv = torch.randn(3, 20, 32, generator=g), torch.randn(3, 20, 32, generator=g)
    padding = (torch.arange(20)[None, :] >= torch.tensor([20, 9, 1])[:, None]) if mask == "padded" else None
    causal = mask == "causal"
    need, average = weights != "none", weights == "averaged"
    with torch.inference_mode():
        y, w = compute(x, kv, kv, padding, causal, need, average)
        attn_mask = torch.ones(20, 20, dtype=torch.bool).triu(1) if causal else None
        expected, expected_w = mha(
            x, kv, kv, key_padding_mask=padding, attn_mask=attn_mask, need_weights=need, average_attn_weights=average
        )
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-4)
    if need:
        torch.testing.assert_close(w, expected_w, atol=1e-6, rtol=1e-4)
    assert len(calls) == (1 if need or mask == "none" else 0)
    with torch.inference_mode():  # another length, or a key and a value apart: the explicit path
        compute(x, kv[:, :19], kv[:, :19], None, False, need, average)
        compute(x, kv, kv.clone(), None, False, need, average)
    assert len(calls) == (1 if need or mask == "none" else 0)


@pytest.mark.parametrize("bound", ["batch", "sequence"])
def test_cpu_batches_take_the_fused_kernel_only_while_it_pays(monkeypatch: pytest.MonkeyPatch, bound: str) -> None:
    batches = fused_batches(monkeypatch)
    spec = spec_from_settings(ModelSettings(embed_dim=256, num_heads=8, device=("cpu",)))  # W1
    compute = AttentionCompute(spec, random_projections(spec, 0), cpu_matmul="aten", fused_bound=bound)
    reference = AttentionCompute(spec, compute.params, tiled=False, cpu_matmul="aten")
    one_padded = torch.tensor([[False] * 60 + [True] * 4])
    with torch.inference_mode():
        # a sequence's scores: 128 KiB (L=64), 512 KiB (L=128), 2 MiB (L=256): the tiled path from 1 MiB
        # a batch
        for n, length in ((1, 64), (7, 64), (8, 64), (16, 64), (1, 128), (2, 128), (1, 256), (4, 256)):
            x = torch.randn(n, length, 256)
            torch.testing.assert_close(
                compute(x, None, None, None, False, False, False)[0],
                reference(x, None, None, None, False, False, False)[0],
                atol=1e-5,
                rtol=1e-5,
            )
        x = torch.randn(1, 64, 256)
        compute(x, None, None, one_padded, False, False, False)  # masked: tiled at any size
        compute(x, None, None, None, True, False, False)
        compute(torch.randn(2, 256, 256), None, None, None, False, True, True)  # weights: fused
    # the reference takes the fused kernel for every batch; the model with the batch bound up to 7 W1
    # sequences and one of L=128, with the bound on each sequence every batch of L=64 and L=128; at L=256
    # (2 MiB a sequence) only for weights
    if bound == "batch":
        assert batches == [1, 1, 7, 7, 8, 16, 1, 1, 2, 1, 4, 2]
    else:
        assert batches == [1, 1, 7, 7, 8, 8, 16, 16, 1, 1, 2, 2, 1, 4, 2]


@pytest.mark.parametrize(
    ("family", "capability", "bound", "cut"),
    [
        (("AuthenticAMD", 23), "AVX2", "batch", False),  # the Zen 2
        (("AuthenticAMD", 25), "AVX2", "sequence", False),  # the Zen 3
        (("GenuineIntel", 6), "AVX2", "sequence", False),
        (("AuthenticAMD", 25), "AVX512", "sequence", True),  # the Zen 4
        (("GenuineIntel", 6), "AVX512", "sequence", True),
        (None, "DEFAULT", "sequence", True),
    ],
)
def test_auto_bounds_the_fused_kernel_as_measured_on_each_cpu(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    family: tuple[str, int] | None,
    capability: str,
    bound: str,
    cut: bool,
) -> None:
    """`cpu_fused_bound: auto` is the batch bound where it was measured to pay (AMD family 23, the Zen 2), the
    bound on each sequence on other AVX2-only CPUs (the Zen 3) and elsewhere (AVX-512, the Zen 4) for sequences
    of under 48 M multiply-adds, with the batch bound for larger ones; a bound set explicitly stands on any CPU."""
    monkeypatch.setattr(attention, "cpu_family", lambda: family)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    spec = spec_from_settings(ModelSettings(embed_dim=256, num_heads=8, device=("cpu",)))  # W1
    params = random_projections(spec, 0)
    assert AttentionCompute(spec, params).fused_bound == bound
    assert AttentionCompute(spec, params, fused_bound="batch").fused_bound == "batch"
    assert AttentionCompute(spec, params, fused_bound="sequence").fused_bound == "sequence"
    # the fewest sequences that take the tiled path: W1 (19 M multiply-adds, 128 KiB of scores a sequence)
    # and L=128 (42 M, 512 KiB), then L=192 (69 M, 1.1 MiB), E=512's L=64 (71 M, 128 KiB) and, with 4 heads,
    # L=160 (55 M, 400 KiB)
    smallest = [
        AttentionCompute(spec, params, fused_bound=b).smallest_tiled_batch(n, 4)
        for b in ("auto", "batch", "sequence")
        for n in (64, 128, 192)
    ]
    for e, h, length in ((512, 8, 64), (256, 4, 160)):
        other = spec_from_settings(ModelSettings(embed_dim=e, num_heads=h, device=("cpu",)))
        other_params = random_projections(other, 0)
        smallest += [
            AttentionCompute(other, other_params, fused_bound=b).smallest_tiled_batch(length, 4)
            for b in ("auto", "sequence")
        ]
    auto = [8, 2, 1, 8, 3] if bound == "batch" else [None, None, 1, 8, 3] if cut else [None, None, 1, None, None]
    assert smallest == [*auto[:3], 8, 2, 1, None, None, 1, auto[3], None, auto[4], None]
    with pytest.raises(ValueError, match="fused_bound: expected one of auto, batch, sequence, got 'x'"):
        AttentionCompute(spec, params, fused_bound="x")
    # and a model's setting reaches its worker's kernels, which say at start-up what auto came to
    other = "sequence" if bound == "batch" else "batch"
    for setting, said in (
        ("auto", f"each {bound}" + (", to each batch from 48 M multiply-adds a sequence" if cut else " (")),
        (other, f"each {other} (cpu_fused_bound: {other})"),
    ):
        spec = spec_from_settings(ModelSettings(embed_dim=256, num_heads=8, device=("cpu",), cpu_fused_bound=setting))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="attnserve_server.compute.worker"):
            w = DeviceWorker(spec, random_projections(spec, 0), torch.device("cpu"))
        try:
            assert w._compute.fused_bound == (bound if setting == "auto" else other)
            assert said in caplog.text and f"(cpu_fused_bound: {setting})" in caplog.text
        finally:
            w.close()


@pytest.mark.parametrize("setting", ["auto", "onednn", "aten"])
def test_a_models_cpu_matmul_reaches_its_workers_products_which_say_what_auto_came_to(
    setting: str, caplog: pytest.LogCaptureFixture
) -> None:
    spec = spec_from_settings(ModelSettings(embed_dim=32, num_heads=4, device=("cpu",), cpu_matmul=setting))
    products = linear.resolve_cpu_matmul(setting)
    with caplog.at_level(logging.INFO, logger="attnserve_server.compute.worker"):
        w = DeviceWorker(spec, random_projections(spec, 0), torch.device("cpu"))
    try:
        assert w._compute.cpu_matmul == products
        packed = w._compute._in
        assert packed is not None
        assert packed.takes(linear.ONEDNN_MIN_ROWS) == (products == "onednn" and linear._onednn_ops() is not None)
        on = "oneDNN, weights packed once" if products == "onednn" else "torch's F.linear"
        assert f"the projections multiply on {on} (cpu_matmul: {setting})" in caplog.text
    finally:
        w.close()


def test_the_cpu_family_and_flags_are_the_first_processors_in_cpuinfo(tmp_path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 23\nmodel\t\t: 49\nflags\t\t: fpu avx2\n\n"
        "processor\t: 1\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nflags\t\t: fpu avx512f\n"
    )
    assert cpu_family(str(cpuinfo)) == ("AuthenticAMD", 23)
    assert cpu_flags(str(cpuinfo)) == {"fpu", "avx2"}
    arm = tmp_path / "arm"  # an Arm CPU's: neither field
    arm.write_text("processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd\nCPU implementer\t: 0x41\n")
    assert cpu_family(str(arm)) is None and cpu_flags(str(arm)) == frozenset()
    assert cpu_family(str(tmp_path / "absent")) is None


@pytest.mark.parametrize("bound", ["batch", "sequence"])
def test_the_fused_kernel_and_the_tiled_path_agree_with_onednn_and_torch_products(bound: str) -> None:
    """Whichever products the tiled path multiplies with, it takes over at the same length."""
    spec = spec_from_settings(ModelSettings(embed_dim=256, num_heads=8, device=("cpu",)))  # W1
    params = random_projections(spec, 0)
    onednn = AttentionCompute(spec, params, cpu_matmul="onednn", fused_bound=bound)
    aten = AttentionCompute(spec, params, cpu_matmul="aten", fused_bound=bound)
    with torch.inference_mode():
        for n, length in ((1, 64), (7, 64), (16, 64), (1, 128), (8, 128), (1, 256), (4, 256)):
            x = torch.randn(n, length, 256)
            fused = (n if bound == "batch" else 1) * 8 * length * length * 4 < 1 << 20  # scores under 1 MiB
            assert onednn._fused_pays(x, None, False, False) == aten._fused_pays(x, None, False, False) == fused
            torch.testing.assert_close(
                onednn(x, None, None, None, False, False, False)[0],
                aten(x, None, None, None, False, False, False)[0],
                atol=1e-5,
                rtol=1e-5,
            )


@pytest.mark.parametrize(
    ("most", "macs", "requests", "small", "expected"),
    [
        (2, 5_000_000, 1, SMALL_BATCH_MACS, 1),  # too small to gain from two threads even alone
        (2, 19_000_000, 1, SMALL_BATCH_MACS, 2),  # alone, one W1 sequence: every thread (measured: below)
        (2, 42_000_000, 1, SMALL_BATCH_MACS, 2),  # alone, L=128
        (2, 35_000_000, 8, SMALL_BATCH_MACS, 1),  # several requests, little work: the loop needs a core
        (2, 226_000_000, 12, SMALL_BATCH_MACS, 2),  # several requests, enough work for two
        (2, 5_000_000, 8, 0, 2),  # the rule off: every batch on every thread
        (1, 226_000_000, 12, SMALL_BATCH_MACS, 1),  # never more than configured
        (4, 1_000_000, 1, 500_000, 4),  # a floor set under the "alone" one lowers it too
    ],
)
def test_a_cpu_batch_runs_on_one_thread_when_small(most, macs, requests, small, expected) -> None:
    assert CpuThreads(None, small).for_batch(most, macs, requests) == expected


MEASURED = 226_000_000  # twelve W1 requests: several requests, enough work for two threads


def test_a_large_batch_of_several_requests_runs_on_whichever_thread_count_measures_faster() -> None:
    chooser = CpuThreads(None, SMALL_BATCH_MACS, min_speedup=1.05).chooser(2)

    def run(batches: int, seconds_by_threads: dict[int, float]) -> list[int]:
        picked = []
        for _ in range(batches):
            threads, measured = chooser.pick(MEASURED, 12)
            assert measured
            chooser.record(threads, MEASURED, seconds_by_threads[threads], 12)
            picked.append(threads)
        return picked

    # Each count is tried once first; two threads twice as fast (a host with a core to spare) keep them,
    # with a batch now and then on one thread so its time stays known: one in 1 / PROBE_BUDGET here,
    # since a probe costs a whole batch more (probes cost at most PROBE_BUDGET of the time).
    first = 2 * FIRST_SAMPLES
    idle = run(4 * PROBE_EVERY + first, {1: 0.010, 2: 0.005})
    assert idle[:first] == [2, 1] * FIRST_SAMPLES  # each tried in turn before either is trusted
    assert chooser.probe_interval(2, 1) == round(1 / PROBE_BUDGET) > PROBE_EVERY
    assert idle[first:].count(1) == (len(idle) - first) // round(1 / PROBE_BUDGET)
    # The loop gets busy: two threads now take as long as one. The probes see it and one thread takes
    # over within a few of them, then two threads are only probed.
    busy = run(8 * PROBE_EVERY, {1: 0.010, 2: 0.0105})
    assert busy[-4 * PROBE_EVERY :].count(2) == 4
    # A speedup under min_speedup is not enough to use both.
    assert run(8 * PROBE_EVERY, {1: 0.010, 2: 0.0098})[-4 * PROBE_EVERY :].count(2) == 4
    # Load eases: back to two, one thread probed every (0.010 / 0.006 - 1) / PROBE_BUDGET batches.
    eased = run(10 * PROBE_EVERY, {1: 0.010, 2: 0.006})
    interval = chooser.probe_interval(2, 1)
    assert interval == math.ceil((0.010 / 0.006 - 1) / PROBE_BUDGET)
    assert eased[-4 * interval :].count(1) == 4


def _contended(one_on_cpu: float, seconds: dict[int, float], batches: int = 8 * PROBE_EVERY) -> list[int]:
    """Batches of several: compute times by thread count, and the share of its time a one-thread batch
    ran on a CPU (the rest it waited for a core)."""
    chooser = CpuThreads(None, SMALL_BATCH_MACS, min_speedup=1.05).chooser(2)
    picked = []
    for _ in range(batches):
        threads, _measured = chooser.pick(MEASURED, 12)
        chooser.record(threads, MEASURED, seconds[threads], 12, one_on_cpu if threads == 1 else 0.6)
        picked.append(threads)
    return picked[2 * FIRST_SAMPLES :]


@pytest.mark.parametrize(
    ("one_on_cpu", "seconds", "mostly"),
    [
        # W1 at concurrency 32 (twenty-ninth pass): two threads 10% faster a batch, but one thread's
        # batches waited for a core 30% of their time: the core the second thread would take.
        (0.70, {1: 0.0086, 2: 0.0078}, 1),
        # L=256 at concurrency 32: a one-thread batch waits 12% of its time; two threads 14% faster keep it.
        (0.88, {1: 0.046, 2: 0.040}, 2),
        # WL: two threads 1.9x faster pay for the core whoever wanted it.
        (0.60, {1: 0.0165, 2: 0.0087}, 2),
    ],
)
def test_a_batch_of_several_keeps_to_one_thread_while_one_threads_batches_wait_for_a_core(
    one_on_cpu: float, seconds: dict[int, float], mostly: int
) -> None:
    later = _contended(one_on_cpu, seconds)
    assert later.count(mostly) > 0.95 * len(later)


def test_the_wait_for_a_core_is_a_recent_mean_and_lone_requests_do_not_count() -> None:
    chooser = CpuThreads(None, SMALL_BATCH_MACS, min_speedup=1.05).chooser(2)
    seconds = {1: 0.0086, 2: 0.0078}

    def run(batches: int, on_cpu: float) -> list[int]:
        picked = []
        for _ in range(batches):
            threads, _measured = chooser.pick(MEASURED, 12)
            chooser.record(threads, MEASURED, seconds[threads], 12, on_cpu)
            picked.append(threads)
        return picked

    # A quiet host: one-thread batches never wait, and two threads, 10% faster, are used.
    assert run(4 * PROBE_EVERY, 1.0)[-PROBE_EVERY:].count(2) == PROBE_EVERY - 1
    # Lone requests that wait for a core say nothing of batches of several, nor of lone requests: the
    # rule is for batches of several (a lone request's second thread wakes an idle core).
    for _ in range(50):
        threads, _measured = chooser.pick(19_000_000, 1)
        chooser.record(threads, 19_000_000, 0.0005 if threads == 1 else 0.0004, 1, 0.1)
    assert chooser.preferred() == 2 and chooser.preferred(alone=True) == 2
    # The load grows: the probes of one thread now wait 30% of their time, and within 16 probes one
    # thread takes over; then every thread is only probed, SHORT_PROBE_FACTOR times less often.
    picked = run(16 * PROBE_EVERY + 2 * SHORT_PROBE_FACTOR * PROBE_EVERY, 0.7)
    assert picked[-2 * SHORT_PROBE_FACTOR * PROBE_EVERY :].count(2) == 2
    # It eases again: one-thread batches stop waiting, and two threads are back within a few of them.
    assert run(8, 1.0)[-1] == 2


def _taught_two_threads_alone() -> ThreadChooser:
    """A chooser whose lone requests measured faster on two threads (a spell at concurrency 1)."""
    chooser = CpuThreads(None, SMALL_BATCH_MACS, min_speedup=1.05).chooser(2)
    for _ in range(2 * FIRST_SAMPLES + 10):
        threads, _measured = chooser.pick(19_000_000, 1)
        chooser.record(threads, 19_000_000, 0.0005 if threads == 1 else 0.0004, 1)
    assert chooser.preferred(alone=True) == 2
    return chooser


def test_a_lone_request_under_load_runs_on_one_thread_while_batches_of_several_are_short_of_cores() -> None:
    chooser = _taught_two_threads_alone()
    for _ in range(4 * PROBE_EVERY):  # batches of several, short of cores (W1 at concurrency 32)
        threads, _measured = chooser.pick(MEASURED, 12)
        chooser.record(threads, MEASURED, 0.0086 if threads == 1 else 0.0078, 12, 0.7)
    assert chooser.preferred() == 1
    # Lone requests between them take one thread, untimed, even those with a measured batch's work;
    # once LONE_UNDER_LOAD come in a row the server is quiet again, and a lone request chooses for itself.
    lone = [chooser.pick(MEASURED, 1) for _ in range(LONE_UNDER_LOAD)]
    assert lone[:-1] == [(1, False)] * (LONE_UNDER_LOAD - 1) and lone[-1] == (2, True)


def test_a_small_lone_request_under_load_runs_on_one_thread_whatever_it_learned_alone() -> None:
    # W1 at concurrency 4 or 8 after a spell at 1: under load its batches of several are small (one
    # thread by size, never timed), so nothing says the cores are short, and a lone request among them
    # woke the second thread on the event loop's core.
    chooser = _taught_two_threads_alone()
    assert chooser.pick(4 * 19_000_000, 4) == (1, False)  # a small batch of several
    # The lone requests that follow take one thread, untimed, as a batch of several this small would;
    # once LONE_UNDER_LOAD come in a row the server is quiet again and a lone request chooses for itself.
    lone = [chooser.pick(19_000_000, 1) for _ in range(LONE_UNDER_LOAD)]
    assert lone[:-1] == [(1, False)] * (LONE_UNDER_LOAD - 1) and lone[-1] == (2, True)
    # A lone request with a measured batch's work still chooses for itself while the cores are not short.
    assert chooser.pick(4 * 19_000_000, 4) == (1, False)
    assert chooser.pick(MEASURED, 1) == (2, True)


def test_noisy_batches_keep_the_choice_on_the_faster_thread_count() -> None:
    """W1 at concurrency 32 (twentieth pass): two threads 6% slower a batch than one, and batch times
    spread by a third. The means must not wander across min_speedup so often that the slower count
    runs much more than its probes: with a weight of 0.25 it ran ~21% of these batches (26-32% in
    the server), with WEIGHT 0.1 ~7%."""
    shares = []
    for seed in range(5):
        rng = np.random.default_rng(seed)
        chooser = CpuThreads(None, SMALL_BATCH_MACS, min_speedup=1.05).chooser(2)
        picked = []
        for _ in range(2000):
            threads, _measured = chooser.pick(MEASURED, 12)
            seconds = (0.010 if threads == 1 else 0.0106) * rng.lognormal(0.0, 0.3)
            chooser.record(threads, MEASURED, seconds, 12)
            picked.append(threads)
        shares.append(picked[200:].count(2) / 1800)
    assert statistics.mean(shares) < 0.12, shares


@pytest.mark.parametrize(
    "first",
    [
        0.015,  # a ramp-up: three times its usual time
        0.050,  # cold (a warm-up batch was): ten times; a mean of the first three would put two threads
        # above one (0.020 against 0.010) and keep the worker on one thread
    ],
)
def test_one_slow_first_batch_does_not_decide_the_thread_count(first: float) -> None:
    chooser = CpuThreads(None, SMALL_BATCH_MACS, min_speedup=1.05).chooser(2)
    two = iter([first] + [0.005] * 100)
    picked = []
    for _ in range(40):
        threads, _measured = chooser.pick(MEASURED, 12)
        chooser.record(threads, MEASURED, next(two) if threads == 2 else 0.010, 12)
        picked.append(threads)
    assert picked[: 2 * FIRST_SAMPLES] == [2, 1] * FIRST_SAMPLES
    assert chooser.preferred() == 2 and picked[2 * FIRST_SAMPLES :].count(1) == 0


def test_two_slow_batches_do_not_switch_the_thread_count_but_a_lasting_change_does() -> None:
    """WL under load (fifteenth pass): two threads 10.7 ms per G multiply-adds against one's 16.5, then two
    batches on two at three times that (a noisy neighbour)."""
    chooser = CpuThreads(None, SMALL_BATCH_MACS, min_speedup=1.05).chooser(2)

    def run(batches: int, two: float) -> list[int]:
        picked = []
        for _ in range(batches):
            threads, _measured = chooser.pick(MEASURED, 12)
            chooser.record(threads, MEASURED, two if threads == 2 else 0.0165, 12)
            picked.append(threads)
        return picked

    run(2 * FIRST_SAMPLES + 4, 0.0107)
    assert chooser.preferred() == 2
    for spike in (0.0328, 0.0253):
        assert chooser.pick(MEASURED, 12)[0] == 2
        chooser.record(2, MEASURED, spike, 12)
    assert chooser.preferred() == 2
    assert run(8, 0.0107).count(1) == 0
    # two threads now slower for good: one takes over within a few batches
    assert run(10, 0.0250)[-2:] == [1, 1]


def test_warm_up_batches_do_not_train_the_thread_choice() -> None:
    """Warm-up runs cold, at other sizes than the requests': the first served batches try each thread
    count in turn, as on a worker that never warmed up."""
    w = worker(torch_threads=2, small_batch_macs=1)  # every batch of several requests is measured
    try:
        w.executor.submit(w.warmup).result()
        batch = [request(np.random.default_rng(i).standard_normal((8, 16, 16), dtype=np.float32)) for i in range(2)]
        ran = [w.executor.submit(w.run, batch).result()[0].batch.threads for _ in range(2 * FIRST_SAMPLES)]
        assert ran == [2, 1] * FIRST_SAMPLES
    finally:
        w.close()


@pytest.mark.parametrize(
    ("rule", "most", "macs", "requests", "expected"),
    [
        (CpuThreads(), 2, 5_000_000, 1, 1),  # a lone request under the floor: one, by size
        (CpuThreads(), 2, 35_000_000, 8, 1),  # below small_batch_macs: one, by size
        (CpuThreads(), 1, MEASURED, 12, 1),  # one thread configured: nothing to choose
        (CpuThreads(None, 0), 2, MEASURED, 12, 2),  # the size rule off: every thread
        (CpuThreads(None, SMALL_BATCH_MACS, 0), 2, MEASURED, 12, 2),  # measuring off: every thread
    ],
)
def test_other_batches_are_not_measured(rule, most, macs, requests, expected) -> None:
    chooser = rule.chooser(most)
    for _ in range(3):
        assert chooser.pick(macs, requests) == (expected, False)


@pytest.mark.parametrize(
    ("one", "two", "expected"),
    [
        (0.00072, 0.00102, 1),  # W1 alone on the Intel VM, in-process: a wake of the other core at each region
        (0.00042, 0.00039, 2),  # the AMD VM of the sixth pass: 8% faster on two
        (0.00042, 0.00041, 1),  # faster on two by less than min_speedup: the cheaper choice
    ],
)
def test_a_lone_request_over_the_floor_runs_on_whichever_thread_count_measures_faster(one, two, expected) -> None:
    chooser = CpuThreads(None, SMALL_BATCH_MACS, min_speedup=1.05).chooser(2)
    picked = []
    for _ in range(2 * FIRST_SAMPLES + 4 * PROBE_EVERY):
        threads, measured = chooser.pick(19_000_000, 1)
        assert measured
        chooser.record(threads, 19_000_000, one if threads == 1 else two, 1)
        picked.append(threads)
    assert picked[: 2 * FIRST_SAMPLES] == [2, 1] * FIRST_SAMPLES
    assert chooser.preferred(alone=True) == expected
    later = picked[2 * FIRST_SAMPLES :]
    assert 1 <= later.count(3 - expected) <= 4  # the other count only probed
    # learned apart from batches of several requests, which still start by trying each count
    assert chooser.preferred() == 2 and chooser.pick(MEASURED, 12) == (2, True)
    chooser.record(2, MEASURED, 0.005, 12)
    assert chooser.pick(MEASURED, 12) == (1, True)


def test_a_time_that_is_no_time_is_not_learned() -> None:
    chooser = CpuThreads().chooser(2)
    for seconds in (0.0, -1.0, float("nan"), float("inf")):
        chooser.record(2, MEASURED, seconds, 12)
    assert chooser.pick(MEASURED, 12) == (2, True)  # still untried: each count is tried first
    assert chooser.pick(MEASURED, 12) == (2, True)


def test_the_worker_times_a_measured_batch_on_each_count_and_reports_the_threads(on_cpu_throughout) -> None:
    # The worker's thread reads as on a CPU throughout each batch: a busy machine (CI once) would
    # otherwise make one thread's batches seem to wait for a core, and a lone request then keeps to one
    # thread under load, as it should (ThreadChooser's LONE_UNDER_LOAD), not the case tested here.
    w = worker(torch_threads=2, small_batch_macs=1)  # every batch of several requests is measured
    try:
        batch = [request(np.random.default_rng(i).standard_normal((8, 16, 16), dtype=np.float32)) for i in range(2)]
        ran = [w.executor.submit(w.run, batch).result()[0].batch.threads for _ in range(3)]
        # tried on every thread, then on one; then the one measured faster (either may be, here)
        assert ran[:2] == [2, 1] and ran[2] in (1, 2)
        # a lone request, learned apart: it too is tried on every thread first
        lone = w.executor.submit(w.run, batch[:1]).result()[0].batch
        assert lone.threads == 2 and lone.requests == 1
    finally:
        w.close()


def on_cpu_shares(monkeypatch: pytest.MonkeyPatch, batches: int) -> list[float | None]:
    """Runs `batches` batches of two requests on a two-thread worker that measures every batch of several,
    and returns the on-CPU share the worker told its chooser for each."""
    seen: list[float | None] = []
    record = ThreadChooser.record

    def spy(self, threads, macs, seconds, requests, on_cpu=None):
        if requests == 2:
            seen.append(on_cpu)
        return record(self, threads, macs, seconds, requests, on_cpu)

    monkeypatch.setattr(ThreadChooser, "record", spy)
    w = worker(torch_threads=2, small_batch_macs=1)  # every batch of several requests is measured
    try:
        batch = [request(np.random.default_rng(i).standard_normal((8, 16, 16), dtype=np.float32)) for i in range(2)]
        for _ in range(batches):
            w.executor.submit(w.run, batch).result()
    finally:
        w.close()
    return seen


def test_the_worker_tells_its_chooser_what_share_of_a_batch_its_thread_ran_on_a_cpu(monkeypatch) -> None:
    several = on_cpu_shares(monkeypatch, 4)
    assert len(several) == 4 and all(on_cpu is not None and 0.0 < on_cpu <= 1.0 for on_cpu in several)


@pytest.fixture
def on_cpu_throughout(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's thread clock gains twice the wall clock's time on top of its own, so every batch's
    on-CPU share reads at least 2 before the worker clamps it, however little of the batch the thread
    spent on a CPU (three times the thread's own time alone read 0.70 once on a busy CI machine)."""
    import time as real_time

    from attnserve_server.compute import worker as worker_module

    class AheadClock:
        def __getattr__(self, name: str):
            return getattr(real_time, name)

        @staticmethod
        def thread_time() -> float:
            return real_time.thread_time() + 2.0 * real_time.perf_counter()

    monkeypatch.setattr(worker_module, "time", AheadClock())


def test_the_on_cpu_share_stays_a_share_when_the_thread_clock_runs_ahead_of_the_wall_clock(
    monkeypatch, on_cpu_throughout
) -> None:
    # The two clocks tick apart; on a short batch CI once read a share of 1.012.
    assert on_cpu_shares(monkeypatch, 2) == [1.0, 1.0]


def test_a_batchs_multiply_adds_count_projections_and_attention() -> None:
    w1 = spec_from_settings(ModelSettings(embed_dim=256, num_heads=8, device=("cpu",)))
    # one W1 sequence: Q and out (2·64·256²) + K and V (2·64·256²) + Q·Kᵀ and A·V (2·64·64·256)
    assert compute_macs(w1, 1, 64, 64) == 4 * 64 * 256**2 + 2 * 64 * 64 * 256 == 18_874_368
    assert compute_macs(w1, 12, 64, 64) == 12 * 18_874_368
    # cross attention with narrower values: V projects to embed_dim before A·V
    narrow = spec_from_settings(ModelSettings(embed_dim=256, num_heads=8, kdim=32, vdim=16, device=("cpu",)))
    assert compute_macs(narrow, 1, 64, 100) == 2 * 64 * 256**2 + 100 * (32 + 16) * 256 + 2 * 64 * 100 * 256
    # the bare operation: attention only, values as given
    bare = spec_from_settings(ModelSettings(kind="sdpa", embed_dim=256, num_heads=8, vdim=64, device=("cpu",)))
    assert compute_macs(bare, 2, 64, 100) == 2 * 64 * 100 * (256 + 64)


def test_the_worker_sets_each_batchs_threads_on_its_own_thread() -> None:
    def threads_after(w: DeviceWorker, *shapes: tuple[int, int, int]) -> int:
        batch = [request(np.random.default_rng(0).standard_normal(shape, dtype=np.float32)) for shape in shapes]
        w.executor.submit(w.run, batch).result()
        # On the worker's own thread, as the server runs batches (OpenMP counts threads per thread).
        return w.executor.submit(torch.get_num_threads).result()

    w = worker(torch_threads=2, min_speedup=0)  # by size alone: nothing measured
    try:
        # 128 sequences of L=64 at E=16: 25.2 M multiply-adds, over the floor for a request alone
        assert threads_after(w, (128, 64, 16)) == 2
        assert threads_after(w, (1, 4, 16), (1, 4, 16)) == 1  # two small requests
        assert threads_after(w, (64, 64, 16), (64, 64, 16)) == 1  # the same work as two requests
        assert threads_after(w, (128, 64, 16)) == 2  # and back
    finally:
        w.close()
    w = worker(torch_threads=2, small_batch_macs=0)
    try:
        assert threads_after(w, (1, 4, 16), (1, 4, 16)) == 2
    finally:
        w.close()


@pytest.mark.parametrize(
    ("environ", "gpu", "expected"),
    [
        ({}, False, {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "300000"}),
        ({}, True, {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "1000"}),
        ({"OMP_WAIT_POLICY": "PASSIVE"}, False, {"OMP_WAIT_POLICY": "PASSIVE"}),
        ({"GOMP_SPINCOUNT": "50000"}, True, {"GOMP_SPINCOUNT": "50000"}),
    ],
)
def test_openmp_spins_long_on_the_cpu_briefly_beside_a_gpu_unless_the_operator_chose(environ, gpu, expected) -> None:
    in_effect = openmp.set_defaults(environ, gpu=gpu)
    assert environ == expected
    assert in_effect == ", ".join(f"{k}={v}" for k, v in expected.items())


def test_the_command_line_and_the_runtime_settings_load_before_torch() -> None:
    # libgomp and glibc read their environment once, when torch loads: `serve` sets them first
    # (cli.py), so nothing it imports up to then may import torch.
    modules = [
        "cli",
        "runtime.openmp",
        "runtime.allocator",
        "runtime.pyheap",
        "runtime.eventloop",
        "runtime.idle_spin",
        "runtime.cpu_layout",
        "runtime.os_threads",
    ]
    imports = "".join(f"import attnserve_server.{m}\n" for m in modules)
    code = f"import sys\n{imports}print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize(
    ("devices", "environ", "driver", "expected"),
    [
        (["cpu"], {}, True, False),
        (["auto"], {}, False, False),
        (["auto"], {}, True, True),
        (["auto"], {"CUDA_VISIBLE_DEVICES": ""}, True, False),
        (["auto"], {"CUDA_VISIBLE_DEVICES": "-1"}, True, False),
        (["auto"], {"CUDA_VISIBLE_DEVICES": "0"}, True, True),
        (["cpu", "cuda:1"], {}, False, True),  # asked for: refused later if missing (devices.py)
    ],
)
def test_a_model_may_use_a_gpu_where_asked_for_or_auto_finds_a_driver(devices, environ, driver, expected, tmp_path):
    node = tmp_path / "nvidiactl"
    if driver:
        node.touch()
    assert openmp.uses_gpu(devices, environ, nvidia=node) is expected


# Where a 96 MiB array's memory comes from, allocated on the main thread and on another one (as the
# device worker's): "[heap]" once malloc stops using mmap and keeps every thread on the main arena;
# an anonymous mapping of its own otherwise (glibc's threshold adapts up to 32 MiB at most, and a
# thread's own arena serves what its 64 MiB heaps cannot hold with mmap, whatever M_MMAP_MAX says).
_WHERE_96_MIB = """
import os, sys, threading
if sys.argv[1] == "tuned":
    from attnserve_server.runtime import allocator
    allocator.set_defaults(os.environ)
import numpy as np

def where(found):
    a = np.ones(12 << 20)
    address = a.ctypes.data
    for line in open("/proc/self/maps"):
        span, *rest = line.split()
        low, high = (int(x, 16) for x in span.split("-"))
        if low <= address < high:
            found.append(rest[-1] if len(rest) == 5 else "anonymous")

found = []
where(found)
worker = threading.Thread(target=where, args=(found,))
worker.start()
worker.join()
print(*found, os.environ.get("MALLOC_MMAP_MAX_"), os.environ.get("MALLOC_ARENA_MAX"))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_the_server_keeps_large_buffers_in_its_heap_for_the_next_batch() -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "LD_PRELOAD"}
    clean.pop("GLIBC_TUNABLES", None)

    def where(mode: str) -> list[str]:
        run = subprocess.run([sys.executable, "-c", _WHERE_96_MIB, mode], env=clean, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        return run.stdout.split()

    # mmap'd, and unmapped again when freed, on the main thread and on a worker thread
    assert where("default") == ["anonymous", "anonymous", "None", "None"]
    # From the heap on both, and the processes it starts (edge processes) inherit the setting.
    assert where("tuned") == ["[heap]", "[heap]", "0", "1"]


@pytest.mark.parametrize(
    ("environ", "chosen"),
    [
        ({"MALLOC_ARENA_MAX": "2"}, "MALLOC_ARENA_MAX"),
        ({"GLIBC_TUNABLES": "glibc.malloc.mmap_max=0"}, "GLIBC_TUNABLES"),
        ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, "LD_PRELOAD"),
    ],
)
def test_the_operators_own_malloc_settings_win(environ, chosen) -> None:
    before = dict(environ)
    assert allocator.set_defaults(environ) == f"left as set ({chosen})"
    assert environ == before


_SETTLE = """
import gc, weakref
from attnserve_server.runtime import pyheap
class Node: pass
kept = Node(); kept.cycle = kept  # what startup keeps
garbage = Node(); garbage.cycle = garbage  # what startup leaves
dead = weakref.ref(garbage); del garbage
print(pyheap.settle())
# the garbage collected; what is kept left out of every later collection; young collections rarer
print(dead() is None, any(o is kept for o in gc.get_objects()), gc.get_threshold()[0])
"""


def test_settling_the_heap_collects_startup_garbage_and_freezes_the_rest() -> None:
    # In a process of its own: freezing is for the process's life.
    run = subprocess.run([sys.executable, "-c", _SETTLE], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    said, checks = run.stdout.splitlines()
    assert said.endswith(f"startup objects frozen, young threshold {pyheap.YOUNG_THRESHOLD}")
    assert int(said.split()[0]) > 1000
    assert checks.split() == ["True", "False", str(pyheap.YOUNG_THRESHOLD)]


def test_a_cpu_worker_has_one_lane_no_pinned_memory_and_ignores_cuda_graphs() -> None:
    spec = spec_from_settings(ModelSettings(embed_dim=16, num_heads=2, device=("cpu",), cuda_graphs=True))
    w = DeviceWorker(spec, random_projections(spec, 0), torch.device("cpu"))
    try:
        assert w.lanes == 1 and w.pinned_bytes() == 0
        w.warmup()  # no graph is made on the CPU
        q = np.ones((2, 5, 16), np.float32)
        assert output_of(w.executor.submit(w.run, [request(q)]).result()[0]).shape == (2, 5, 16)
    finally:
        w.close()


def test_the_thread_that_loads_the_model_is_gone_once_it_serves() -> None:
    # A thread that ran a torch parallel region (loading, converting the weights to bf16) keeps an
    # OpenMP pool while it lives, and a pool beside the worker's doubles a small batch's time
    # (scripts/omp_pools.py): torch may stay only on the workers' own threads.
    settings = ModelSettings(embed_dim=16, num_heads=2, device=("cpu",), dtype="bfloat16")
    builders: list[threading.Thread] = []

    def factory(*args) -> DeviceWorker:
        builders.append(threading.current_thread())
        return DeviceWorker(*args)

    model = ServedModel(settings, Metrics(CollectorRegistry()).for_model(settings.name), factory)

    async def main() -> None:
        await model.load()
        try:
            assert builders and builders[0] is not threading.current_thread()
            assert not builders[0].is_alive()
        finally:
            model.close()

    asyncio.run(main())


def _lone_and_batched(settings: ModelSettings, make) -> tuple:
    """(the request's answer alone, its answer in a batch with a second request of its shape): a lone CPU
    request takes the worker's path without packing or splitting, a batch the padded batch path."""
    spec = spec_from_settings(settings)
    params = None if settings.kind == "sdpa" else random_projections(spec, 0)
    w = DeviceWorker(spec, params, torch.device("cpu"), CpuThreads(1))
    try:
        first, second = make(spec, 0), make(spec, 1)
        return w.run([first])[0], w.run([first, second])[0]
    finally:
        w.close()


def _rand(b: int, t: int, d: int, dtype: torch.dtype, seed: int) -> HostTensor:
    return host_tensor(torch.randn(b, t, d, generator=torch.Generator().manual_seed(seed)).to(dtype))


@pytest.mark.parametrize(
    "case",
    [
        "self, padded keys, weights per head",
        "self, causal, three sequences",
        "cross, key and value apart, weights averaged",
        "cross, one X' for key and value",
        "bare operation, padded keys",
        "self, bfloat16",
    ],
)
def test_a_lone_request_answers_as_it_would_in_a_batch(case: str) -> None:
    kind = "sdpa" if case.startswith("bare") else "mha"
    cross = not case.startswith("self")
    dtype = torch.bfloat16 if "bfloat16" in case else torch.float32
    settings = ModelSettings(
        embed_dim=16, num_heads=2, kind=kind, kdim=12 if cross and kind == "mha" else None,
        vdim=(12 if "one X'" in case else 8) if cross else None,
        dtype=str(dtype).removeprefix("torch."), device=("cpu",),
    )  # fmt: skip
    b = 3 if "three" in case else 2
    length, keys = 5, 7 if cross else 5

    def make(spec, seed: int) -> AttentionRequest:
        query = _rand(b, length, spec.embed_dim, dtype, seed)
        key = value = None
        if cross:
            key = _rand(b, keys, spec.kdim, dtype, seed + 10)
            value = key if "one X'" in case else _rand(b, keys, spec.vdim, dtype, seed + 20)
        padding = None
        if "padded" in case:
            padding = np.zeros((b, keys), np.bool_)
            padding[0, -2:] = True
        weights = "weights" in case
        return AttentionRequest(query, key, value, padding, "causal" in case, weights, "averaged" in case, False)

    alone, batched = _lone_and_batched(settings, make)
    assert alone.output_shape == batched.output_shape
    assert alone.weights_shape == batched.weights_shape
    storage = "<i2" if dtype == torch.bfloat16 else "<f4"

    def floats(raw: bytes | memoryview | None, shape) -> np.ndarray:
        values = torch.from_numpy(np.frombuffer(raw, dtype=storage).copy())  # type: ignore[arg-type]
        return (values.view(torch.bfloat16) if dtype == torch.bfloat16 else values).float().reshape(shape).numpy()

    tolerance = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-5}
    output = floats(alone.output, alone.output_shape)
    np.testing.assert_allclose(output, floats(batched.output, batched.output_shape), **tolerance)
    if "weights" in case:
        per_head = "per head" in case
        assert alone.weights_shape == ((b, 2, length, keys) if per_head else (b, length, keys))
        weights = floats(alone.weights, alone.weights_shape)
        np.testing.assert_allclose(weights, floats(batched.weights, batched.weights_shape), **tolerance)
    else:
        assert alone.weights is None
    report = alone.batch
    assert (report.requests, report.sequences, report.tokens, report.padded_tokens) == (1, b, b * length, b * length)
    assert report.padding_fraction == 0.0
    assert report.compute_s >= report.infer_s > 0 and report.input_s >= 0 and report.output_s >= 0


@pytest.mark.parametrize("usable", [True, False])
def test_a_failed_batch_leaves_the_worker_lost_only_when_its_cuda_device_no_longer_computes(
    monkeypatch: pytest.MonkeyPatch, usable: bool
) -> None:
    # The mapping, on the CPU: a worker whose device cannot compute any more (the probe, which
    # tests/test_cuda.py runs on a real GPU with a poisoned context) raises WorkerLost; else the error.
    w = worker()
    monkeypatch.setattr(w, "_cuda", True)
    monkeypatch.setattr(w, "_device_usable", lambda: usable)

    def fails(requests):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(w, "_run", fails)
    with pytest.raises(Exception) as err:  # which one it is, is the point
        w.run([request(np.ones((1, 3, 16), np.float32))])
    if usable:
        assert type(err.value) is RuntimeError
    else:
        assert isinstance(err.value, WorkerLost) and err.value.status == "UNAVAILABLE"
        assert "cpu can compute no more: RuntimeError: CUDA error: an illegal memory access" in str(err.value)


def test_a_cpu_worker_is_never_lost_for_a_failed_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    w = worker()
    monkeypatch.setattr(w, "_run", lambda requests: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        w.run([request(np.ones((1, 3, 16), np.float32))])


def test_a_batch_out_of_device_memory_is_resource_exhausted_and_leaves_the_worker_serving(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    w = worker()
    monkeypatch.setattr(w, "_cuda", True)  # no probe for it: out of memory leaves the device usable
    monkeypatch.setattr(w, "_device_usable", lambda: pytest.fail("probed the device after out of memory"))

    def out_of_memory(requests):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")

    monkeypatch.setattr(w, "_run", out_of_memory)
    with pytest.raises(DeviceOutOfMemory) as err:
        w.run([request(np.ones((2, 3, 16), np.float32))])
    assert err.value.status == "RESOURCE_EXHAUSTED"
    assert str(err.value) == (
        "cpu ran out of memory for a batch of 1 request(s), 2 sequence(s): "
        "CUDA out of memory. Tried to allocate 2.00 GiB"
    )
