"""Plots of benchmark records, to PNG files (matplotlib, drawing without a display)."""

from __future__ import annotations

from collections.abc import Sequence

from jaxcomm.bench.measure import Record
from jaxcomm.bench.operations import OPS

_NO_MATPLOTLIB = "--plot needs matplotlib: pip install matplotlib (or 'jaxcomm[bench]')"


def pyplot():
    """matplotlib's pyplot, drawing to files (no display).

    Raises:
        RuntimeError: if matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError(_NO_MATPLOTLIB) from None
    return plt


def plot(path: str, records: Sequence[Record], title: str) -> None:
    """Time per op against message size, one panel per op, to a PNG.

    Raises:
        RuntimeError: if matplotlib is not installed.
    """
    plt = pyplot()
    timed = [r for r in records if r.time_s is not None and OPS[r.op].sized]
    ops = list(dict.fromkeys(r.op for r in timed))
    impls = list(dict.fromkeys(r.impl for r in timed))
    styles = {"jit": "-", "loop": "--", "eager": ":"}
    cols = max(1, min(3, len(ops)))
    rows = max(1, -(-len(ops) // cols))
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, op in zip(axes.flat, ops):
        for i, impl in enumerate(impls):
            for mode, style in styles.items():
                points = sorted(
                    (r.nbytes, r.time_s * 1e6)
                    for r in timed
                    if r.op == op and r.impl == impl and r.mode == mode
                )
                if points:
                    xs, ys = zip(*points)
                    ax.plot(
                        xs,
                        ys,
                        style,
                        marker=".",
                        color=colors[i % len(colors)],
                        label=f"{impl} {mode}",
                    )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(op)
        ax.set_xlabel("bytes per rank")
        ax.set_ylabel("us per op")
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(ops) :]:
        ax.axis("off")
    save_figure(plt, fig, axes.flat[0], title, path)


def save_figure(plt, fig, legend_from, title: str, path: str) -> None:
    """``fig`` with ``title`` and the legend of the panel ``legend_from`` to a PNG, then closed."""
    fig.suptitle(title)
    fig.tight_layout()
    # Right of the panels, so it hides none of them; "tight" widens the image.
    fig.legend(
        *legend_from.get_legend_handles_labels(),
        loc="center left",
        bbox_to_anchor=(1.0, 0.5),
        fontsize="small",
    )
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
