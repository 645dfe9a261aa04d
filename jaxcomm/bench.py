"""Latency and bandwidth of every jaxcomm op, beside mpi4py, in one run.

Run it under MPI, from outside the source tree (which has no compiled
kernels)::

    mpiexec -n 2 python -m jaxcomm.bench [--quick] [--json FILE] [--plot FILE.png]

Every op is timed in three modes, each beside the same MPI operation done by
mpi4py on NumPy buffers:

- ``jit``: one op per jitted call, waiting for each call's result;
- ``loop``: many ops in one jitted ``lax.fori_loop`` whose body is the op on
  the carry and ``* 0.5`` (mpi4py: the MPI call, then ``np.multiply`` into
  preallocated buffers);
- ``eager``: the method called outside ``jit``.

``jit`` and ``eager`` also time a plain jitted function without MPI
(``x + 1`` on the same array), the reference of the dispatch targets. Each
op's result is first checked against mpi4py's; a wrong op is reported as
wrong and not timed.

The measurement core (:func:`run`, :func:`measure`, the :class:`Impl`
classes) returns :class:`Record` objects and is importable;
``benchmarks/compare.py`` adds mpi4jax and JAX's own collectives to it.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import platform
import re
import socket
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from . import __version__, sync
from .comm import JaxComm

MODES = ("jit", "loop", "eager")
KIB, MIB = 1 << 10, 1 << 20
# 8 B to 64 MiB, a factor 8 apart.
DEFAULT_SIZES = (8, 64, 512, 4 * KIB, 32 * KIB, 256 * KIB, 2 * MIB, 16 * MIB, 64 * MIB)
QUICK_SIZES = (8, 1 * MIB)
DTYPE = np.dtype(np.float32)
REFERENCE = "mpi4py"  # every ratio in the table is against this, unless named
PLAIN = "plain"  # jax.jit(lambda x: x + 1): no MPI
# How many loop iterations the result check runs: one keeps the ops whose
# output MPI leaves undefined on some ranks (reduce, gather, exscan) from
# feeding those values back in, where libraries legitimately differ.
CHECK_ITERS = 1

# The fewest iterations n of a loop-mode repeat. A call's first iterations
# are slower (XLA's loop buffers are fresh memory, faulted in on first
# write: about 16 ms more for a 64 MiB message here), and the difference
# of the 2n and n calls must leave them out.
LOOP_MIN_ITERS = 4


# --- The ops -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Op:
    """One benchmarked operation and how mpi4py does the same.

    Attributes:
        name: the jaxcomm method's name (``send_recv`` is a ping-pong of
            ``send`` and ``recv``).
        split: whether the input has a leading axis of the communicator size
            (scatter, alltoall, reduce_scatter); otherwise it is flat.
        out_shape: the output shape, from the input shape and the size.
        jaxcomm: ``(JaxComm, x) -> y``, traceable.
        mpi4py: ``(comm, send, recv) -> out``: the MPI call on NumPy buffers,
            returning the buffer that holds the result.
        sized: False for barrier, which moves no data.
        defined: ``(rank, size) -> bool``, whether MPI defines the result on
            that rank (the result check compares only those).
        min_size: the fewest ranks the op needs.
    """

    name: str
    split: bool
    out_shape: Callable[[tuple[int, ...], int], tuple[int, ...]]
    jaxcomm: Callable[[JaxComm, jax.Array], Any]
    mpi4py: Callable[[MPI.Intracomm, np.ndarray, np.ndarray], Any]
    sized: bool = True
    defined: Callable[[int, int], bool] = lambda rank, size: True
    min_size: int = 1


def _same(shape, size):
    return shape


def _stacked(shape, size):
    return (size, *shape)


def _unstacked(shape, size):
    return shape[1:]


def _on_root(rank, size):
    return rank == 0


def _after_first(rank, size):
    return rank > 0


def ring(rank: int, size: int) -> tuple[int, int]:
    """The ring exchange's peers: (source, dest) = (rank - 1, rank + 1)."""
    return (rank - 1) % size, (rank + 1) % size


def partner(rank: int, size: int) -> int | None:
    """The ping-pong partner (0-1, 2-3, ...), or None for the last of an odd count."""
    peer = rank ^ 1
    return peer if peer < size else None


def pingpong(rank, size, x, send, recv):
    """A ping-pong round trip: even ranks send ``x`` then receive, odd ranks echo.

    ``send(array, peer)`` and ``recv(template, peer) -> array`` are the
    library's calls; the result is what this rank received (``x`` on a rank
    without a partner).
    """
    peer = partner(rank, size)
    if peer is None:
        return x
    if rank % 2 == 0:
        send(x, peer)
        return recv(x, peer)
    y = recv(x, peer)
    send(y, peer)
    return y


