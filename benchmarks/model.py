"""A cost model for many nodes, checked against this machine: ``python -m benchmarks.model``.

Run:  python -m benchmarks.model [--ranks 1,2,4,8,16,32] [--measured scaling.json] [--json FILE]

Not under mpiexec: like ``benchmarks.scaling``, it starts
``mpiexec -n N python -m jaxcomm.bench`` for each rank count N and measures,
in loop mode at 8 B and 1 MiB per rank, an allreduce, the halo exchange (a
ring ``sendrecv``) and the ragged exchange (traced counts, ``MPI_Alltoall`` of
the counts, then ``MPI_Alltoallv``), for jaxcomm and for the C floor (the same
MPI calls from C). It also measures a 2-rank ``sendrecv`` and allreduce with
the MPI on its network transport (TCP), as CI's network leg sets it up.

The model (Hockney's: a message of n bytes costs a latency plus n times an
inverse bandwidth, per round of the MPI algorithm):

- halo exchange: ``a + n b``, whatever the rank count;
- allreduce: MPICH's algorithms, recursive doubling below 2 KiB
  (``ceil(log2 p)`` rounds of ``a + n b + n g``), reduce-scatter then
  allgather above (``2 log2 q`` rounds, ``2 (q-1)/q n b + (q-1)/q n g`` with
  ``q`` the largest power of two up to p, and two more exchanges of the
  whole message when p is not one);
- ragged exchange: ``p - 1`` messages for the counts and ``p - 1`` for the
  rows, ``2 (p-1) a``, plus the bytes sent to other ranks times b and the
  rows a rank keeps (its block to itself, a copy) times this machine's b;
- jaxcomm: the floor plus a fixed cost per operation, its 1-rank 8 B time
  less the floor's.

a and b come from the floor's 2-rank halo exchange at 8 B and 1 MiB, g
(the reduction's cost per byte) from the floor's 2-rank 1 MiB allreduce.
Above the core count ranks share cores, and every round waits for the
scheduler: a and b grow with ``p / cores``, from factors taken at the first
oversubscribed rank count's halo exchange. Every other row is a prediction,
printed beside what was measured. Then the same formulas, with an assumed
InfiniBand latency and bandwidth (``--latency-us``, ``--bandwidth-gbs``)
and this machine's g and jaxcomm costs, predict 64, 1,024 and 16,384 ranks.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from jaxcomm.bench.operations import OPS, input_shape, ragged_counts
from jaxcomm.bench.report import dump_json, format_table
from jaxcomm.bench.routes.c_floor import FLOOR
from jaxcomm.bench.sizes import MIB, format_size

from .scaling import LAUNCHED_VARS, cores, launcher_vendor, measure, rank_list

MODEL_OPS = ("allreduce", "sendrecv", "ragged")
SIZES = (8, 1 * MIB)
RANKS = (1, 2, 4, 8, 16, 32)
NETWORK_RANKS = (64, 1024, 16384)
JAXCOMM = "jaxcomm"
# MPICH's switch from recursive doubling to reduce-scatter and allgather
# (MPIR_CVAR_ALLREDUCE_SHORT_MSG_SIZE).
ALLREDUCE_SHORT = 2048
# Assumed for a cluster: InfiniBand (EDR) as the MVAPICH2 project summarises
# it, "<1 usec latency, 100 Gbps bandwidth": 1 us per message, and 12 GB/s
# (100 Gb/s is 12.5 GB/s at line rate). docs/benchmarks.md gives the source.
IB_LATENCY_US = 1.0
IB_BANDWIDTH_GBS = 12.0
# The environment that puts each MPI on its network transport (CI's network leg).
NETWORK_ENV = {
    "MPICH": {"MPIR_CVAR_NOLOCAL": "1", "UCX_TLS": "tcp,self"},
    "Open MPI": {"OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "tcp,self"},
}


@dataclasses.dataclass(frozen=True)
class Transport:
    """Hockney's parameters: seconds per message and seconds per byte."""

    latency: float
    per_byte: float


