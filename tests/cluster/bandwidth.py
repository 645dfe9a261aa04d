"""Large messages and halo exchanges between the hosts of tests/cluster/cluster.sh, links rate-limited.

Run from the root namespace with the ``mpich`` wheel's venv active, once
``cluster.sh up 2`` has run (``iperf3`` installed to check the links)::

    python tests/cluster/bandwidth.py                       # 1 and 10 Gbit/s
    python tests/cluster/bandwidth.py --rates 1gbit --parts bench,halo

For each rate, both ends of every host's link get a token-bucket filter
(``tc qdisc ... tbf``): the host's ``eth0`` limits what it sends, its veth
on the bridge what it receives, as a full-duplex link of that rate would.
Then, one rank per host under ``srun``:

- ``link``: ``iperf3`` from node1 to node2, 3 s: the TCP goodput the link
  gives (and without a limit first: what the veths reach on this machine).
- ``bench``: ``python -m jaxcomm.bench`` in loop mode for allreduce, bcast,
  sendrecv, allgather and alltoall at 8 B and 1 to 64 MiB: mpi4py, jaxcomm
  and the C floor (the same MPI calls from C).
- ``overlap``: ``benchmarks.overlap`` (a ring message and an allreduce at 16
  and 64 MiB beside a computation of about their duration: blocking,
  nonblocking, ``jc.during``), without and with MPICH's progress thread.
- ``halo``: ``examples/shallow_water.py --overlap --benchmark`` on a grid
  whose halo rows are large (blocking and overlapped time per step), and the
  same block on one rank (no network: the computation alone).

Beside the measurements, the cost model of ``benchmarks/model.py`` (Hockney:
a latency ``a`` plus ``n b`` per message, per round of MPICH's algorithm),
given the link: ``b`` from the link's rate (what TCP carries of it: 1448
bytes of payload per 1514-byte frame at MTU 1500; iperf3's goodput where
that is less), ``a`` the C floor's fastest 8-byte ``sendrecv`` across the
hosts, ``g`` (the reduction's cost per byte)
from ``benchmarks.model --ranks 1,2`` on one host (``--fit`` reads its
``--json`` file instead). Rank 0's outputs and a Markdown report are
printed; ``--json`` keeps everything.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))
# The cost model's module imports jaxcomm, hence mpi4py: this launcher is no
# MPI process (and jaxcomm's abort hook stays idle without MPI).
import mpi4py  # noqa: E402

mpi4py.rc.initialize = False
import multihost  # noqa: E402 - the sibling module, found through the path above

from benchmarks.model import Transport, allreduce_time, halo_time  # noqa: E402

LINK_OPS = ("allreduce", "bcast", "sendrecv", "allgather", "alltoall")
SIZES = ("8", "1M", "4M", "16M", "64M")
PARTS = ("link", "bench", "overlap", "halo")
MIB = 1 << 20
# TCP payload per Ethernet frame at MTU 1500 (with TCP timestamps), over the
# frame's length as tbf counts it (the 14-byte Ethernet header included).
PAYLOAD_SHARE = 1448 / 1514
# Halo grid: 2 ranks split the rows, so a halo is one row of 3 fields; wide
# rows make it large beside the block's update.
HALO_CELLS = (64, 131072)
HALO_STEPS = 20
# Ops in a call from which the bench's loop time (its difference method) is taken.
MANY = 100
# One compute thread per rank (2 ranks and their progress threads share 2 cores).
ONE_THREAD = {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"}


def parse_rate(text: str) -> float:
    """``"1gbit"`` or ``"500mbit"`` in bits per second."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg])bit", text.strip().lower())
    if not match:
        raise argparse.ArgumentTypeError(f"not a rate: {text!r} (for example 1gbit, 500mbit)")
    return float(match.group(1)) * {"k": 1e3, "m": 1e6, "g": 1e9}[match.group(2)]


def cluster(host: str, *command: str, check: bool = True) -> subprocess.CompletedProcess:
    """Runs ``command`` on ``host`` of the cluster."""
    return subprocess.run(
        [str(multihost.CLUSTER), "exec", host, *command],
        check=check,
        capture_output=True,
        text=True,
    )


def set_rate(hosts: int, rate: str | None) -> None:
    """A token bucket of ``rate`` on both ends of each host's link (None: no limit)."""
    for k in range(1, hosts + 1):
        for host, device in ((f"node{k}", "eth0"), ("head", f"veth{k}")):
            if rate is None:
                cluster(host, "tc", "qdisc", "del", "dev", device, "root", check=False)
            else:
                # The burst holds a few large segments (veths pass 64 KiB
                # GSO packets); the queue holds 20 ms at the rate.
                cluster(host, "tc", "qdisc", "replace", "dev", device, "root", "tbf", "rate", rate,
                        "burst", "256kb", "latency", "20ms")  # fmt: skip


