"""Many ranks in one job: a smoke run of every op family, with memory and start-up costs.

Run:  python -m benchmarks.ranks [--ranks 1,2,4,8,16,32,64] [--json FILE] [--no-check]

Not under mpiexec: it starts ``mpiexec -n N python -m benchmarks.ranks
--worker`` for each rank count N (as ``benchmarks.scaling`` does; rank
counts above the cores are oversubscribed) and prints one table. Each job
creates a ``JaxComm``, splits it, runs one jitted step that calls every
collective family, a ring of ``sendrecv``, a ragged exchange and a barrier,
checks every result against NumPy on every rank, and reports:

- the time from the process's start to jaxcomm's import (Python, jax, MPI's
  initialisation), and to create the ``JaxComm`` (slowest rank);
- each rank's peak resident memory (``VmHWM``; largest and median rank), and
  at the end its private (``RssAnon``), shared (``RssShmem``: MPI's
  shared-memory segments) and file-backed (``RssFile``: the libraries' code)
  resident memory (largest rank);
- the memory XLA plans for one call of ``gather`` and ``scatter`` of 4 MiB per
  rank (``compiled.memory_analysis()``, temporaries plus outputs, on root and
  off root), where the program uses the gathered result on root only and
  builds the scattered array inside the jitted function. Off root both stay
  at what that rank sends or receives, whatever the rank count.

The mismatch checker (``JAXCOMM_CHECK=1``) is on unless ``--no-check``. The
job fails (exit status 1) when any result is wrong on any rank.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from jaxcomm.bench.report import dump_json, format_table

from . import ROOT
from .scaling import LAUNCHED_VARS, cores, launcher

RANKS = (1, 2, 4, 8, 16, 32, 64)
MEMORY_BYTES = 4 * 2**20


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _process_age_s() -> float:
    """Seconds since this process started (Linux): Python, jax, MPI and jaxcomm start-up."""
    with open("/proc/self/stat") as f:
        started = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
    with open("/proc/uptime") as f:
        return float(f.read().split()[0]) - started


def _ragged_pattern(rank: int, size: int):
    """Rows rank ``s`` sends rank ``d``: ``(s + d) % 3``, laid out in rank order at both ends."""
    sends = [(rank + d) % 3 for d in range(size)]
    recvs = [(s + rank) % 3 for s in range(size)]
    input_offsets = [sum(sends[:d]) for d in range(size)]
    # Where this rank's block lands in rank d's output: after the blocks of
    # the ranks below this one.
    output_offsets = [sum((s + d) % 3 for s in range(rank)) for d in range(size)]
    return sends, recvs, input_offsets, output_offsets


def _expected(rank: int, size: int):
    import numpy as np

    r = np.arange(size, dtype=np.float64)
    pieces = [s * 1000.0 + rank * 10.0 + np.arange((s + rank) % 3) for s in range(size)]
    ragged = np.zeros(2 * size)
    got = np.concatenate(pieces) if pieces else np.zeros(0)
    ragged[: got.size] = got
    return {
        "allreduce": np.full(3, r.sum()),
        "reduce": np.full(3, r.sum() if rank == 0 else 0.0),
        "scan": np.full(3, r[: rank + 1].sum()),
        "bcast": np.full(3, float(size - 1)),
        "allgather": np.repeat(r[:, None], 3, axis=1),
        "gather": np.repeat(r[:, None], 3, axis=1) * (rank == 0),
        "scatter": np.full(3, float(rank)),
        "alltoall": r * size + rank,
        "allgatherv": np.repeat(r, [s % 3 for s in range(size)]),
        "sendrecv": np.full(3, float((rank - 1) % size)),
        "ragged": ragged,
        "split_allreduce": np.full(3, float(sum(s for s in range(size) if s % 2 == rank % 2))),
    }


def worker(check: bool) -> dict[str, Any] | None:
    """One job's work on every rank; rank 0 returns the job's record."""
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import numpy as np
    from mpi4py import MPI

    from jaxcomm import JaxComm

    world = MPI.COMM_WORLD
    imported = _process_age_s()
    world.Barrier()
    start = time.perf_counter()
    jc = JaxComm(world)
    created = time.perf_counter() - start
    rank, size = jc.rank, jc.size
    half = jc.split(color=rank % 2, key=rank)
    sends, recvs, input_offsets, output_offsets = _ragged_pattern(rank, size)
    operand = np.concatenate(
        [rank * 1000.0 + d * 10.0 + np.arange(sends[d]) for d in range(size)] or [np.zeros(0)]
    )
    indices = [np.asarray(v, np.int64) for v in (input_offsets, sends, output_offsets, recvs)]

    @jax.jit
    def step(x, operand, indices):
        row = jnp.full(3, x)
        return {
            "allreduce": jc.allreduce(row),
            "reduce": jc.reduce(row, root=0),
            "scan": jc.scan(row),
            "bcast": jc.bcast(row, root=size - 1),
            "allgather": jc.allgather(row),
            "gather": jc.gather(row, root=0),
            "scatter": jc.scatter(jnp.arange(size, dtype=row.dtype)[:, None] + 0 * row, root=0),
            "alltoall": jc.alltoall(x * size + jnp.arange(size, dtype=row.dtype)),
            "allgatherv": jc.allgatherv(jnp.full(rank % 3, x), counts=[s % 3 for s in range(size)]),
            "sendrecv": jc.sendrecv(row, row, source=(rank - 1) % size, dest=(rank + 1) % size),
            "ragged": jc.ragged_all_to_all(operand, jnp.zeros(2 * size), *indices),
            "split_allreduce": half.allreduce(row),
        }

    start = time.perf_counter()
    results = jax.block_until_ready(step(float(rank), operand, indices))
    first_step = time.perf_counter() - start
    jc.barrier()
    expected = _expected(rank, size)
    wrong = sorted(k for k, v in expected.items() if not np.array_equal(np.asarray(results[k]), v))

    x = jnp.zeros(MEMORY_BYTES // 8)
    planned = {}
    for name, fn in (
        ("gather", lambda x: jc.gather(x, root=0).sum()),
        ("scatter", lambda x: jc.scatter(jnp.broadcast_to(x + 1.0, (size, *x.shape)), root=0)),
    ):
        analysis = jax.jit(fn).lower(x).compile().memory_analysis()
        planned[name] = (analysis.temp_size_in_bytes + analysis.output_size_in_bytes) / 2**20

    record = {
        "rank": rank,
        "wrong": wrong,
        "imported_s": imported,
        "created_s": created,
        "first_step_s": first_step,
        "peak_mib": _status_mib("VmHWM"),
        "anon_mib": _status_mib("RssAnon"),
        "shmem_mib": _status_mib("RssShmem"),
        "file_mib": _status_mib("RssFile"),
        "planned_mib": planned,
    }
    records = world.gather(record, root=0)
    half.free()
    jc.free()
    if rank != 0:
        return None
    off_root = [r for r in records if r["rank"] != 0] or records
    peaks = sorted(r["peak_mib"] for r in records)
    return {
        "ranks": size,
        "checked": check,
        "wrong": sorted({f"{k} on rank {r['rank']}" for r in records for k in r["wrong"]}),
        "import_s": max(r["imported_s"] for r in records),
        "create_s": max(r["created_s"] for r in records),
        "first_step_s": max(r["first_step_s"] for r in records),
        "peak_mib_max": peaks[-1],
        "peak_mib_median": peaks[len(peaks) // 2],
        "anon_mib_max": max(r["anon_mib"] for r in records),
        "shmem_mib_max": max(r["shmem_mib"] for r in records),
        "file_mib_max": max(r["file_mib"] for r in records),
        "gather_root_mib": records[0]["planned_mib"]["gather"],
        "gather_off_root_mib": max(r["planned_mib"]["gather"] for r in off_root),
        "scatter_root_mib": records[0]["planned_mib"]["scatter"],
        "scatter_off_root_mib": max(r["planned_mib"]["scatter"] for r in off_root),
    }


def run_job(ranks: int, check: bool, timeout: float) -> dict[str, Any]:
    """One ``mpiexec -n ranks`` job: its record, or ``{"ranks": n, "error": why}``."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHED_VARS}
    env["JAXCOMM_CHECK"] = "1" if check else "0"
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "job.json")
        command = [*launcher(ranks), sys.executable, "-m", "benchmarks.ranks", "--worker", path]
        command += [] if check else ["--no-check"]
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
            )
        except subprocess.TimeoutExpired:
            return {"ranks": ranks, "error": f"timed out after {timeout:.0f} s"}
        if done.returncode or not os.path.exists(path):
            tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
            return {"ranks": ranks, "error": f"exit status {done.returncode}: " + " | ".join(tail)}
        with open(path) as f:
            return json.load(f)


