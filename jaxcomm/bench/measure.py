"""The measurement: each implementation's result checked, then timed, as :class:`Record` objects."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np
from mpi4py import MPI

from .operations import DTYPE, MODES, OPS, Op, check_data, input_shape
from .routes import Impl
from .sizes import DEFAULT_SIZES, format_size
from .timing import Progress, seconds

# How many loop iterations the result check runs: one keeps the ops whose
# output MPI leaves undefined on some ranks (reduce, gather, exscan) from
# feeding those values back in, where libraries legitimately differ.
CHECK_ITERS = 1

# The fewest iterations n of a loop-mode repeat. A call's first iterations
# are slower (XLA's loop buffers are fresh memory, faulted in on first
# write: about 16 ms more for a 64 MiB message here), and the difference
# of the 2n and n calls must leave them out.
LOOP_MIN_ITERS = 4


@dataclasses.dataclass
class Record:
    """One implementation's figures for one op, message size and mode.

    Attributes:
        op: op name (see :data:`OPS`).
        mode: ``jit``, ``loop`` or ``eager``.
        nbytes: bytes of each rank's input array (0 for barrier).
        impl: implementation name (``mpi4py``, ``jaxcomm``, ``plain``, ...).
        ranks: communicator size.
        iters: ops per repeat.
        repeats: timed repeats.
        time_s: median over repeats of seconds per op (the slowest rank's
            time in each repeat); None when not timed.
        min_s: the fastest repeat's seconds per op.
        call_s: what a user's stopwatch around whole calls sees: the median
            over repeats of the n-op repeat's seconds per op. In loop mode
            it keeps the jitted call's own cost (dispatch, copying the carry
            in, allocating the result) that ``time_s``, the difference of
            the 2n and n calls, leaves out; otherwise it is ``time_s``.
        bandwidth: ``nbytes / time_s`` in bytes per second (None for barrier).
        match: whether the result equalled mpi4py's on every rank (None for
            the plain reference, which does no MPI).
        ratios: ``time_s`` over each other implementation's ``time_s`` in the
            same measurement, by name.
        error: why the op was not timed, if it was not.
    """

    op: str
    mode: str
    nbytes: int
    impl: str
    ranks: int
    iters: int = 0
    repeats: int = 0
    time_s: float | None = None
    min_s: float | None = None
    call_s: float | None = None
    bandwidth: float | None = None
    match: bool | None = None
    ratios: dict[str, float] = dataclasses.field(default_factory=dict)
    error: str | None = None


def _agree(comm: MPI.Intracomm, flag: bool) -> bool:
    return bool(comm.allreduce(bool(flag), op=MPI.LAND))


def _results_match(op: Op, comm, expected, got) -> bool:
    if not op.sized or not op.defined(comm.rank, comm.size):
        return True
    return expected.shape == got.shape and np.array_equal(expected, got)


def _per_op(record: Record, times: np.ndarray) -> np.ndarray:
    """Seconds per op of each repeat, from the times of n ops and (loop mode) of 2n.

    When noise leaves a repeat's difference not positive (short loops whose
    call cost dwarfs the iterations), that repeat's 2n call average is taken.
    """
    n = record.iters
    if record.mode != "loop":
        return times[:, 0] / n
    difference = (times[:, 1] - times[:, 0]) / n
    return np.where(difference > 0, difference, times[:, 1] / (2 * n))


def _per_op_estimate(comm, run, target_s: float, max_iters: int) -> float:
    """Seconds per op, from growing batches until one takes an eighth of the target.

    That batch runs twice and the faster run counts, so that one stall of a
    busy machine does not leave a measurement with a handful of iterations.
    Every rank takes the same decisions (the slowest rank's times), since
    every batch is collective.
    """

    def timed(n):
        return comm.allreduce(seconds(functools.partial(run, n), comm=comm), op=MPI.MAX)

    n = 1
    while True:
        elapsed = timed(n)
        if elapsed >= target_s / 8 or n >= max_iters:
            return min(elapsed, timed(n)) / n
        n = min(n * 8, max_iters)


def measure(
    comm: MPI.Intracomm,
    op: Op,
    nbytes: int,
    mode: str,
    impls: Sequence[Impl],
    *,
    repeats: int = 5,
    target_s: float = 0.02,
    max_iters: int = 100_000,
) -> list[Record]:
    """Time ``op`` at one size in one mode for every implementation that has it.

    First each implementation's result is compared with mpi4py's (the first
    of ``impls`` must be :class:`Mpi4pyImpl`); an implementation that fails
    or disagrees is not timed. Then each one's iteration count is chosen so
    that one repeat takes about ``target_s``, and the implementations take
    turns, in a rotating order, with a barrier before each repeat.

    Args:
        comm: the communicator the ops run on (all its ranks call this).
        op: the op.
        nbytes: message size in bytes (ignored for barrier).
        mode: ``jit``, ``loop`` or ``eager``.
        impls: the implementations; the first is the mpi4py reference.
        repeats: timed repeats.
        target_s: seconds one repeat should take.
        max_iters: the most ops in one repeat.

    Returns:
        One :class:`Record` per implementation that supports the op and mode.
    """
    impls = [impl for impl in impls if impl.supports(op, mode)]
    shape = input_shape(op, nbytes, comm.size)
    size_bytes = int(np.prod(shape)) * DTYPE.itemsize if op.sized else 0
    records = [Record(op.name, mode, size_bytes, impl.name, comm.size) for impl in impls]
    check_iters = CHECK_ITERS if mode == "loop" else 1

    expected = None
    runners = []
    for impl, record in zip(impls, records):
        try:
            got = impl.to_numpy(impl.runner(op, mode, check_data(shape, comm.rank))(check_iters))
            got = None if got is None else np.array(got, copy=True)
            run = impl.runner(op, mode, np.zeros(shape, DTYPE))
            run(1)  # compiled and warm before timing
            failure = None
        except Exception as err:  # noqa: BLE001 - reported in the record, not raised
            got, run, failure = None, None, f"{type(err).__name__}: {err}"
        ok = _agree(comm, failure is None)
        if not ok:
            record.error = failure or "failed on another rank"
            continue
        if not impl.checked:
            record.match = None
        elif impl is impls[0]:
            expected, record.match = got, True
        elif records[0].match is None:
            record.error = "the mpi4py reference failed, so this cannot be checked"
            continue
        else:
            record.match = _agree(comm, _results_match(op, comm, expected, got))
        if record.match is not False:
            runners.append((record, run))

    if not runners:
        return records
    for record, run in runners:
        estimate = _per_op_estimate(comm, run, target_s, max_iters)
        record.iters = int(min(max_iters, max(1, round(target_s / max(estimate, 1e-9)))))
        if mode == "loop":
            record.iters = max(record.iters, LOOP_MIN_ITERS)
    # samples[..., 0]: a repeat of n ops. In loop mode, samples[..., 1] is a
    # call of 2n iterations: the difference is n iterations without the
    # call's own cost (copying the carry in, allocating the
    # result), which mpi4py's loop does not pay.
    samples = np.zeros((len(runners), repeats, 2))
    for rep in range(repeats):
        for k in range(len(runners)):
            i = (k + rep) % len(runners)
            record, run = runners[i]
            samples[i, rep, 0] = seconds(functools.partial(run, record.iters), comm=comm)
            if record.mode == "loop":
                samples[i, rep, 1] = seconds(functools.partial(run, 2 * record.iters), comm=comm)
    comm.Allreduce(MPI.IN_PLACE, samples, op=MPI.MAX)
    for (record, _), row in zip(runners, samples):
        record.repeats = repeats
        per_op = _per_op(record, row)
        record.time_s = float(np.median(per_op))
        record.min_s = float(np.min(per_op))
        record.call_s = float(np.median(row[:, 0] / record.iters))
        record.bandwidth = size_bytes / record.time_s if op.sized else None
    for record, _ in runners:
        record.ratios = {
            other.impl: record.time_s / other.time_s for other, _ in runners if other is not record
        }
    return records


def run(
    comm: MPI.Intracomm,
    impls: Sequence[Impl],
    ops: Sequence[str] = tuple(OPS),
    sizes: Sequence[int] = DEFAULT_SIZES,
    modes: Sequence[str] = MODES,
    *,
    repeats: int = 5,
    target_s: float = 0.02,
    max_iters: int = 100_000,
    progress: bool = False,
) -> list[Record]:
    """Measure every op at every size in every mode (barrier at one size only).

    Args:
        comm: the communicator (every rank calls this).
        impls: implementations, :class:`Mpi4pyImpl` first.
        ops: op names from :data:`OPS`; ops needing more ranks than
            ``comm.size`` are left out.
        sizes: message sizes in bytes.
        modes: a subset of :data:`MODES`.
        repeats, target_s, max_iters: as for :func:`measure`.
        progress: draw a progress bar on rank 0's stderr.

    Returns:
        The records of every measurement, in order.
    """
    plan = [
        (OPS[name], nbytes, mode)
        for name in ops
        if OPS[name].min_size <= comm.size
        for nbytes in (sizes if OPS[name].sized else sizes[:1])
        for mode in modes
    ]
    bar = Progress(len(plan), progress and comm.rank == 0)
    records = []
    try:
        for op, nbytes, mode in plan:
            records += measure(
                comm,
                op,
                nbytes,
                mode,
                impls,
                repeats=repeats,
                target_s=target_s,
                max_iters=max_iters,
            )
            bar.step(f"{op.name} {format_size(nbytes) if op.sized else ''} {mode}")
    finally:
        bar.close()
    return records
