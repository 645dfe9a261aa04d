"""A per-rank timeline of every MPI call jaxcomm makes.

Recording: ``JAXCOMM_TRACE=DIR`` (from import to exit) or
``with jaxcomm.trace(DIR):`` makes every rank write, in the kernels, one span
per MPI call (operation, communicator, bytes, peer or root, tag, start and end,
the Python call site), nonblocking starts and waits, and GPU staging copies,
to ``DIR/rank<R>.bin``, with the clock offsets to rank 0 and the call sites in
``DIR/rank<R>.meta.jsonl``. ``python -m jaxcomm.trace DIR`` merges the files
into one Chrome trace-event file (Perfetto, chrome://tracing) and a summary
that names the waits (:mod:`jaxcomm.trace.analysis`). See docs/profiling.md.
"""

import atexit
import contextlib
import json
import os
import socket
import time

import numpy as np
from mpi4py import MPI

from .. import _runtime
from .._version import __version__

# Ping-pongs per rank and clock measurement, the best (shortest) of which
# gives the offset.
_SYNC_ROUNDS = 8
# A clock measurement gives up on ranks that do not answer in this long (a
# rank that died), so that the end of a recording never hangs.
_SYNC_TIMEOUT_S = 10.0
_SYNC_TAG = 7707

_recording = None


def _now():
    return _runtime.kernels_cpu().trace_now()


def _complete(requests, deadline):
    """Whether every request completed before ``deadline`` (cancels them if not)."""
    while not MPI.Request.Testall(requests):
        if time.monotonic() > deadline:
            for request in requests:
                with contextlib.suppress(MPI.Exception):
                    request.Cancel()
            return False
        time.sleep(0)
    return True


