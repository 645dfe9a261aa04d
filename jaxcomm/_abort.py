"""The hook that ends the whole MPI job when an exception escapes on one rank.

An exception that ends one rank's program leaves the other ranks waiting for
it in their next collective or receive, and the job hangs until the batch
system's time limit. So importing jaxcomm installs a ``sys.excepthook`` that
prints the traceback and then calls ``MPI_Abort``; ``JAXCOMM_ABORT_ON_EXCEPTION=0``
or :func:`abort_on_exception` with ``False`` keeps mpi4py's plain behaviour,
and interactive sessions are left alone.
"""

import os
import sys
import time

from mpi4py import MPI

# The hook that was in place when ours was installed: ours prints through it.
# None while ours is in no chain of hooks.
_previous = None
_enabled = False
_FORWARDING_SECONDS = 0.5
ENVIRONMENT_VARIABLE = "JAXCOMM_ABORT_ON_EXCEPTION"


def interactive() -> bool:
    """Whether this process is an interactive session, where an exception ends no program.

    The plain REPL, ``python -i`` and ``PYTHONINSPECT`` (whose prompt follows
    the script), IPython and Jupyter kernels.
    """
    if hasattr(sys, "ps1") or getattr(sys.flags, "interactive", 0):
        return True
    if getattr(sys.flags, "inspect", 0):
        return True
    ipython = sys.modules.get("IPython")
    get_ipython = getattr(ipython, "get_ipython", None)
    return get_ipython is not None and get_ipython() is not None


def aborting() -> bool:
    """Whether a failure that ends this rank's program should end the whole job now."""
    return _enabled and not interactive() and MPI.Is_initialized() and not MPI.Is_finalized()


def abort_job(reason: str, status: int = 1) -> None:
    """Write ``reason`` on stderr, give the launcher time to forward it, and ``MPI_Abort``."""
    rank = MPI.COMM_WORLD.Get_rank()
    sys.stderr.write(f"jaxcomm: {reason} on rank {rank} (world): aborting the MPI job\n")
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
    MPI.COMM_WORLD.Abort(status)


def _abort_hook(kind, value, traceback):
    (_previous or sys.__excepthook__)(kind, value, traceback)
    if aborting():
        abort_job(f"uncaught {kind.__name__}")


def abort_on_exception(enabled: bool = True) -> None:
    """End the whole MPI job when an exception escapes on any rank (the default).

    An exception that ends one rank's program leaves the other ranks waiting
    for it in their next collective or receive: the job would hang until the
    batch system's time limit. So, from its import on, jaxcomm prints the
    traceback of an exception that escapes the main thread as usual, then a
    line ``jaxcomm: uncaught ValueError on rank 1 (world): aborting the MPI
    job``, and half a second later (for the launcher to forward the output)
    calls ``MPI_Abort`` on ``MPI_COMM_WORLD`` with error code 1, which ends
    every rank of the job with a non-zero exit status. A failure of an MPI
    call that no one was told of before exit (``jaxcomm.sync``) ends the
    job the same way.

    Interactive sessions (the REPL, ``python -i``, IPython, Jupyter) are
    never aborted. ``sys.exit()`` with a non-zero code and exceptions in
    other threads do not reach the hook (a thread's exception ends only that
    thread); ``python -m mpi4py script.py`` aborts on a non-zero
    ``sys.exit`` too. ``JAXCOMM_ABORT_ON_EXCEPTION=0`` in the environment
    turns the hook off from the start (mpi4py's plain behaviour).

    Args:
        enabled: ``True`` turns the hook on (installing it where it is not
            in place); ``False`` turns it off: it puts back the
            ``sys.excepthook`` that was in place before, or, when another
            hook has since been installed over jaxcomm's, leaves jaxcomm's
            in that chain doing nothing but passing the exception on.

    Example:
        >>> import jax.numpy as jnp
        >>> import jaxcomm
        >>> jc = jaxcomm.JaxComm()
        >>> if jc.rank == 1:
        ...     raise ValueError("bad input")  # every rank ends, non-zero
        >>> jc.allreduce(jnp.ones(3))  # rank 0 would otherwise wait here forever
        >>> jaxcomm.abort_on_exception(False)  # mpi4py's plain behaviour from now on
    """
    global _previous, _enabled
    _enabled = bool(enabled)
    if _enabled and _previous is None:
        _previous = sys.excepthook
        sys.excepthook = _abort_hook
    elif not _enabled and sys.excepthook is _abort_hook:
        sys.excepthook = _previous
        _previous = None


def _from_environment():
    text = os.environ.get(ENVIRONMENT_VARIABLE) or "1"
    if text not in ("0", "1"):
        raise ValueError(f"{ENVIRONMENT_VARIABLE} must be 0 (off) or 1 (on), got {text!r}")
    return text == "1"


abort_on_exception(_from_environment())