def _pingpong_jaxcomm(jc, x):
    return pingpong(
        jc.rank,
        jc.size,
        x,
        lambda v, peer: jc.send(v, dest=peer),
        lambda v, peer: jc.recv(v, source=peer),
    )


def _pingpong_mpi4py(comm, s, r):
    def recv(_, peer):
        comm.Recv(r, source=peer)
        return r

    return pingpong(comm.rank, comm.size, s, lambda v, peer: comm.Send(v, dest=peer), recv)


def _sendrecv_jaxcomm(jc, x):
    source, dest = ring(jc.rank, jc.size)
    return jc.sendrecv(x, x, source=source, dest=dest)


def _sendrecv_mpi4py(comm, s, r):
    source, dest = ring(comm.rank, comm.size)
    comm.Sendrecv(s, dest, recvbuf=r, source=source)
    return r


def _bcast_mpi4py(comm, s, r):
    comm.Bcast(s, root=0)  # MPI_Bcast works in place: root's buffer is the message
    return s


def _mpi4py_call(method, **kwargs):
    """An mpi4py buffer method as ``(comm, send, recv) -> recv``."""

    def call(comm, s, r):
        getattr(comm, method)(s, r, **kwargs)
        return r

    return call


OPS: dict[str, Op] = {
    op.name: op
    for op in (
        Op(
            "allreduce",
            False,
            _same,
            lambda jc, x: jc.allreduce(x),
            _mpi4py_call("Allreduce", op=MPI.SUM),
        ),
        Op(
            "reduce",
            False,
            _same,
            lambda jc, x: jc.reduce(x, root=0),
            _mpi4py_call("Reduce", op=MPI.SUM, root=0),
            defined=_on_root,
        ),
        Op("bcast", False, _same, lambda jc, x: jc.bcast(x, root=0), _bcast_mpi4py),
        Op("allgather", False, _stacked, lambda jc, x: jc.allgather(x), _mpi4py_call("Allgather")),
        Op(
            "gather",
            False,
            _stacked,
            lambda jc, x: jc.gather(x, root=0),
            _mpi4py_call("Gather", root=0),
            defined=_on_root,
        ),
        Op(
            "scatter",
            True,
            _unstacked,
            lambda jc, x: jc.scatter(x, root=0),
            _mpi4py_call("Scatter", root=0),
        ),
        Op("alltoall", True, _same, lambda jc, x: jc.alltoall(x), _mpi4py_call("Alltoall")),
        Op(
            "reduce_scatter",
            True,
            _unstacked,
            lambda jc, x: jc.reduce_scatter(x),
            _mpi4py_call("Reduce_scatter_block", op=MPI.SUM),
        ),
        Op("scan", False, _same, lambda jc, x: jc.scan(x), _mpi4py_call("Scan", op=MPI.SUM)),
        Op(
            "exscan",
            False,
            _same,
            lambda jc, x: jc.exscan(x),
            _mpi4py_call("Exscan", op=MPI.SUM),
            defined=_after_first,
        ),
        Op("sendrecv", False, _same, _sendrecv_jaxcomm, _sendrecv_mpi4py),
        Op("send_recv", False, _same, _pingpong_jaxcomm, _pingpong_mpi4py, min_size=2),
        Op(
            "barrier",
            False,
            _same,
            lambda jc, x: jc.barrier(),
            lambda comm, s, r: comm.Barrier(),
            sized=False,
        ),
    )
}