@dataclasses.dataclass(frozen=True)
class Fit:
    """The model's parameters, as calibrated from the measurements.

    Attributes:
        transport: a and b of the MPI's own transport (shared memory here).
        per_byte_reduced: g, seconds per byte the reduction costs.
        cores: the cores the ranks share.
        busy_latency: a per ``p / cores`` once ranks outnumber cores.
        busy_per_byte: b per ``p / cores`` likewise.
        overhead: jaxcomm's fixed seconds per operation, by op.
    """

    transport: Transport
    per_byte_reduced: float
    cores: int
    busy_latency: float
    busy_per_byte: float
    overhead: dict[str, float]

    def at(self, ranks: int) -> Transport:
        """The transport's parameters with ``ranks`` ranks on ``cores`` cores."""
        if ranks <= self.cores:
            return self.transport
        share = ranks / self.cores
        return Transport(self.busy_latency * share, self.busy_per_byte * share)


def _log2_floor(p: int) -> int:
    return p.bit_length() - 1


def allreduce_time(nbytes: int, ranks: int, t: Transport, per_byte_reduced: float) -> float:
    """Seconds for MPICH's allreduce of ``nbytes`` per rank on ``ranks`` ranks."""
    if ranks == 1:
        return 0.0
    q = 1 << _log2_floor(ranks)
    extra = 0.0 if q == ranks else 2 * (t.latency + nbytes * t.per_byte) + nbytes * per_byte_reduced
    if nbytes < ALLREDUCE_SHORT:
        rounds = _log2_floor(q)
        return extra + rounds * (t.latency + nbytes * (t.per_byte + per_byte_reduced))
    share = (q - 1) / q * nbytes
    return (
        extra + 2 * _log2_floor(q) * t.latency + 2 * share * t.per_byte + share * per_byte_reduced
    )


def halo_time(nbytes: int, ranks: int, t: Transport) -> float:
    """Seconds for one ring ``sendrecv`` of ``nbytes`` (both directions at once)."""
    return 0.0 if ranks == 1 else t.latency + nbytes * t.per_byte


def ragged_sent_bytes(nbytes: int, ranks: int, rank: int = 0) -> tuple[int, int]:
    """Bytes the bench's ragged exchange sends from ``rank`` to other ranks, and to itself."""
    shape = input_shape(OPS["ragged"], nbytes, ranks)
    counts = ragged_counts(rank, ranks, shape[1])
    return 4 * (sum(counts) - counts[rank]), 4 * counts[rank]


def ragged_time(nbytes: int, ranks: int, t: Transport, local_per_byte: float) -> float:
    """Seconds for the counts' exchange and the rows' exchange of the ragged step.

    ``local_per_byte``: the cost of the block a rank copies to itself.
    """
    if ranks == 1:
        return 0.0
    others, own = ragged_sent_bytes(nbytes, ranks)
    return 2 * (ranks - 1) * t.latency + others * t.per_byte + own * local_per_byte


def mpi_time(op: str, nbytes: int, ranks: int, fit: Fit, t: Transport | None = None) -> float:
    """The floor's predicted seconds for ``op`` (``t``: another transport's parameters)."""
    local = fit.at(ranks)
    t = local if t is None else t
    if op == "allreduce":
        return allreduce_time(nbytes, ranks, t, fit.per_byte_reduced)
    if op == "sendrecv":
        return halo_time(nbytes, ranks, t)
    if op == "ragged":
        return ragged_time(nbytes, ranks, t, local.per_byte)
    raise ValueError(f"no model for {op!r}: the model covers {', '.join(MODEL_OPS)}")


def predict(op: str, nbytes: int, ranks: int, route: str, fit: Fit, t: Transport | None = None):
    """Predicted seconds per op of ``route`` (jaxcomm or the C floor)."""
    floor = mpi_time(op, nbytes, ranks, fit, t)
    return floor + fit.overhead[op] if route == JAXCOMM else floor


def _measured(records: Iterable[dict[str, Any]], op: str, message: int, ranks: int, impl: str):
    """(seconds, bytes) of the loop-mode record for ``op`` at requested size ``message``.

    Raises:
        LookupError: if there is none, or it has no time.
    """
    for r in records:
        key = (r["op"], r["message"], r["ranks"], r["impl"], r["mode"])
        if key == (op, message, ranks, impl, "loop") and r.get("time_s") is not None:
            return float(r["time_s"]), int(r["nbytes"])
    raise LookupError(f"no loop-mode {impl} time for {op} {format_size(message)} on {ranks} ranks")


