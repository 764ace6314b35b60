"""A benchmark's results: one row per server and concurrency, as a table and as a plot."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field, replace


@dataclass
class Row:
    server: str
    concurrency: int
    requests: int
    errors: int
    throughput_rps: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_batch: float
    inprocess_rps: float | None = None
    inprocess_batch: int | None = None
    ratio: float | None = None
    error_samples: list[str] = field(default_factory=list)
    rounds: int = 1  # a row of medians: how many rounds it summarises
    round: int | None = None  # a row of one round: which (from 1)


def medians(rows: list[Row]) -> list[Row]:
    """One row per server and concurrency, in first-seen order: the median of each measured figure
    over that row's rounds. The ratio is the median of each round's own ratio (its throughput over the
    limit measured beside it), not the ratio of two medians: a round's pair shares the machine's mood.
    Requests and errors are totals."""
    groups: dict[tuple[str, int], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.server, r.concurrency), []).append(r)
    out = []
    for own in groups.values():
        if len(own) == 1:
            out.append(replace(own[0], round=None))
            continue

        def median(name: str, own: list[Row] = own) -> float | None:
            values = [getattr(r, name) for r in own if getattr(r, name) is not None]
            return float(statistics.median(values)) if values else None

        batches = Counter(r.inprocess_batch for r in own if r.inprocess_batch is not None)
        out.append(
            Row(
                server=own[0].server,
                concurrency=own[0].concurrency,
                requests=sum(r.requests for r in own),
                errors=sum(r.errors for r in own),
                throughput_rps=median("throughput_rps") or 0.0,
                p50_ms=median("p50_ms") or 0.0,
                p90_ms=median("p90_ms") or 0.0,
                p99_ms=median("p99_ms") or 0.0,
                mean_batch=median("mean_batch") or 0.0,
                inprocess_rps=median("inprocess_rps"),
                inprocess_batch=batches.most_common(1)[0][0] if batches else None,
                ratio=median("ratio"),
                error_samples=sorted({e for r in own for e in r.error_samples})[:3],
                rounds=len(own),
            )
        )
    return out


def table(rows: list[Row]) -> str:
    head = (
        f"{'server':<26} {'conc':>5} {'req/s':>9} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} "
        f"{'batch':>6} {'in-proc req/s':>14} {'ratio':>6} {'errors':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        inproc = f"{r.inprocess_rps:.1f} @{r.inprocess_batch}" if r.inprocess_rps else "-"
        ratio = f"{r.ratio:.2f}" if r.ratio is not None else "-"
        lines.append(
            f"{r.server:<26} {r.concurrency:>5} {r.throughput_rps:>9.1f} {r.p50_ms:>8.3f} {r.p90_ms:>8.3f} "
            f"{r.p99_ms:>8.3f} {r.mean_batch:>6.1f} {inproc:>14} {ratio:>6} {r.errors:>6}"
        )
    return "\n".join(lines)


def plot(rows: list[Row], path: str, title: str) -> None:
    """Throughput against p50 and p99 latency, one line per server or configuration, a point per
    concurrency level (labelled), written to `path` (the format from its suffix)."""
    import matplotlib

    matplotlib.use("Agg")  # no display
    import matplotlib.pyplot as plt

    servers = list(dict.fromkeys(r.server for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharex=True)
    for ax, name, key in ((axes[0], "p50", "p50_ms"), (axes[1], "p99", "p99_ms")):
        for server in servers:
            own = sorted((r for r in rows if r.server == server), key=lambda r: r.concurrency)
            xs, ys = [r.throughput_rps for r in own], [getattr(r, key) for r in own]
            ax.plot(xs, ys, marker="o", label=server)
            for r, x, y in zip(own, xs, ys, strict=True):
                ax.annotate(f"c={r.concurrency}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set_xlabel("throughput (requests/s)")
        ax.set_ylabel(f"{name} latency (ms)")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.set_title(f"{name} latency against throughput")
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