def input_shape(op: Op, nbytes: int, size: int) -> tuple[int, ...]:
    """Each rank's float32 input for a message of about ``nbytes`` bytes."""
    if not op.sized:
        return (1,)
    count = max(1, nbytes // DTYPE.itemsize)
    return (size, max(1, count // size)) if op.split else (count,)


def check_data(shape: tuple[int, ...], rank: int) -> np.ndarray:
    """Small integers that differ per rank: every result is exact in float32."""
    count = int(np.prod(shape))
    return ((np.arange(count) * 3 + rank * 7) % 5).astype(DTYPE).reshape(shape)


def loop_step(y: jax.Array, c: jax.Array) -> jax.Array:
    """The loop body's elementwise step: the op's result times 0.5, shaped as the carry.

    An output with an extra leading axis (allgather, gather) gives its first
    block; a smaller one (scatter, reduce_scatter) is broadcast.
    """
    if y is None:  # barrier
        return c
    if y.ndim > c.ndim:
        y = y[0]
    return jnp.broadcast_to(y * 0.5, c.shape).astype(c.dtype)


def loop_step_numpy(out: np.ndarray | None, carry: np.ndarray) -> None:
    """:func:`loop_step` for mpi4py: into the preallocated carry, no allocation."""
    if out is None:
        return
    np.multiply(out[0] if out.ndim > carry.ndim else out, 0.5, out=carry)


def fori(fn: Callable[[jax.Array], Any]) -> Callable[[jax.Array, Any], jax.Array]:
    """``(c, n) -> c`` after ``n`` iterations of ``c = loop_step(fn(c), c)``."""

    def loop(c, n):
        return jax.lax.fori_loop(0, n, lambda i, carry: loop_step(fn(carry), carry), c)

    return loop


# --- Implementations ---------------------------------------------------------


class Impl:
    """A way of doing the benchmarked ops: mpi4py, jaxcomm, or another library.

    Subclasses give :meth:`runner`; those whose ops are JAX functions derive
    from :class:`JaxImpl` and give only the function.

    Attributes:
        name: the column name.
        modes: the modes it can run.
    """

    name = ""
    modes: tuple[str, ...] = MODES

    def supports(self, op: Op, mode: str) -> bool:
        """Whether this implementation has ``op`` in ``mode``."""
        return mode in self.modes

    def runner(self, op: Op, mode: str, x: np.ndarray) -> Callable[[int], Any]:
        """A callable doing ``n`` ops on (a copy of) ``x`` and returning the last result.

        It returns once the work is complete (results ready, MPI calls done).
        In ``loop`` mode the result is the carry after ``n`` iterations; in the
        others, each op reads ``x`` and the result is the last op's.
        """
        raise NotImplementedError

    def to_numpy(self, out: Any) -> np.ndarray | None:
        """This rank's part of a result, as NumPy (None for no result)."""
        return None if out is None else np.asarray(out)


class Mpi4pyImpl(Impl):
    """The reference: mpi4py's buffer methods on preallocated NumPy arrays."""

    name = REFERENCE

    def __init__(self, comm: MPI.Intracomm):
        self.comm = comm

    def runner(self, op, mode, x):
        send = np.array(x, copy=True)
        recv = np.zeros(op.out_shape(x.shape, self.comm.size), x.dtype)
        call = functools.partial(op.mpi4py, self.comm, send, recv)
        if mode == "loop":

            def run(n):
                for _ in range(n):
                    loop_step_numpy(call(), send)
                return send

        else:

            def run(n):
                out = None
                for _ in range(n):
                    out = call()
                return out

        return run


class JaxImpl(Impl):
    """An implementation whose ops are JAX-traceable functions of one array.

    Subclasses give :meth:`function`; this class runs it eagerly, jitted, or
    in a jitted ``fori_loop``, waiting for each call.
    """

    def function(self, op: Op) -> Callable[[jax.Array], Any]:
        """``x -> y`` doing ``op`` (``None`` output for barrier)."""
        raise NotImplementedError

    def wait(self, out: Any, op: Op, mode: str) -> None:
        """Block until a call's work is complete."""
        jax.block_until_ready(out)

    @functools.cache  # noqa: B019 (one instance per benchmark run, kept to the end anyway)
    def _callable(self, op: Op, mode: str) -> Callable[..., Any]:
        # One jitted function per op and mode, so that the check's call and
        # the timed calls share its compilations.
        fn = self.function(op)
        return {"eager": fn, "jit": jax.jit(fn), "loop": jax.jit(fori(fn))}[mode]

    def runner(self, op, mode, x):
        call = self._callable(op, mode)
        x = jnp.asarray(x)
        wait = functools.partial(self.wait, op=op, mode=mode)
        if mode == "loop":

            def run(n):
                out = call(x, n)
                wait(out)
                return out

            return run

        def run(n):
            out = None
            for _ in range(n):
                out = call(x)
                wait(out)
            return out

        return run


class JaxcommImpl(JaxImpl):
    """jaxcomm's methods on a :class:`JaxComm`."""

    name = "jaxcomm"

    def __init__(self, jc: JaxComm):
        self.jc = jc

    def function(self, op):
        return functools.partial(op.jaxcomm, self.jc)

    def wait(self, out, op, mode):
        jax.block_until_ready(out)
        # A compiled barrier has no output to wait on; eagerly it has returned
        # once complete.
        if not op.sized and mode != "eager":
            sync()


def _plus_one(x):
    return x + 1


class PlainJitImpl(JaxImpl):
    """``jax.jit(lambda x: x + 1)``: a jitted call without MPI, the dispatch reference."""

    name = PLAIN
    modes = ("jit", "eager")

    def function(self, op):
        return _plus_one

    def runner(self, op, mode, x):
        # The reference for both modes is a jitted call.
        return super().runner(op, "jit", x)


# --- Measurement ---------------------------------------------------------------


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


def _timed(run: Callable[[int], Any], n: int) -> float:
    start = time.perf_counter()
    run(n)
    return time.perf_counter() - start


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
        comm.Barrier()
        return comm.allreduce(_timed(run, n), op=MPI.MAX)

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
        if impl.name == PLAIN:
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
            comm.Barrier()
            samples[i, rep, 0] = _timed(run, record.iters)
            if record.mode == "loop":
                samples[i, rep, 1] = _timed(run, 2 * record.iters)
    comm.Allreduce(MPI.IN_PLACE, samples, op=MPI.MAX)
    for (record, _), row in zip(runners, samples):
        record.repeats = repeats
        per_op = _per_op(record, row)
        record.time_s = float(np.median(per_op))
        record.min_s = float(np.min(per_op))
        record.bandwidth = size_bytes / record.time_s if op.sized else None
    for record, _ in runners:
        record.ratios = {
            other.impl: record.time_s / other.time_s for other, _ in runners if other is not record
        }
    return records


# Process names (as Linux shortens them) of MPI launchers and their daemons.
_LAUNCHERS = ("mpiexec", "mpirun", "hydra_pmi_proxy", "prterun", "prted", "orterun", "orted")


def _stderr_is_terminal() -> bool:
    """Whether this process's stderr ends on a terminal.

    A launcher gives its ranks a pipe and copies it to its own stderr, so a
    rank's ``isatty()`` is always false under ``mpiexec``; on Linux, look at
    the launcher's stderr instead, walking up through its processes.
    """
    if sys.stderr.isatty():
        return True
    pid = os.getppid()
    try:
        for _ in range(4):
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :]
            if not name.startswith(_LAUNCHERS):
                return False
            if os.readlink(f"/proc/{pid}/fd/2").startswith(("/dev/pts/", "/dev/tty")):
                return True
            pid = int(rest.split()[1])
    except (OSError, ValueError):
        pass
    return False


class Progress:
    """A one-line progress bar on stderr (rank 0, a terminal, not disabled)."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done = total, 0
        self.enabled = enabled and _stderr_is_terminal()
        self.start = time.perf_counter()

    def step(self, label: str) -> None:
        """Count one measurement done and redraw."""
        self.done += 1
        if not self.enabled:
            return
        width = 30
        filled = width * self.done // max(1, self.total)
        elapsed = time.perf_counter() - self.start
        sys.stderr.write(
            f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
            f"{elapsed:5.0f}s {label:<32}"
        )
        sys.stderr.flush()

    def close(self) -> None:
        """End the bar's line."""
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


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


# --- Reporting -----------------------------------------------------------------


def format_size(nbytes: int) -> str:
    """``nbytes`` as B, KiB or MiB."""
    for unit, scale in (("MiB", MIB), ("KiB", KIB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def parse_size(text: str) -> int:
    """``"8"``, ``"4K"``, ``"4KiB"``, ``"64M"`` or ``"1MiB"`` as a number of bytes."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (for example 8, 4K, 64MiB)")
    scale = {"": 1, "K": KIB, "M": MIB, "G": 1 << 30}[match.group(2).upper()]
    return int(match.group(1)) * scale


def sizes_between(low: int, high: int) -> list[int]:
    """Powers of 8 times ``low`` up to ``high``, and ``high`` itself."""
    sizes = []
    size = low
    while size < high:
        sizes.append(size)
        size *= 8
    return sizes + [high]


def _format_time(seconds: float) -> str:
    us = seconds * 1e6
    return f"{us:.3g}" if us < 1000 else f"{us:.0f}"


def _format_bandwidth(bps: float | None) -> str:
    if bps is None:
        return ""
    mbps = bps / 1e6
    return f"{mbps:.0f}" if mbps >= 1000 else f"{mbps:.3g}"


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
        The table, with a header line.
    """
    rows: dict[tuple[str, int, str], dict[str, Record]] = {}
    for record in records:
        rows.setdefault((record.op, record.nbytes, record.mode), {})[record.impl] = record

    def time_cell(record):
        if record is None:
            return ""
        if record.match is False:
            return "WRONG"
        return "error" if record.time_s is None else _format_time(record.time_s)

    header = ["op", "size", "mode"]
    header += [f"{name} us" for name in impls]
    header += [f"{a}/{b}" for a, b in ratios]
    header += [f"{name} MB/s" for name in bandwidth]
    lines = [header]
    for (op, nbytes, mode), by_impl in rows.items():
        line = [op, format_size(nbytes) if OPS[op].sized else "-", mode]
        line += [time_cell(by_impl.get(name)) for name in impls]
        for a, b in ratios:
            ratio = by_impl[a].ratios.get(b) if a in by_impl else None
            line.append("" if ratio is None else f"{ratio:.2f}")
        line += [
            _format_bandwidth(by_impl[name].bandwidth) if name in by_impl else ""
            for name in bandwidth
        ]
        lines.append(line)
    if markdown:
        out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        out += ["| " + " | ".join(line) + " |" for line in lines[1:]]
        return "\n".join(out)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            cell.ljust(w) if i < 3 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(line, widths))
        )
        for line in lines
    )


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
        "mpi_library": " ".join(MPI.Get_library_version().split("\n")[0].split()),
    }
    if "mpi4jax" in sys.modules:
        versions["mpi4jax"] = sys.modules["mpi4jax"].__version__
    hosts = sorted(set(comm.allgather(socket.gethostname())))
    return {
        "ranks": comm.size,
        "hosts": hosts,
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        # Other work on the machine shows in the figures: say how busy it was.
        "load_average": list(os.getloadavg()),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "versions": versions,
        **extra,
    }