def table(jobs: Sequence[dict[str, Any]], available: int) -> str:
    """The jobs as one table, a row per rank count."""
    header = [
        "ranks",
        "results",
        "start-up s",
        "JaxComm s",
        "1st step s",
        "peak MiB max",
        "median",
        "anon",
        "shared",
        "file",
        "gather MiB root",
        "off root",
        "scatter MiB root",
        "off root",
    ]
    rows = []
    for job in jobs:
        name = f"{job['ranks']}" + ("*" if job["ranks"] > available else "")
        if "error" in job:
            rows.append([name, "FAILED: " + job["error"], *[""] * (len(header) - 2)])
            continue
        rows.append(
            [
                name,
                "right" if not job["wrong"] else "WRONG: " + ", ".join(job["wrong"]),
                f"{job['import_s']:.1f}",
                f"{job['create_s']:.3f}",
                f"{job['first_step_s']:.1f}",
                f"{job['peak_mib_max']:.0f}",
                f"{job['peak_mib_median']:.0f}",
                f"{job['anon_mib_max']:.0f}",
                f"{job['shmem_mib_max']:.0f}",
                f"{job['file_mib_max']:.0f}",
                f"{job['gather_root_mib']:.1f}",
                f"{job['gather_off_root_mib']:.1f}",
                f"{job['scatter_root_mib']:.1f}",
                f"{job['scatter_off_root_mib']:.1f}",
            ]
        )
    return format_table(header, rows, left=2)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.ranks", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--ranks", default=",".join(map(str, RANKS)), help="rank counts, comma-separated"
    )
    p.add_argument("--no-check", action="store_true", help="leave the mismatch checker off")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per job")
    p.add_argument("--json", help="write every job's record to this file")
    p.add_argument("--worker", metavar="FILE", help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the jobs (or, with ``--worker``, one job's share) and print the table."""
    args = parser().parse_args(argv)
    if args.worker:
        record = worker(not args.no_check)
        if record is not None:
            with open(args.worker, "w") as f:
                json.dump(record, f)
            return 1 if record["wrong"] else 0
        return 0
    if any(name in os.environ for name in LAUNCHED_VARS):
        raise SystemExit("run benchmarks.ranks without mpiexec: it starts mpiexec itself")
    ranks = [int(n) for n in args.ranks.split(",")]
    available = cores()
    jobs = []
    for n in ranks:
        print(f"# mpiexec -n {n} python -m benchmarks.ranks --worker", flush=True)
        jobs.append(run_job(n, not args.no_check, args.timeout))
    print(
        f"# benchmarks.ranks: {available} cores; * = oversubscribed; checker "
        + ("off" if args.no_check else "on")
    )
    print(
        "# peak: VmHWM per rank; anon, shared, file: RssAnon, RssShmem, RssFile at the end;"
        " gather/scatter: XLA's planned memory for one 4 MiB call"
    )
    print(table(jobs, available))
    if args.json:
        dump_json(args.json, {"meta": {"cores": available}, "jobs": jobs})
    return 1 if any("error" in j or j["wrong"] for j in jobs) else 0


if __name__ == "__main__":
    sys.exit(main())