def goodput(seconds: int = 3) -> float | None:
    """TCP goodput from node1 to node2 in bits per second (iperf3), or None without iperf3."""
    if shutil.which("iperf3") is None:
        return None
    server = subprocess.Popen(
        # One test, and a time limit in case the client never connects.
        [str(multihost.CLUSTER), "exec", "node2", "timeout", "60", "iperf3", "-s", "-1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(50):
            # Until the server listens, the client fails at once.
            time.sleep(0.2)
            client = cluster(
                "node1", "iperf3", "-c", "node2", "-t", str(seconds), "-J", check=False
            )
            received = json.loads(client.stdout or "{}").get("end", {}).get("sum_received", {})
            if client.returncode == 0 and received.get("bits_per_second"):
                return float(received["bits_per_second"])
        raise RuntimeError(f"iperf3 failed: {client.stdout[-2000:]}{client.stderr[-2000:]}")
    finally:
        server.wait(timeout=90)


def launch(argv: list[str], hosts: int, per_host: int, env: dict[str, str], cwd: Path) -> str:
    """Runs ``argv`` across hosts under ``srun`` from ``cwd``; its output (fails if it fails)."""
    here = os.getcwd()
    os.chdir(cwd)  # srun starts the ranks in the caller's directory
    try:
        done = multihost.run("srun", hosts, per_host, argv, env, timeout=1800, capture=True)
    finally:
        os.chdir(here)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stdout[-4000:]}")
    return done.stdout


def run_bench(hosts: int, per_host: int, sizes: list[str], repeats: int, scratch: Path) -> dict:
    """``python -m jaxcomm.bench``'s records across hosts, and its printed table."""
    path = scratch / f"bench-{os.getpid()}.json"
    argv = [sys.executable, "-m", "jaxcomm.bench", "--ops", ",".join(LINK_OPS)]
    argv += ["--modes", "loop", "--sizes", ",".join(sizes), "--repeats", str(repeats)]
    argv += ["--no-progress", "--markdown", "--json", str(path)]
    # Outside the source tree: its jaxcomm/ has no compiled kernels.
    out = launch(argv, hosts, per_host, {}, scratch)
    records = json.loads(path.read_text())["records"]
    path.unlink()
    return {"records": records, "output": out}


def run_overlap(hosts: int, per_host: int, progress: bool, repeats: int) -> dict:
    """``benchmarks.overlap`` across hosts (from the checkout's root, as it is run)."""
    env = {**ONE_THREAD, **({"MPICH_ASYNC_PROGRESS": "1"} if progress else {})}
    argv = [sys.executable, "-m", "benchmarks.overlap", "--mib", "16", "64"]
    argv += ["--repeats", str(repeats)]
    return {"progress": progress, "output": launch(argv, hosts, per_host, env, ROOT)}


def per_step_ms(output: str, name: str) -> float:
    """The milliseconds per step that shallow_water.py printed for run ``name``."""
    match = re.search(rf"^{name}: ([\d.]+) ms per step", output, re.M)
    if not match:
        raise RuntimeError(f"shallow_water.py printed no {name} time:\n{output[-2000:]}")
    return float(match.group(1))


def run_halo(hosts: int, per_host: int, progress: bool, scratch: Path) -> dict:
    """shallow_water.py's blocking and overlapped steps across hosts, and the block on one rank."""
    env = {**ONE_THREAD, **({"MPICH_ASYNC_PROGRESS": "1"} if progress else {})}
    ranks = hosts * per_host
    script = str(ROOT / "examples" / "shallow_water.py")
    common = ["--steps", str(HALO_STEPS), "--benchmark"]
    rows, columns = HALO_CELLS
    out = launch(
        [sys.executable, script, "--cells", str(rows), str(columns), "--overlap", *common],
        hosts,
        per_host,
        env,
        scratch,
    )
    alone = launch(
        [sys.executable, script, "--cells", str(rows // ranks), str(columns), *common],
        1,
        1,
        env,
        scratch,
    )
    return {
        "progress": progress,
        "cells": list(HALO_CELLS),
        "steps": HALO_STEPS,
        "blocking_ms": per_step_ms(out, "blocking"),
        "overlapped_ms": per_step_ms(out, "overlapped"),
        "compute_ms": per_step_ms(alone, "benchmark"),
        "output": out + alone,
    }


def fit_from(path: Path | None, scratch: Path) -> dict:
    """``benchmarks.model``'s calibration (``"fit"``) from ``path``, or from a run on this host."""
    if path is None:
        path = scratch / "model.json"
        command = [sys.executable, "-m", "benchmarks.model", "--ranks", "1,2", "--no-network"]
        subprocess.run([*command, "--json", str(path)], cwd=ROOT, check=True)
    return json.loads(path.read_text())["fit"]


def link_transport(records: list[dict], rate: float, goodput_bps: float | None) -> Transport:
    """The model's link: ``a`` and ``b``.

    ``a`` is the fastest repeat of the floor's 8 B sendrecv (on a shared
    machine a median holds the waits for a core). ``b`` is the link's rate
    as TCP carries it, or iperf3's goodput where that is less (a limit the
    veths do not reach does not bind).
    """
    latency = next(
        r["min_s"]
        for r in records
        if (r["op"], r["nbytes"], r["impl"]) == ("sendrecv", 8, "c") and r.get("min_s")
    )
    carried = rate * PAYLOAD_SHARE
    if goodput_bps is not None:
        carried = min(carried, goodput_bps)
    return Transport(latency, 8 / carried)


def link_time(op: str, nbytes: int, t: Transport, per_byte_reduced: float) -> float:
    """The model's seconds for ``op`` of ``nbytes`` per rank, 2 ranks on 2 hosts.

    MPICH's algorithms at 2 ranks: allreduce is a reduce-scatter and an
    allgather (benchmarks/model.py); bcast a binomial tree (below 8 ranks),
    one message of the whole buffer; allgather one exchange of the buffer;
    alltoall one exchange of half of it (a rank keeps its own block); the
    ring sendrecv one exchange. The link is full duplex: an exchange costs
    one message's time.
    """
    if op == "allreduce":
        return allreduce_time(nbytes, 2, t, per_byte_reduced)
    if op in ("sendrecv", "bcast", "allgather"):
        return halo_time(nbytes, 2, t)
    if op == "alltoall":
        return halo_time(nbytes // 2, 2, t)
    raise ValueError(f"no link model for {op!r}")


def predicted_halo(result: dict, t: Transport) -> tuple[float, float]:
    """The model's blocking and overlapped milliseconds per step of shallow_water.py, 2 ranks.

    A halo is one row of 3 float32 fields. The blocking step exchanges the
    rows above and below one after the other (two sendrecvs with the same
    peer, each ``a + m b``) and then computes; the overlapped one sends
    both at once (``a + 2 m b``) while the interior is computed, so it
    costs the larger of the two.
    """
    row = 3 * result["cells"][1] * 4
    compute = result["compute_ms"] * 1e-3
    blocking = compute + 2 * halo_time(row, 2, t)
    overlapped = max(compute, t.latency + 2 * row * t.per_byte)
    return blocking * 1e3, overlapped * 1e3


def ms(seconds: float) -> str:
    """Seconds as milliseconds, 3 significant digits."""
    return f"{seconds * 1e3:.3g}"


def bench_table(records: list[dict], t: Transport, per_byte_reduced: float) -> str:
    """Measured routes beside the model, a row per op and size."""
    lines = [
        "| op | size | C floor ms | mpi4py ms | jaxcomm ms | jaxcomm / floor | floor sends MiB/s | model ms | floor / model |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    # Where a call holds few ops, whole calls, per op: the bench's loop time
    # (the difference between calls of 2n and n ops) then rests on a handful
    # of extra ops, too few when one takes 0.6 s on a shared machine (it gave
    # a 64 MiB alltoall faster than the link). The floor's and mpi4py's calls
    # cost nothing of their own; jaxcomm's carry one copy of the array.
    times = {
        (r["op"], r["nbytes"], r["impl"]): r.get("time_s" if r["iters"] >= MANY else "call_s")
        for r in records
    }
    for op in LINK_OPS:
        for nbytes in sorted({r["nbytes"] for r in records if r["op"] == op}):
            floor, reference, ours = (
                times.get((op, nbytes, i)) for i in ("c", "mpi4py", "jaxcomm")
            )
            model = link_time(op, nbytes, t, per_byte_reduced)
            size = f"{nbytes // MIB} MiB" if nbytes >= MIB else f"{nbytes} B"
            cells = [op, size, *(ms(x) if x else "-" for x in (floor, reference, ours))]
            cells.append(f"{ours / floor:.2f}" if ours and floor else "-")
            # What a rank sends the other (alltoall keeps half), per second.
            sent = nbytes // 2 if op == "alltoall" else nbytes
            cells.append(f"{sent / floor / MIB:.0f}" if floor and nbytes >= MIB else "-")
            cells += [ms(model), f"{floor / model:.2f}" if floor else "-"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def measure_rate(rate: str, args: argparse.Namespace, parts: set[str], scratch: Path) -> dict:
    """Every part's results at one rate (the links limited to it)."""
    set_rate(args.hosts, rate)
    here: dict = {}
    if "link" in parts:
        here["goodput_bps"] = goodput()
    if "bench" in parts:
        here["bench"] = run_bench(
            args.hosts, args.per_host, args.sizes.split(","), args.repeats, scratch
        )
        print(here["bench"]["output"], flush=True)
    if "overlap" in parts:
        here["overlap"] = [
            run_overlap(args.hosts, args.per_host, progress, args.repeats)
            for progress in (False, True)
        ]
    if "halo" in parts:
        here["halo"] = [
            run_halo(args.hosts, args.per_host, progress, scratch) for progress in (False, True)
        ]
    return here


def report(results: dict) -> str:
    """The Markdown report of :func:`main`'s results: per rate, measured beside the model."""
    out = []
    if results.get("unlimited_bps"):
        out.append(f"# no limit: iperf3 node1 -> node2 {results['unlimited_bps'] / 1e9:.3g} Gbit/s")
    fit = results.get("fit")
    for rate, here in results["rates"].items():
        if here.get("goodput_bps"):
            out.append(f"# {rate}: iperf3 node1 -> node2 {here['goodput_bps'] / 1e9:.3g} Gbit/s")
        t = None
        if "bench" in here:
            t = link_transport(here["bench"]["records"], parse_rate(rate), here.get("goodput_bps"))
        elif results.get("latency_s") is not None:
            carried = parse_rate(rate) * PAYLOAD_SHARE
            carried = min(carried, here.get("goodput_bps") or carried)
            t = Transport(results["latency_s"], 8 / carried)
        if t is not None:
            out.append(
                f"# {rate}: the model's link: a = {t.latency * 1e6:.3g} us, "
                f"1/b = {1 / t.per_byte / MIB:.4g} MiB/s"
            )
        if "bench" in here and fit:
            out.append(bench_table(here["bench"]["records"], t, fit["per_byte_reduced"]))
        for run in here.get("overlap", []):
            out.append(f"# {rate}: benchmarks.overlap, progress thread {run['progress']}:")
            out.append(run["output"].strip())
        for run in here.get("halo", []):
            line = (
                f"# {rate}: shallow_water.py {run['cells'][0]}x{run['cells'][1]} cells, "
                f"progress thread {run['progress']}: the block alone {run['compute_ms']:.1f} ms, "
                f"blocking {run['blocking_ms']:.1f} ms, overlapped {run['overlapped_ms']:.1f} ms "
                "per step"
            )
            if t is not None:
                blocking, overlapped = predicted_halo(run, t)
                line += f"; model {blocking:.1f} and {overlapped:.1f} ms"
            out.append(line)
    return "\n".join(out)


def main() -> int:
    """Parses the options, measures each rate (or reads a report's results), prints the report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="1gbit,10gbit", help="tbf rates (default 1gbit,10gbit)")
    parser.add_argument("--parts", default=",".join(PARTS), help="of " + ",".join(PARTS))
    parser.add_argument("--hosts", type=int, default=2, help="hosts (default 2)")
    parser.add_argument("--per-host", type=int, default=1, help="ranks a host (default 1)")
    parser.add_argument("--sizes", default=",".join(SIZES), help="bench sizes (8 B needed)")
    parser.add_argument("--repeats", type=int, default=5, help="repeats of each timing")
    parser.add_argument("--fit", type=Path, help="a benchmarks.model --json file (its fit)")
    parser.add_argument(
        "--latency-us",
        type=float,
        help="the model's latency when the bench part is not run (it measures it otherwise)",
    )
    parser.add_argument("--json", type=Path, help="write every result here")
    parser.add_argument(
        "--report", type=Path, help="print the report of a --json file, measure nothing"
    )
    args = parser.parse_args()
    if args.report:
        print(report(json.loads(args.report.read_text())))
        return 0
    rates = [r.strip() for r in args.rates.split(",")]
    for rate in rates:
        parse_rate(rate)
    parts = set(args.parts.split(","))
    if parts - set(PARTS):
        parser.error(f"--parts: unknown {sorted(parts - set(PARTS))}")
    if "halo" in parts and args.hosts * args.per_host != 2:
        # The block alone and the model's two exchanges a step are a 2x1 grid's.
        parser.error("--parts halo: 2 ranks only (--hosts 2 --per-host 1)")
    results: dict = {"hosts": args.hosts, "per_host": args.per_host, "rates": {}}
    if args.latency_us is not None:
        results["latency_s"] = args.latency_us * 1e-6
    with tempfile.TemporaryDirectory(dir=multihost.DIR) as name:
        scratch = Path(name)
        if (args.hosts, args.per_host) == (2, 1) and "bench" in parts:
            results["fit"] = fit_from(args.fit, scratch)
        try:
            if "link" in parts:
                set_rate(args.hosts, None)
                results["unlimited_bps"] = goodput()
            for rate in rates:
                results["rates"][rate] = measure_rate(rate, args, parts, scratch)
                if args.json:
                    args.json.write_text(json.dumps(results, indent=1))
        finally:
            set_rate(args.hosts, None)
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