def measure_offsets(comm, rounds=_SYNC_ROUNDS, timeout_s=_SYNC_TIMEOUT_S):
    """Each rank's clock offset to rank 0's, by ping-pongs with rank 0 (collective).

    For each round, a rank sends its clock ``t0`` to rank 0, rank 0 answers
    with its clock ``t1``, and the rank reads ``t2`` on arrival; the round
    with the shortest ``t2 - t0`` gives the offset ``t1 - (t0 + t2) / 2``,
    uncertain by at most half that round trip.

    Args:
        comm: the communicator (rank 0 is the reference).
        rounds: ping-pongs per rank.
        timeout_s: how long to wait for a rank before giving up on it.

    Returns:
        ``(offset_ns, round_trip_ns, at_ns)`` for this rank: what to add to its
        clock to read rank 0's, the round trip it was measured with, and this
        rank's clock then; ``(0, 0, now)`` on rank 0, and ``None`` where the
        measurement timed out.
    """
    deadline = time.monotonic() + timeout_s
    rank = comm.Get_rank()
    ping = np.zeros(1, np.int64)
    pong = np.zeros(1, np.int64)
    if rank == 0:
        for peer in range(1, comm.Get_size()):
            for _ in range(rounds):
                if not _complete([comm.Irecv(ping, source=peer, tag=_SYNC_TAG)], deadline):
                    return (0, 0, _now())
                pong[0] = _now()
                if not _complete([comm.Isend(pong, dest=peer, tag=_SYNC_TAG)], deadline):
                    return (0, 0, _now())
        return (0, 0, _now())
    best = None
    for _ in range(rounds):
        ping[0] = t0 = _now()
        answer = comm.Irecv(pong, source=0, tag=_SYNC_TAG)
        if not _complete([comm.Isend(ping, dest=0, tag=_SYNC_TAG), answer], deadline):
            return None
        t2 = _now()
        sample = (int(pong[0]) - (t0 + t2) // 2, t2 - t0, t2)
        if best is None or sample[1] < best[1]:
            best = sample
    return best


class _Recording:
    """One recording: this rank's two files and the communicator it measures clocks on."""

    def __init__(self, directory):
        self.directory = os.fspath(directory)
        self.comm = MPI.COMM_WORLD.Dup()
        rank = self.comm.Get_rank()
        os.makedirs(self.directory, exist_ok=True)
        stem = os.path.join(self.directory, f"rank{rank:05d}")
        # Line-buffered: every line reaches the file as it is written, so a
        # killed process leaves the lines it wrote.
        self.meta = open(stem + ".meta.jsonl", "w", buffering=1, encoding="utf-8")  # noqa: SIM115
        self._line(
            type="header",
            version=1,
            rank=rank,
            size=self.comm.Get_size(),
            host=MPI.Get_processor_name() or socket.gethostname(),
            pid=os.getpid(),
            clock_ns=_now(),
            wall_ns=time.time_ns(),
            proc_null=MPI.PROC_NULL,
            any_source=MPI.ANY_SOURCE,
            any_tag=MPI.ANY_TAG,
            jaxcomm=__version__,
        )
        for site, text in _runtime.sites().items():
            self.note_site(site, text)
        self._clock("start")
        _runtime.site_listener = self.note_site
        _runtime.kernels_cpu().start_trace(stem + ".bin")

    def _line(self, **fields):
        self.meta.write(json.dumps(fields) + "\n")

    def note_site(self, site, text):
        self._line(type="site", id=site, text=text)

    def _clock(self, when):
        measured = measure_offsets(self.comm)
        if measured is None:
            self._line(type="clock", when=when, failed=True)
        else:
            offset, round_trip, at = measured
            self._line(
                type="clock", when=when, offset_ns=offset, round_trip_ns=round_trip, at_ns=at
            )

    def flush(self):
        _runtime.kernels_cpu().flush_trace()

    def close(self):
        try:
            # Calls dispatched but not yet run belong to this recording.
            _runtime.sync()
        finally:
            _runtime.kernels_cpu().stop_trace()
            _runtime.site_listener = None
            self._clock("end")
            self._line(type="end", clock_ns=_now(), wall_ns=time.time_ns())
            self.meta.close()
            # Once the recording stops on a rank, every rank's files are
            # whole (a rank that died is not waited for).
            _complete([self.comm.Ibarrier()], time.monotonic() + _SYNC_TIMEOUT_S)
            self.comm.Free()


def start(directory) -> None:
    """Start recording this rank's MPI calls to ``directory`` (collective over ``MPI.COMM_WORLD``).

    Every rank of ``MPI.COMM_WORLD`` must call it, and later :func:`stop`.
    ``directory`` is created if needed; each rank writes its own files
    there, replacing those of an earlier recording.

    Args:
        directory: where the ranks write their files (the same on every rank).

    Raises:
        RuntimeError: a recording is already running.
    """
    global _recording
    if _recording is not None:
        raise RuntimeError(
            f"jaxcomm.trace: already recording to {_recording.directory}; stop that recording first"
        )
    _recording = _Recording(directory)


def stop() -> None:
    """Stop the recording :func:`start` began and close its files (collective).

    When it returns, every rank's files are complete.

    Raises:
        RuntimeError: nothing is being recorded.
    """
    global _recording
    if _recording is None:
        raise RuntimeError("jaxcomm.trace: nothing is being recorded")
    recording, _recording = _recording, None
    recording.close()


def flush() -> None:
    """Write the spans recorded so far to this rank's file (no-op when not recording).

    The kernels write their spans whenever their ring of 4096 fills or half
    a second after the oldest unwritten one, so a process killed while busy
    loses at most about that much; a program can flush at points it wants
    kept for sure.
    """
    if _recording is not None:
        _recording.flush()


def recording() -> bool:
    """Whether a recording is running in this process."""
    return _recording is not None


@contextlib.contextmanager
def trace(directory):
    """Record every MPI call jaxcomm makes inside the block (collective over ``MPI.COMM_WORLD``).

    Each rank writes one span per MPI call to ``directory``, and the clock
    offsets to rank 0 measured at the start and at the end.
    ``python -m jaxcomm.trace DIR`` merges and summarises the files.

    Args:
        directory: where the ranks write their files (the same on every rank).

    Yields:
        ``directory``.

    Raises:
        RuntimeError: a recording is already running.

    Example:
        >>> with jaxcomm.trace("trace-out"):  # doctest: +SKIP
        ...     step(x).block_until_ready()
    """
    start(directory)
    try:
        yield directory
    finally:
        stop()


def _stop_at_exit():
    if _recording is not None and MPI.Is_initialized() and not MPI.Is_finalized():
        stop()


def start_from_environment() -> None:
    """Start recording to ``$JAXCOMM_TRACE`` if it is set (at import); stop at exit."""
    directory = os.environ.get("JAXCOMM_TRACE", "")
    if directory:
        start(directory)
        # Registered after mpi4py's finalisation and jaxcomm's own exit hook,
        # so it runs before both.
        atexit.register(_stop_at_exit)
