"""Reports: the table printer, the summary, the run's metadata and JSON.

The commands that print tables (``jaxcomm.bench``, and the source checkout's
``benchmarks/``) print them with :func:`format_table` and write JSON with
:func:`dump_json`.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import socket
import sys
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from mpi4py import MPI

from .. import __version__, _malloc, _runtime
from .measure import Record
from .operations import MODES, OPS
from .routes.base import AGAIN
from .sizes import format_size


def format_table(
    header: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    markdown: bool = False,
    left: int = 1,
) -> str:
    """Rows of cells as a table with a header line.

    Args:
        header: the column names.
        rows: the rows, one string per column.
        markdown: a Markdown table instead of aligned text.
        left: how many leading columns are aligned left in text (the others
            right, as numbers).

    Returns:
        The table, one line per row.
    """
    if markdown:
        out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        out += ["| " + " | ".join(line) + " |" for line in rows]
        return "\n".join(out)
    lines = [list(header), *rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            cell.ljust(w) if i < left else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(line, widths))
        )
        for line in lines
    )


def _format_time(seconds: float) -> str:
    us = seconds * 1e6
    return f"{us:.3g}" if us < 1000 else f"{us:.0f}"


def _format_bandwidth(bps: float | None) -> str:
    if bps is None:
        return ""
    mbps = bps / 1e6
    return f"{mbps:.0f}" if mbps >= 1000 else f"{mbps:.3g}"


def _by_measurement(records: Sequence[Record]) -> dict[tuple[str, int, str], dict[str, Record]]:
    """The records by (op, size, mode), then by route, in the order measured."""
    rows: dict[tuple[str, int, str], dict[str, Record]] = {}
    for record in records:
        rows.setdefault((record.op, record.nbytes, record.mode), {})[record.impl] = record
    return rows


def _call_seconds(record: Record | None) -> float | None:
    """A record's whole-call seconds per op, or None where it has no (trustworthy) time."""
    if record is None or record.match is False or record.time_s is None:
        return None
    return record.time_s if record.call_s is None else record.call_s


def table(
    records: Sequence[Record],
    impls: Sequence[str],
    ratios: Sequence[tuple[str, str]],
    bandwidth: Sequence[str] = (),
    *,
    markdown: bool = False,
) -> str:
    """Records as a table: one row per op, size and mode.

    Args:
        records: from :func:`run`.
        impls: implementations to show times of (microseconds per op).
        ratios: ``(a, b)`` pairs to show ``a``'s time over ``b``'s.
        bandwidth: implementations to show MB/s of.
        markdown: a Markdown table instead of aligned text.

    Returns:
        The table, with a header line. After the times and ratios, the same
        as whole calls (``call``: :attr:`Record.call_s`), which differ from
        them in loop mode only.
    """
    rows = _by_measurement(records)

    def time_cell(record):
        if record is None:
            return ""
        if record.match is False:
            return "WRONG"
        return "error" if record.time_s is None else _format_time(record.time_s)

    header = ["op", "size", "mode"]
    header += [f"{name} us" for name in impls]
    header += [f"{a}/{b}" for a, b in ratios]
    header += [f"{name} call us" for name in impls]
    header += [f"{a}/{b} call" for a, b in ratios]
    header += [f"{name} MB/s" for name in bandwidth]
    lines = []
    for (op, nbytes, mode), by_impl in rows.items():
        line = [op, format_size(nbytes) if OPS[op].sized else "-", mode]
        line += [time_cell(by_impl.get(name)) for name in impls]
        for a, b in ratios:
            ratio = by_impl[a].ratios.get(b) if a in by_impl else None
            line.append("" if ratio is None else f"{ratio:.2f}")
        calls = {name: _call_seconds(by_impl.get(name)) for name in (*impls, *sum(ratios, ()))}
        line += ["" if calls[name] is None else _format_time(calls[name]) for name in impls]
        for a, b in ratios:
            known = calls[a] is not None and calls[b] is not None
            line.append(f"{calls[a] / calls[b]:.2f}" if known else "")
        line += [
            _format_bandwidth(by_impl[name].bandwidth) if name in by_impl else ""
            for name in bandwidth
        ]
        lines.append(line)
    return format_table(header, lines, markdown=markdown, left=3)


# The large-message goal: from 64 KiB, jaxcomm within 1.1x of mpi4py on
# preallocated buffers in a loop, and of mpi4py plus a plain jitted function
# of the same output in a jitted call (no cost beyond what MPI and JAX charge).
GOAL_FROM_BYTES = 64 * 1024
GOAL_RATIO = 1.1


def _goal_misses_by_measurement(
    records: Sequence[Record], mine: str, reference: str
) -> dict[str, str]:
    """``"<op> <size> <mode>"`` to how far ``mine`` missed the goal, for each miss."""
    misses = {}
    for (op, nbytes, mode), row in _by_measurement(records).items():
        timed, against = row.get(mine), row.get(reference)
        if (
            nbytes < GOAL_FROM_BYTES
            or mode not in ("loop", "jit")
            or timed is None
            or against is None
        ):
            continue
        if timed.time_s is None or against.time_s is None:
            continue
        budget, what = against.time_s, reference
        if mode == "jit":
            plain = row.get("plain")
            if plain is None or plain.time_s is None:
                continue
            budget, what = budget + plain.time_s, f"{reference} + plain"
        if timed.time_s > GOAL_RATIO * budget:
            misses[f"{op} {format_size(nbytes)} {mode}"] = (
                f"{mine} {timed.time_s / budget:.2f}x {what}"
            )
    return misses


