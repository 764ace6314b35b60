"""scripts/batch_stats.py: a batch size's cost under load, read from a real server's KServe statistics."""

from __future__ import annotations

import importlib.util
import socket
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np

from attnserve import Client

from conftest import model, running, settings

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("batch_stats", ROOT / "scripts" / "batch_stats.py")
batch_stats = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(batch_stats)  # type: ignore[union-attr]


def test_the_window_holds_only_the_batches_run_between_its_two_snapshots() -> None:
    rng = np.random.default_rng(0)
    with running(settings(model("m", embed_dim=32, num_heads=4))) as server, Client(server.target) as client:
        client.attend(rng.standard_normal((8, 32), dtype=np.float32), model="m")  # before the window
        before = batch_stats.snapshot(server.target, "m")
        client.attend(rng.standard_normal((3, 8, 32), dtype=np.float32), model="m")  # one request, 3 sequences
        client.attend(rng.standard_normal((3, 8, 32), dtype=np.float32), model="m")
        client.attend(rng.standard_normal((8, 32), dtype=np.float32), model="m")
        after = batch_stats.snapshot(server.target, "m")
    rows = batch_stats.diff(before, after)
    assert [(r["batch"], r["executions"]) for r in rows] == [(1, 1), (3, 2)]
    for r in rows:
        assert r["compute_infer"] > 0 and r["compute_input"] >= 0 and r["compute_output"] >= 0
    text = batch_stats.table(rows)
    assert "| all: mean 2.3 | 3 |" in text  # 7 sequences in 3 executions
    # sizes run fewer times than asked are left to the total, which says so
    assert "| 1 | 1 |" not in batch_stats.table(rows, min_batches=2) and "in the total only" in batch_stats.table(
        rows, min_batches=2
    )


def test_a_server_without_statistics_gives_an_empty_snapshot_and_diff_says_so(tmp_path, capsys) -> None:
    # a gRPC server with no KServe v2 service, as the peers' minimal servers: ModelStatistics is UNIMPLEMENTED
    bare = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = bare.add_insecure_port("127.0.0.1:0")
    bare.start()
    try:
        assert batch_stats.snapshot(f"127.0.0.1:{port}", "m", timeout_s=5) == {}
    finally:
        bare.stop(None)
    err = capsys.readouterr().err
    assert "no statistics from" in err and "UNIMPLEMENTED" in err
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]  # nothing listens there once closed
    assert batch_stats.snapshot(f"127.0.0.1:{closed}", "m", timeout_s=5) == {}
    assert "UNAVAILABLE" in capsys.readouterr().err
    (tmp_path / "a.json").write_text("{}")
    (tmp_path / "b.json").write_text("{}")
    assert batch_stats.main(["diff", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    assert "gave no batch statistics" in capsys.readouterr().out
    assert batch_stats.table([]) == "no batch ran in the window"