def _hockney(records: Sequence[dict[str, Any]], ranks: int, impl: str = FLOOR) -> Transport:
    """a and b through the halo exchange's small and large points at ``ranks`` ranks."""
    small, small_bytes = _measured(records, "sendrecv", min(SIZES), ranks, impl)
    large, large_bytes = _measured(records, "sendrecv", max(SIZES), ranks, impl)
    per_byte = max(0.0, (large - small) / (large_bytes - small_bytes))
    return Transport(max(0.0, small - small_bytes * per_byte), per_byte)


def calibrate(records: Sequence[dict[str, Any]], machine_cores: int) -> Fit:
    """The model's parameters from the calibration rows (see the module's docstring).

    Raises:
        LookupError: if a calibration measurement is missing.
    """
    transport = _hockney(records, 2)
    reduce, nbytes = _measured(records, "allreduce", max(SIZES), 2, FLOOR)
    moved = allreduce_time(nbytes, 2, transport, 0.0)
    per_byte_reduced = max(0.0, (reduce - moved) / (nbytes / 2))
    busy = sorted({r["ranks"] for r in records if r["ranks"] > machine_cores})
    busy_latency, busy_per_byte = transport.latency, transport.per_byte
    if busy:
        shared = _hockney(records, busy[0])
        share = busy[0] / machine_cores
        busy_latency, busy_per_byte = shared.latency / share, shared.per_byte / share
    overhead = {
        op: _measured(records, op, 8, 1, JAXCOMM)[0] - _measured(records, op, 8, 1, FLOOR)[0]
        for op in MODEL_OPS
    }
    return Fit(transport, per_byte_reduced, machine_cores, busy_latency, busy_per_byte, overhead)


def calibration_rows(fit: Fit) -> set[tuple[str, int, int, str]]:
    """The (op, size, ranks, route) rows the parameters were taken from."""
    large = max(SIZES)
    rows = {("sendrecv", 8, 2, FLOOR), ("sendrecv", large, 2, FLOOR)}
    rows |= {("allreduce", large, 2, FLOOR)}
    rows |= {(op, 8, 1, route) for op in MODEL_OPS for route in (FLOOR, JAXCOMM)}
    return rows


def check(records: Sequence[dict[str, Any]], fit: Fit, first_busy: int | None) -> list[dict]:
    """Each measured loop-mode row beside its prediction (1-rank rows: calibration only)."""
    fitted = calibration_rows(fit)
    if first_busy is not None:
        fitted |= {("sendrecv", size, first_busy, FLOOR) for size in SIZES}
    rows = [
        _beside(r, fit, None, (r["op"], r["message"], r["ranks"], r["impl"]) in fitted)
        for r in _modelled(records)
        if r["ranks"] != 1
    ]
    return sorted(rows, key=lambda c: (c["op"], c["message"], c["route"], c["ranks"]))


def _modelled(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The timed loop-mode records of the model's ops, jaxcomm's and the floor's."""
    return [
        r
        for r in records
        if r["mode"] == "loop"
        and r["op"] in MODEL_OPS
        and r["impl"] in (FLOOR, JAXCOMM)
        and r.get("time_s") is not None
    ]


def _beside(r: dict[str, Any], fit: Fit, t: Transport | None, calibration: bool) -> dict:
    """Record ``r`` beside its prediction (``t``: another transport's parameters)."""
    predicted = predict(r["op"], r["nbytes"], r["ranks"], r["impl"], fit, t)
    return {
        "op": r["op"] if t is None else r["op"] + " tcp",
        "message": r["message"],
        "ranks": r["ranks"],
        "route": r["impl"],
        "measured_s": r["time_s"],
        "predicted_s": predicted,
        "ratio": predicted / r["time_s"],
        "calibration": calibration,
        "oversubscribed": r["ranks"] > fit.cores,
    }


def _factor(row: dict) -> float:
    return max(row["ratio"], 1 / row["ratio"])


def worst_ratio(rows: Sequence[dict], *, oversubscribed: bool) -> float | None:
    """The largest factor between prediction and measurement among the predicted rows."""
    factors = [
        _factor(c)
        for c in rows
        if not c["calibration"] and c["oversubscribed"] == oversubscribed and c["ratio"] > 0
    ]
    return max(factors) if factors else None


def worst_by_size_and_ranks(rows: Sequence[dict]) -> dict[tuple[int, int], float]:
    """The largest factor between prediction and measurement, by requested size and rank count."""
    worst: dict[tuple[int, int], float] = {}
    for c in rows:
        if not c["calibration"] and c["ratio"] > 0:
            key = (c["message"], c["ranks"])
            worst[key] = max(worst.get(key, 1.0), _factor(c))
    return worst


def network_predictions(
    fit: Fit, t: Transport, ranks: Sequence[int] = NETWORK_RANKS, sizes: Sequence[int] = SIZES
) -> list[dict]:
    """Predicted floor and jaxcomm seconds per op on a network of parameters ``t``."""
    rows = []
    for op in MODEL_OPS:
        for size in sizes:
            for p in ranks:
                nbytes = int(math.prod(input_shape(OPS[op], size, p))) * 4
                floor = mpi_time(op, nbytes, p, fit, t)
                rows.append(
                    {
                        "op": op,
                        "message": size,
                        "ranks": p,
                        "floor_s": floor,
                        "jaxcomm_s": floor + fit.overhead[op],
                    }
                )
    return rows


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.3g}"


