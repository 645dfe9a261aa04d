"""``python -m jaxcomm.bench``: the options, the run, and what rank 0 prints and writes.

:func:`parser` and :func:`run_and_report` are shared with the source
checkout's benchmarks that measure routes of their own (``benchmarks/compare.py``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
from mpi4py import MPI

from ..comm import JaxComm
from . import quiet
from .measure import Record, run
from .operations import MODES, OPS
from .report import metadata, summary, table, write_json
from .routes import PLAIN, REFERENCE, Impl, JaxcommImpl, Mpi4pyImpl, PlainJitImpl
from .routes.c_floor import FLOOR, CFloorImpl, load_floor
from .sizes import DEFAULT_SIZES, MIB, QUICK_SIZES, parse_size, sizes_between


def _names(choices: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [name.strip() for name in text.split(",") if name.strip()]
        unknown = [name for name in names if name not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(unknown) or 'empty list'}; choose from {', '.join(choices)}"
            )
        return names

    return parse


def parser(description: str) -> argparse.ArgumentParser:
    """The options of ``python -m jaxcomm.bench``, shared with ``benchmarks/compare.py``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--ops",
        type=_names(tuple(OPS)),
        default=list(OPS),
        help="comma-separated ops (default: all): " + ",".join(OPS),
    )
    p.add_argument(
        "--modes",
        type=_names(MODES),
        default=list(MODES),
        help="comma-separated modes (default: jit,loop,eager)",
    )
    p.add_argument(
        "--sizes",
        type=lambda t: [parse_size(s) for s in t.split(",")],
        help="comma-separated message sizes, e.g. 8,4K,1MiB (default: 8 B to 64 MiB)",
    )
    p.add_argument("--min-size", type=parse_size, help="smallest size (with --max-size)")
    p.add_argument("--max-size", type=parse_size, help="largest size (with --min-size)")
    p.add_argument("--repeats", type=int, help="timed repeats per measurement (default 5)")
    p.add_argument(
        "--time", type=float, dest="target_s", help="seconds one repeat should take (default 0.02)"
    )
    p.add_argument("--max-iters", type=int, default=100_000, help="most ops in one repeat")
    p.add_argument(
        "--quick",
        action="store_true",
        help="two sizes (8 B, 1 MiB), 3 short repeats: a smoke test for CI",
    )
    p.add_argument(
        "--no-floor", action="store_true", help="leave out the C floor (the MPI calls from C)"
    )
    p.add_argument("--json", metavar="FILE", help="write records and versions as JSON")
    p.add_argument("--markdown", action="store_true", help="print a Markdown table")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """:func:`run`'s keyword arguments from parsed options."""
    if args.sizes:
        sizes = args.sizes
    elif args.min_size or args.max_size:
        sizes = sizes_between(args.min_size or 8, args.max_size or 64 * MIB)
    else:
        sizes = QUICK_SIZES if args.quick else DEFAULT_SIZES
    return {
        "ops": args.ops,
        "sizes": list(sizes),
        "modes": args.modes,
        "repeats": args.repeats or (3 if args.quick else 5),
        "target_s": args.target_s or (0.002 if args.quick else 0.02),
        "max_iters": args.max_iters,
        "progress": not args.no_progress,
    }


def run_and_report(
    comm: MPI.Intracomm,
    impls: Sequence[Impl],
    args: argparse.Namespace,
    *,
    ratios: Sequence[tuple[str, str]],
    bandwidth: Sequence[str],
    title: str,
    **meta: Any,
) -> list[Record]:
    """Measure with the parsed options; on rank 0 print the table and write JSON.

    Args:
        comm: the communicator (every rank calls this).
        impls: implementations, :class:`Mpi4pyImpl` first; the table shows
            each one's time.
        args: options from :func:`parser`.
        ratios, bandwidth: the table's columns (see :func:`table`).
        title: the table's title.
        **meta: extra entries for the JSON's ``meta``.

    Returns:
        The records.
    """
    options = settings(args)
    watch = quiet.Watch(comm)
    records = run(comm, impls, **options)
    hosts = watch.finish()
    meta = metadata(
        comm, options={k: v for k, v in options.items() if k != "progress"}, quiet=hosts, **meta
    )
    if comm.rank == 0:
        print(
            f"# {title}: {comm.size} ranks, jax {jax.__version__}, {meta['cpu']}, "
            f"MPI thread level {meta['thread_level']}"
        )
        print("# times: microseconds per op, median of repeats (slowest rank); ratios of times")
        names = [impl.name for impl in impls]
        print(table(records, names, ratios, bandwidth, markdown=args.markdown))
        print(summary(records, ratios))
        for line in quiet.lines(hosts):
            print(line)
        if args.json:
            write_json(args.json, records, meta)
        sys.stdout.flush()
    return records


def floor_routes(
    comm: MPI.Intracomm, args: argparse.Namespace, notes: dict[str, str]
) -> list[Impl]:
    """The C floor, unless ``--no-floor``; without it, why in ``notes``."""
    if args.no_floor:
        return []
    lib, error = load_floor(comm)
    if lib is None:
        notes[FLOOR] = f"the C floor is skipped: {error}"
        return []
    return [CFloorImpl(comm, lib)]


def floor_ratios(names: Sequence[str]) -> list[tuple[str, str]]:
    """Every route's time over the C floor's, where the floor is measured."""
    if FLOOR not in names:
        return []
    return [(name, FLOOR) for name in names if name not in (FLOOR, PLAIN)]


def print_notes(comm: MPI.Intracomm, notes: dict[str, str]) -> None:
    """On rank 0, one ``#`` line per route left out and why."""
    if comm.rank == 0:
        for name, note in notes.items():
            print(f"# {name}: {note}")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m jaxcomm.bench``: measure, then print on rank 0."""
    p = parser("Latency and bandwidth of jaxcomm's ops beside mpi4py.")
    p.add_argument(
        "--again",
        action="store_true",
        help="also time mpi4py and jaxcomm a second time, as columns of their own: "
        "how far each moves against itself is the run's noise",
    )
    args = p.parse_args(argv)
    comm = MPI.COMM_WORLD
    settings(args)  # a bad option fails before anything is measured
    notes: dict[str, str] = {}
    jc = JaxComm(comm)
    reference, mine = Mpi4pyImpl(comm), JaxcommImpl(jc)
    impls = [reference, mine, PlainJitImpl(comm.size), *floor_routes(comm, args, notes)]
    twins = [reference.again(), mine.again()] if args.again else []
    impls += twins
    print_notes(comm, notes)
    names = [impl.name for impl in impls]
    twin_names = [twin.name for twin in twins]
    ratios = [("jaxcomm", REFERENCE), ("jaxcomm", PLAIN)]
    ratios += [(twin.name, first.name) for twin, first in zip(twins, (reference, mine))]
    ratios += floor_ratios([name for name in names if name not in twin_names])
    try:
        run_and_report(
            comm,
            impls,
            args,
            ratios=ratios,
            bandwidth=("jaxcomm", REFERENCE),
            title="jaxcomm.bench",
            notes=notes,
        )
    finally:
        jc.free()
    return 0
