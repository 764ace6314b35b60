"""A benchmark's results: one row per server and concurrency, as a table and as a plot."""

from __future__ import annotations

from dataclasses import dataclass, field


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