def report(
    fit: Fit,
    rows: Sequence[dict],
    network: Sequence[dict],
    ib: Transport,
    tcp: Transport | None,
    tcp_rows: Sequence[dict],
) -> str:
    """The printed report: parameters, the check, the many-node predictions."""
    out = [
        f"# parameters ({fit.cores} cores): shared memory a = {_us(fit.transport.latency)} us, "
        f"1/b = {1e-9 / fit.transport.per_byte if fit.transport.per_byte else float('inf'):.3g} "
        f"GB/s; reduction g = {fit.per_byte_reduced * 1e9:.3g} ns/byte; "
        f"oversubscribed a = {_us(fit.busy_latency)} us x p/cores, "
        f"b = {fit.busy_per_byte * 1e9:.3g} ns/byte x p/cores",
        "# jaxcomm's fixed cost per op in a loop: "
        + ", ".join(f"{op} {_us(s)} us" for op, s in fit.overhead.items()),
    ]
    if tcp is not None:
        out.append(
            f"# network transport (TCP, 2 ranks): a = {_us(tcp.latency)} us, "
            f"1/b = {1e-9 / tcp.per_byte if tcp.per_byte else float('inf'):.3g} GB/s"
        )
    out.append(
        "# the check: microseconds per op in a loop, measured and predicted (c: calibration)"
    )
    table = [
        [
            c["op"],
            format_size(c["message"]),
            c["route"],
            f"{c['ranks']}{'*' if c['oversubscribed'] else ''}",
            _us(c["measured_s"]),
            _us(c["predicted_s"]),
            f"{c['ratio']:.2f}" + (" c" if c["calibration"] else ""),
        ]
        for c in [*rows, *tcp_rows]
    ]
    header = ["op", "size", "route", "ranks", "measured us", "predicted us", "predicted/measured"]
    out.append(format_table(header, table, left=4))
    for busy, label in ((False, "up to the core count"), (True, "oversubscribed")):
        worst = worst_ratio(rows, oversubscribed=busy)
        if worst is not None:
            out.append(f"# worst prediction {label}: within a factor {worst:.2f}")
    if tcp_rows:
        worst = max(_factor(c) for c in tcp_rows if not c["calibration"])
        out.append(f"# worst prediction over TCP: within a factor {worst:.2f}")
    by = worst_by_size_and_ranks(rows)
    if by:
        out.append("# the worst factor between prediction and measurement, by size and ranks")
        ranks = sorted({p for _, p in by})
        header = ["size", *(f"{p}{'*' if p > fit.cores else ''} ranks" for p in ranks)]
        table = [
            [format_size(size), *(f"{by[size, p]:.2f}" if (size, p) in by else "" for p in ranks)]
            for size in sorted({size for size, _ in by})
        ]
        out.append(format_table(header, table, left=1))
    out.append(
        f"# many nodes: a = {ib.latency * 1e6:.3g} us, 1/b = {1e-9 / ib.per_byte:.3g} GB/s "
        "(assumed), one rank per node, this machine's g and jaxcomm costs"
    )
    ranks = sorted({c["ranks"] for c in network})
    header = ["op", "size", "route", *(f"{p} ranks us" for p in ranks)]
    table = []
    for op in MODEL_OPS:
        for size in sorted({c["message"] for c in network}):
            for route, key in ((FLOOR, "floor_s"), (JAXCOMM, "jaxcomm_s")):
                cells = {
                    c["ranks"]: c[key] for c in network if (c["op"], c["message"]) == (op, size)
                }
                table.append([op, format_size(size), route, *(_us(cells[p]) for p in ranks)])
    out.append(format_table(header, table, left=3))
    return "\n".join(out)


