"""The opt-in hook that ends the whole MPI job when one rank fails.

jaxcomm never calls ``MPI_Abort`` on its own (an exception on one rank is
that rank's to handle), so this hook is installed only on request.
"""

import sys
import time

from mpi4py import MPI

# The hook that was in place when ours was installed: ours prints through it.
# None while ours is in no chain of hooks.
_previous = None
_enabled = False
_FORWARDING_SECONDS = 0.5


def _abort_hook(kind, value, traceback):
    (_previous or sys.__excepthook__)(kind, value, traceback)
    if not _enabled or not MPI.Is_initialized() or MPI.Is_finalized():
        return
    rank = MPI.COMM_WORLD.Get_rank()
    sys.stderr.write(
        f"jaxcomm: uncaught {kind.__name__} on rank {rank} (world): aborting the MPI job "
        "(jaxcomm.abort_on_exception)\n"
    )
    # MPI_Abort kills the processes, so nothing buffered would be written;
    # and the launcher drops the output it had not forwarded yet when it ends
    # the job (a traceback lost now and then in the test suite), so it is
    # given a moment to forward it first.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    time.sleep(_FORWARDING_SECONDS)
    MPI.COMM_WORLD.Abort(1)


def abort_on_exception(enabled: bool = True) -> None:
    """End the whole MPI job when an exception escapes on any rank.

    An exception that ends one rank's program leaves the other ranks waiting
    for it in their next collective or receive: the job hangs until the batch
    system's time limit. With this hook, an uncaught exception on any rank
    prints its traceback as usual, then calls ``MPI_Abort`` on
    ``MPI_COMM_WORLD`` with error code 1, which ends every rank of the job
    with a non-zero exit status.

    jaxcomm never calls ``MPI_Abort`` on its own: this is opt-in. Call it
    once, early, on every rank. It installs a ``sys.excepthook``, so it
    covers exceptions that escape the main thread; ``sys.exit()`` with a
    non-zero code and exceptions in other threads do not reach that hook
    (``python -m mpi4py script.py`` aborts on those as well).

    Args:
        enabled: ``True`` installs the hook (again: nothing changes);
            ``False`` puts back the ``sys.excepthook`` that was in place
            before, or, when another hook has since been installed over
            jaxcomm's, leaves jaxcomm's in that chain doing nothing but
            passing the exception on.

    Example:
        >>> import jax.numpy as jnp
        >>> import jaxcomm
        >>> jaxcomm.abort_on_exception()
        >>> jc = jaxcomm.JaxComm()
        >>> if jc.rank == 1:
        ...     raise ValueError("bad input")  # every rank ends, non-zero
        >>> jc.allreduce(jnp.ones(3))  # rank 0 would otherwise wait here forever
    """
    global _previous, _enabled
    _enabled = bool(enabled)
    if _enabled and _previous is None:
        _previous = sys.excepthook
        sys.excepthook = _abort_hook
    elif not _enabled and sys.excepthook is _abort_hook:
        sys.excepthook = _previous
        _previous = None
