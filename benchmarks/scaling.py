"""Scaling: ``python -m jaxcomm.bench`` at 1, 2, 4 and 8 ranks, one mpiexec launch each.

Run:  python -m benchmarks.scaling [--ranks 1,2,4,8] [--json FILE] [--plot FILE.png]

Not under mpiexec: it starts ``mpiexec -n N python -m jaxcomm.bench`` for
each rank count N (with the launcher beside this Python, else the one on
``PATH``), for allreduce, allgather, alltoall, the ragged exchange (a
migration step: counts computed in the step, then alltoallv) and the halo exchange
``sendrecv`` (each rank with its ring neighbours), and gathers their records.
A rank count above the cores this process may run on is oversubscribed: the
ranks take turns on the cores, and their times say more about the scheduler
than about MPI. Such runs are marked ``*`` in the table, ``oversubscribed``
in the JSON and shaded in the plot. Options after ``--`` go to every
``jaxcomm.bench`` run (``-- --no-floor``).

Rank 0 of no run prints anything here: this process prints one table, time
per op against the rank count, for each op, size, mode and route.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxcomm.bench.operations import DTYPE, OPS, input_shape
from jaxcomm.bench.report import dump_json, format_table
from jaxcomm.bench.routes import PLAIN
from jaxcomm.bench.sizes import KIB, MIB, QUICK_SIZES, format_size, parse_size

from .plots import pyplot, save_figure

RANKS = (1, 2, 4, 8)
SCALING_OPS = ("allreduce", "allgather", "alltoall", "ragged", "sendrecv")
SIZES = (8, 4 * KIB, 256 * KIB, 4 * MIB)
MODES = ("jit", "loop")
# The launcher's variables: a run started from a process that mpiexec started
# would join that job instead of starting its own.
# Set in each process a launcher starts (MPICH's Hydra, Open MPI's PRRTE, PMIx
# launchers such as srun). Prefixes alone would also catch settings such as
# OMPI_MCA_* or MPIR_CVAR_*, which the launches below must keep.
LAUNCHED_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MPI_LOCALRANKID")


def cores() -> int:
    """The cores this process may run on (its affinity, else the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _mpiexec() -> str:
    """The ``mpiexec`` beside this Python, else the one on ``PATH``.

    Raises:
        RuntimeError: if there is none.
    """
    found = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
    if found is None:
        raise RuntimeError("no mpiexec beside this Python or on PATH")
    return found


def launcher_vendor() -> str:
    """ "MPICH" or "Open MPI", from the launcher's ``--version`` (without starting MPI here).

    Raises:
        RuntimeError: if there is no ``mpiexec``.
    """
    version = subprocess.run([_mpiexec(), "--version"], capture_output=True, text=True).stdout
    return "Open MPI" if "Open MPI" in version or "open-mpi" in version else "MPICH"


def launcher(ranks: int) -> list[str]:
    """``mpiexec -n ranks``, the one beside this Python first; Open MPI may oversubscribe.

    Raises:
        RuntimeError: if there is no ``mpiexec``.
    """
    # MPICH's launcher runs more ranks than cores by default, Open MPI's refuses.
    extra = ["--oversubscribe"] if launcher_vendor() == "Open MPI" else []
    return [_mpiexec(), *extra, "-n", str(ranks)]


def rank_list(text: str) -> list[int]:
    """``"1,2,4"`` as ``[1, 2, 4]`` (the ``--ranks`` option)."""
    return [int(n) for n in text.split(",")]


def bench_run(
    ranks: int, options: Sequence[str], timeout: float, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """One ``jaxcomm.bench`` launch (``env``: variables to add): its JSON, or ``{"error": why}``."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "bench.json")
        command = [
            *launcher(ranks),
            sys.executable,
            "-m",
            "jaxcomm.bench",
            "--no-progress",
            *options,
            "--json",
            path,
        ]
        try:
            done = subprocess.run(
                command,
                capture_output=True,
                text=True,
                timeout=timeout,
                env=None if env is None else {**os.environ, **env},
                # Outside the source tree, whose jaxcomm has no compiled kernels.
                cwd=folder,
            )
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        if done.returncode or not os.path.exists(path):
            tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
            return {"error": f"exit status {done.returncode}: " + " | ".join(tail)}
        with open(path) as f:
            data = json.load(f)
    return data


def message_size(record: dict[str, Any], sizes: Sequence[int]) -> int:
    """The requested size a record measured.

    A split input (alltoall) has a block per rank, at least one element, so
    at small sizes its bytes grow with the rank count: 8 B is 16 B on 4 ranks.
    """
    op = OPS[record["op"]]
    if not op.sized:
        return 0
    for size in sizes:
        if (
            int(np.prod(input_shape(op, size, record["ranks"]))) * DTYPE.itemsize
            == record["nbytes"]
        ):
            return size
    return record["nbytes"]


def _shown(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    # The plain reference does no MPI: nothing of it scales with ranks.
    return [r for r in records if r["impl"] != PLAIN]


def scaling_table(records: Sequence[dict[str, Any]], ranks: Sequence[int], busy: set[int]) -> str:
    """Microseconds per op, one row per op, size, mode and route, a column per rank count."""
    rows: dict[tuple[str, int, str, str], dict[int, float | None]] = {}
    for r in _shown(records):
        rows.setdefault((r["op"], r["message"], r["mode"], r["impl"]), {})[r["ranks"]] = r["time_s"]
    header = ["op", "size", "mode", "route"]
    header += [f"{n} rank{'s' if n > 1 else ''}{'*' if n in busy else ''} us" for n in ranks]
    lines = []
    for (op, nbytes, mode, impl), times in rows.items():
        cells = [op, format_size(nbytes), mode, impl]
        cells += ["" if times.get(n) is None else f"{times[n] * 1e6:.3g}" for n in ranks]
        lines.append(cells)
    return format_table(header, lines, left=4)


def plot_scaling(path: str, records: Sequence[dict[str, Any]], busy: set[int], title: str) -> None:
    """Time per op against the rank count, a panel per op and mode, a line per size and route.

    Raises:
        RuntimeError: if matplotlib is not installed.
    """
    plt = pyplot()
    timed = [r for r in _shown(records) if r["time_s"] is not None]
    ops = list(dict.fromkeys(r["op"] for r in timed))
    modes = list(dict.fromkeys(r["mode"] for r in timed))
    sizes = sorted({r["message"] for r in timed})
    ranks = sorted({r["ranks"] for r in timed})
    impls = list(dict.fromkeys(r["impl"] for r in timed))
    styles = ["-", "--", ":", "-."]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, axes = plt.subplots(
        max(1, len(modes)),
        max(1, len(ops)),
        figsize=(4.5 * len(ops), 3.6 * len(modes)),
        squeeze=False,
    )
    for row, mode in enumerate(modes):
        for col, op in enumerate(ops):
            ax = axes[row][col]
            for i, nbytes in enumerate(sizes):
                for j, impl in enumerate(impls):
                    points = sorted(
                        (r["ranks"], r["time_s"] * 1e6)
                        for r in timed
                        if (r["op"], r["mode"], r["message"], r["impl"]) == (op, mode, nbytes, impl)
                    )
                    if points:
                        xs, ys = zip(*points)
                        ax.plot(
                            xs,
                            ys,
                            styles[j % len(styles)],
                            marker=".",
                            color=colors[i % len(colors)],
                            label=f"{impl} {format_size(nbytes)}",
                        )
            if busy:
                ax.axvspan(min(busy) / 1.4, max(busy) * 1.4, color="grey", alpha=0.15, lw=0)
                ax.text(
                    min(busy),
                    1,
                    "oversubscribed",
                    transform=ax.get_xaxis_transform(),
                    va="top",
                    fontsize="small",
                )
            ax.set_xscale("log", base=2)
            ax.set_xticks(ranks, [str(n) for n in ranks])
            ax.set_yscale("log")
            ax.set_title(f"{op}, {mode}")
            ax.set_xlabel("ranks")
            ax.set_ylabel("us per op")
            ax.grid(True, which="both", alpha=0.3)
    save_figure(plt, fig, axes[0][0], title, path)


def measure(
    ranks: Sequence[int],
    options: Sequence[str],
    sizes: Sequence[int],
    timeout: float,
    env: dict[str, str] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``jaxcomm.bench`` with ``options`` at each rank count: the records and one entry per run.

    Each record gets its requested size (``message``) and ``oversubscribed``;
    a run that fails is reported on stdout and in its entry (``error``), and
    the others go on.
    """
    available = cores()
    records, runs = [], []
    for n in ranks:
        busy = n > available
        label = f"{n} ranks" + (f", oversubscribed ({available} cores)" if busy else "")
        print(f"# {label}: mpiexec -n {n} python -m jaxcomm.bench", flush=True)
        data = bench_run(n, options, timeout, env)
        run = {"ranks": n, "oversubscribed": busy}
        if "error" in data:
            print(f"# {n} ranks: failed, {data['error']}", flush=True)
            runs.append({**run, "error": data["error"]})
            continue
        for name, note in data["meta"].get("notes", {}).items():
            print(f"# {n} ranks: {name}: {note}", flush=True)
        runs.append({**run, "meta": data["meta"]})
        records += [
            {**r, "message": message_size(r, sizes), "oversubscribed": busy}
            for r in data["records"]
        ]
    return records, runs


def parser() -> argparse.ArgumentParser:
    """The options; those after ``--`` go to every ``jaxcomm.bench`` run."""
    p = argparse.ArgumentParser(description="jaxcomm.bench at 1, 2, 4 and 8 ranks.")
    p.add_argument(
        "--ranks",
        type=rank_list,
        default=list(RANKS),
        help="comma-separated rank counts (default 1,2,4,8)",
    )
    p.add_argument(
        "--ops", default=",".join(SCALING_OPS), help="ops (default: " + ",".join(SCALING_OPS) + ")"
    )
    p.add_argument(
        "--sizes",
        type=lambda t: [parse_size(s) for s in t.split(",")],
        help="message sizes (default 8,4K,256K,4M; --quick: 8,1M)",
    )
    p.add_argument("--modes", default=",".join(MODES), help="modes (default jit,loop)")
    p.add_argument("--quick", action="store_true", help="short repeats (jaxcomm.bench --quick)")
    p.add_argument(
        "--timeout", type=float, default=1800, help="seconds one launch may take (default 1800)"
    )
    p.add_argument("--json", metavar="FILE", help="write every run's records and meta as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="plot time against ranks (needs matplotlib)")
    p.add_argument("bench_options", nargs=argparse.REMAINDER, help="-- then jaxcomm.bench options")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the bench at each rank count, print the table, write JSON and the plot."""
    args = parser().parse_args(argv)
    if any(name in os.environ for name in LAUNCHED_VARS):
        raise SystemExit("run benchmarks.scaling without mpiexec: it starts mpiexec itself")
    if args.plot:
        try:
            pyplot()
        except RuntimeError as err:
            raise SystemExit(str(err)) from None
    sizes = args.sizes or (QUICK_SIZES if args.quick else SIZES)
    extra = [o for o in args.bench_options if o != "--"]
    options = ["--ops", args.ops, "--modes", args.modes]
    options += ["--sizes", ",".join(str(n) for n in sizes)]
    options += ["--quick"] if args.quick else []
    available = cores()
    busy = {n for n in args.ranks if n > available}
    records, runs = measure(args.ranks, [*options, *extra], sizes, args.timeout)
    print(f"# benchmarks.scaling: {available} cores; * = oversubscribed (more ranks than cores)")
    print("# times: microseconds per op, median of repeats (slowest rank)")
    print(scaling_table(records, args.ranks, busy))
    title = f"benchmarks.scaling, {available} cores (shaded: oversubscribed)"
    if args.json:
        meta = {"ranks": args.ranks, "cores": available, "oversubscribed": sorted(busy)}
        dump_json(args.json, {"meta": {**meta, "runs": runs}, "records": records})
    if args.plot:
        plot_scaling(args.plot, records, busy, title)
    failed = [run for run in runs if "error" in run]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