def goal_misses(
    records: Sequence[Record], mine: str = "jaxcomm", reference: str = "mpi4py"
) -> list[str]:
    """The measurements from 64 KiB that miss the large-message goal, one line each.

    Args:
        records: from :func:`~jaxcomm.bench.measure.run`.
        mine, reference: the routes held to the goal and timed against
            (``--again``'s twins give a second check from the same run).
    """
    misses = _goal_misses_by_measurement(records, mine, reference)
    return [f"{where}: {how}" for where, how in misses.items()]


def run_noise(records: Sequence[Record]) -> list[str]:
    """How far each route timed twice (``--again``) moved against itself, from 64 KiB.

    One line per route and mode: the median and range of ``"<name> again"``'s
    time over ``<name>``'s, and how many measurements lie beyond the goal's
    1.1x either way. Two columns of the same code in one run differ by this
    much, so a ratio between routes is resolved only beyond it.
    """
    suffix = f" {AGAIN}"
    by_row = _by_measurement(records)
    ratios: dict[tuple[str, str], list[float]] = {}
    for (_, nbytes, mode), row in by_row.items():
        for name, twin in row.items():
            first = row.get(name[: -len(suffix)]) if name.endswith(suffix) else None
            if nbytes < GOAL_FROM_BYTES or first is None:
                continue
            if twin.time_s is not None and first.time_s is not None:
                ratios.setdefault((first.impl, mode), []).append(twin.time_s / first.time_s)
    lines = []
    for (name, mode), values in ratios.items():
        beyond = sum(not 1 / GOAL_RATIO <= v <= GOAL_RATIO for v in values)
        lines.append(
            f"{name}{suffix}/{name} {mode:<5}: median {np.median(values):.2f}, range "
            f"{min(values):.2f}-{max(values):.2f}, {beyond} of {len(values)} beyond "
            f"{GOAL_RATIO}x either way"
        )
    return lines


def summary(records: Sequence[Record], ratios: Sequence[tuple[str, str]]) -> str:
    """Per mode and ratio, the median and range over every op and size."""
    lines = []
    for a, b in ratios:
        for mode in MODES:
            values = [
                r.ratios[b] for r in records if r.impl == a and r.mode == mode and b in r.ratios
            ]
            if values:
                lines.append(
                    f"{a}/{b} {mode:<5}: median {np.median(values):.2f}, "
                    f"range {min(values):.2f}-{max(values):.2f} over {len(values)} op sizes"
                )
    wrong = sorted({f"{r.impl} {r.op} {r.mode}" for r in records if r.match is False})
    errors = sorted({f"{r.impl} {r.op} {r.mode}: {r.error}" for r in records if r.error})
    first = _goal_misses_by_measurement(records, "jaxcomm", "mpi4py")
    if first:
        lines.append(
            f"missing the large-message goal (from {format_size(GOAL_FROM_BYTES)}: "
            f"within {GOAL_RATIO}x of mpi4py in a loop, of mpi4py + plain in a jitted call):"
        )
        lines += [f"  {where}: {how}" for where, how in first.items()]
    noise = run_noise(records)
    if noise:
        lines.append("the run's own noise: each route timed twice (--again), from 64 KiB:")
        lines += [f"  {line}" for line in noise]
        again = _goal_misses_by_measurement(records, f"jaxcomm {AGAIN}", f"mpi4py {AGAIN}")
        lines.append(
            f"the goal checked again on the twins (jaxcomm {AGAIN} against mpi4py {AGAIN}): "
            f"{len(again)} missing"
        )
        lines += [f"  {where}: {how}" for where, how in again.items()]
        both = [where for where in first if where in again]
        lines.append(f"missing in both checks: {', '.join(both) or 'none'}")
    lines += [f"WRONG RESULT (not timed): {w}" for w in wrong]
    lines += [f"not timed: {e}" for e in errors]
    return "\n".join(lines)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


THREAD_LEVELS = {
    MPI.THREAD_SINGLE: "single",
    MPI.THREAD_FUNNELED: "funneled",
    MPI.THREAD_SERIALIZED: "serialized",
    MPI.THREAD_MULTIPLE: "multiple",
}


def metadata(comm: MPI.Intracomm, **extra: Any) -> dict[str, Any]:
    """The run's machine, versions and rank count, for the JSON output."""
    import jaxlib
    import mpi4py

    versions = {
        "jaxcomm": __version__,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "mpi4py": mpi4py.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "mpi_standard": "{}.{}".format(*MPI.Get_version()),
        "mpi_library": _runtime.library_line(),
    }
    if "mpi4jax" in sys.modules:
        versions["mpi4jax"] = sys.modules["mpi4jax"].__version__
    hosts = sorted(set(comm.allgather(socket.gethostname())))
    return {
        "ranks": comm.size,
        "hosts": hosts,
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        # MPICH's small collectives depend on it (docs/sharp-bits.md).
        "thread_level": THREAD_LEVELS.get(MPI.Query_thread(), str(MPI.Query_thread())),
        "platform": platform.platform(),
        # Other work on the machine shows in the figures: say how busy it was.
        "load_average": list(os.getloadavg()),
        # Where large results are placed, which sets what they cost (docs/sharp-bits.md).
        "malloc": _malloc.in_effect(_runtime.malloc_pad),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions,
        **extra,
    }


def dump_json(path: str, data: dict[str, Any]) -> None:
    """``data`` to ``path`` as JSON, one level per line's indent, ending with a newline."""
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


def write_json(path: str, records: Sequence[Record], meta: dict[str, Any]) -> None:
    """``{"meta": ..., "records": [...]}`` to ``path``."""
    dump_json(path, {"meta": meta, "records": [dataclasses.asdict(r) for r in records]})