def write_json(path: str, records: Sequence[Record], meta: dict[str, Any]) -> None:
    """``{"meta": ..., "records": [...]}`` to ``path``."""
    with open(path, "w") as f:
        json.dump({"meta": meta, "records": [dataclasses.asdict(r) for r in records]}, f, indent=1)
        f.write("\n")


_NO_MATPLOTLIB = "--plot needs matplotlib: pip install matplotlib (or 'jaxcomm[bench]')"


def plot(path: str, records: Sequence[Record], title: str) -> None:
    """Time per op against message size, one panel per op, to a PNG.

    Raises:
        RuntimeError: if matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError(_NO_MATPLOTLIB) from None
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
    fig.suptitle(title)
    fig.tight_layout()
    # Right of the panels, so it hides none of them; "tight" widens the image.
    fig.legend(
        *axes.flat[0].get_legend_handles_labels(),
        loc="center left",
        bbox_to_anchor=(1.0, 0.5),
        fontsize="small",
    )
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


# --- Command line ----------------------------------------------------------------


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
    """The options shared by ``jaxcomm.bench`` and ``benchmarks/compare.py``."""
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
    p.add_argument("--json", metavar="FILE", help="write records and versions as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="plot time per op (needs matplotlib)")
    p.add_argument("--markdown", action="store_true", help="print a Markdown table")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """:func:`run`'s keyword arguments from parsed options.

    Raises:
        SystemExit: for ``--plot`` without matplotlib (before measuring, not after).
    """
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SystemExit(_NO_MATPLOTLIB) from None
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
    """Measure with the parsed options; on rank 0 print the table, write JSON and plot.

    Args:
        comm: the communicator (every rank calls this).
        impls: implementations, :class:`Mpi4pyImpl` first; the table shows
            each one's time.
        args: options from :func:`parser`.
        ratios, bandwidth: the table's columns (see :func:`table`).
        title: the table's and the plot's title.
        **meta: extra entries for the JSON's ``meta``.

    Returns:
        The records.
    """
    options = settings(args)
    records = run(comm, impls, **options)
    meta = metadata(comm, options={k: v for k, v in options.items() if k != "progress"}, **meta)
    if comm.rank == 0:
        print(f"# {title}: {comm.size} ranks, jax {jax.__version__}, {meta['cpu']}")
        print("# times: microseconds per op, median of repeats (slowest rank); ratios of times")
        names = [impl.name for impl in impls]
        print(table(records, names, ratios, bandwidth, markdown=args.markdown))
        print(summary(records, ratios))
        if args.json:
            write_json(args.json, records, meta)
        if args.plot:
            plot(args.plot, records, f"{title}, {comm.size} ranks")
        sys.stdout.flush()
    return records


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m jaxcomm.bench``: measure, then print on rank 0."""
    args = parser("Latency and bandwidth of jaxcomm's ops beside mpi4py.").parse_args(argv)
    comm = MPI.COMM_WORLD
    settings(args)  # a bad option fails before anything is measured
    jc = JaxComm(comm)
    try:
        run_and_report(
            comm,
            [Mpi4pyImpl(comm), JaxcommImpl(jc), PlainJitImpl()],
            args,
            ratios=(("jaxcomm", REFERENCE), ("jaxcomm", PLAIN)),
            bandwidth=("jaxcomm", REFERENCE),
            title="jaxcomm.bench",
        )
    finally:
        jc.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