def parser() -> argparse.ArgumentParser:
    """The command's options."""
    p = argparse.ArgumentParser(description="jaxcomm's cost model, checked against measurements.")
    p.add_argument(
        "--ranks",
        type=rank_list,
        default=list(RANKS),
        help="rank counts to measure (default 1,2,4,8,16,32; must include 1 and 2)",
    )
    p.add_argument(
        "--measured",
        metavar="FILE",
        help="a benchmarks.model --json file to read instead of measuring",
    )
    p.add_argument("--no-network", action="store_true", help="skip the TCP measurement")
    p.add_argument("--latency-us", type=float, default=IB_LATENCY_US, help="network latency")
    p.add_argument(
        "--bandwidth-gbs", type=float, default=IB_BANDWIDTH_GBS, help="network bandwidth, GB/s"
    )
    p.add_argument("--timeout", type=float, default=3600, help="seconds one launch may take")
    p.add_argument("--json", metavar="FILE", help="write measurements, parameters and predictions")
    p.add_argument("bench_options", nargs=argparse.REMAINDER, help="-- then jaxcomm.bench options")
    return p


def _tcp_rows(records: Sequence[dict], fit: Fit) -> tuple[Transport | None, list[dict]]:
    """The TCP transport's a and b (from its halo rows) and its rows predicted with them."""
    try:
        tcp = _hockney(records, 2)
    except LookupError:
        return None, []
    rows = [
        _beside(r, fit, tcp, r["op"] == "sendrecv" and r["impl"] == FLOOR)
        for r in _modelled(records)
        if r["ranks"] == 2
    ]
    return tcp, rows


def main(argv: Sequence[str] | None = None) -> int:
    """Measure (or read), calibrate, check and predict; print the report."""
    args = parser().parse_args(argv)
    if args.measured:
        with open(args.measured) as f:
            data = json.load(f)
        records, tcp_records = data["records"], data.get("tcp_records", [])
        machine_cores = data["meta"]["cores"]
    else:
        if any(name in os.environ for name in LAUNCHED_VARS):
            raise SystemExit("run benchmarks.model without mpiexec: it starts mpiexec itself")
        if not {1, 2} <= set(args.ranks):
            raise SystemExit("--ranks must include 1 and 2: the model is calibrated there")
        machine_cores = cores()
        extra = [o for o in args.bench_options if o != "--"]
        options = ["--ops", ",".join(MODEL_OPS), "--modes", "loop"]
        options += ["--sizes", ",".join(str(n) for n in SIZES), *extra]
        records, runs = measure(args.ranks, options, SIZES, args.timeout)
        tcp_records = []
        if not args.no_network:
            env = NETWORK_ENV[launcher_vendor()]
            print(f"# the network transport: {' '.join(f'{k}={v}' for k, v in env.items())}")
            tcp_records, tcp_runs = measure([2], options, SIZES, args.timeout, env=env)
            runs += [{**run, "network": env} for run in tcp_runs]
        if any("error" in run for run in runs):
            return 1
    fit = calibrate(records, machine_cores)
    busy = sorted({r["ranks"] for r in records if r["ranks"] > machine_cores})
    rows = check(records, fit, busy[0] if busy else None)
    tcp, tcp_rows = _tcp_rows(tcp_records, fit) if tcp_records else (None, [])
    ib = Transport(args.latency_us * 1e-6, 1 / (args.bandwidth_gbs * 1e9))
    network = network_predictions(fit, ib)
    print(report(fit, rows, network, ib, tcp, tcp_rows))
    if args.json:
        meta = {"cores": machine_cores, "ranks": sorted({r["ranks"] for r in records})}
        dump_json(
            args.json,
            {
                "meta": meta,
                "records": records,
                "tcp_records": tcp_records,
                "fit": dataclasses.asdict(fit),
                "check": [*rows, *tcp_rows],
                "network": {"assumed": dataclasses.asdict(ib), "predictions": network},
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
