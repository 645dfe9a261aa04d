"""The hooks that end the whole MPI job when one rank's program fails.

An exception that ends one rank's program leaves the other ranks waiting for
it in their next collective or receive, and the job hangs until the batch
system's time limit. So importing jaxcomm installs a ``sys.excepthook`` and
a ``threading.excepthook`` that print the traceback and then call
``MPI_Abort``, and a ``sys.exit`` whose ``SystemExit`` does the same when
nothing caught it and its status is not 0. ``JAXCOMM_ABORT_ON_EXCEPTION=0``
or :func:`abort_on_exception` with ``False`` keeps mpi4py's plain behaviour,
and interactive sessions are left alone.
"""

import os
import socket
import sys
import threading
import time

from mpi4py import MPI

# The hooks that were in place when ours were installed: ours print through
# them. None while ours is in no chain of hooks.
_previous = None
_previous_thread = None
_enabled = False
_FORWARDING_SECONDS = 0.5
# Seconds a process whose MPI_Abort returned waits before it ends itself.
_ABORT_GRACE_SECONDS = 2.0
ENVIRONMENT_VARIABLE = "JAXCOMM_ABORT_ON_EXCEPTION"
# The kernels module, once loaded (_runtime): it tells the peers of a non-zero
# exit status and ends the process where MPI_Abort returns.
_kernels = None


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
    """Write ``reason`` on stderr, give the launcher time to forward it, and ``MPI_Abort``.

    Never returns: where ``MPI_Abort`` returns (MPICH's does when its process
    manager cannot be reached), the process ends itself with ``status``
    after a bounded wait.
    """
    rank = MPI.COMM_WORLD.Get_rank()
    sys.stderr.write(
        f"jaxcomm: {reason} on rank {rank} (world) on host {socket.gethostname()}: "
        "aborting the MPI job\n"
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
    if _kernels is not None:
        _kernels.abort_or_exit(status)
    MPI.COMM_WORLD.Abort(status)
    sys.stderr.write(
        f"jaxcomm: MPI_Abort returned on rank {rank}: this process ends itself with "
        f"status {status} in {_ABORT_GRACE_SECONDS:g} s\n"
    )
    sys.stderr.flush()
    time.sleep(_ABORT_GRACE_SECONDS)
    os._exit(status)


def _abort_hook(kind, value, traceback):
    (_previous or sys.__excepthook__)(kind, value, traceback)
    if aborting():
        abort_job(f"uncaught {kind.__name__}")


def _thread_abort_hook(args):
    (_previous_thread or threading.__excepthook__)(args)
    # SystemExit ends a thread quietly, on purpose (threading's own rule).
    if aborting() and args.exc_type is not SystemExit:
        name = args.thread.name if args.thread is not None else "a thread"
        abort_job(f"uncaught {args.exc_type.__name__} in thread {name!r}")


def _status_of(code) -> int:
    """The exit status Python ends with for ``sys.exit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    return 1  # Python prints any other code and exits with 1


class _ExitRequest(SystemExit):
    """The ``SystemExit`` jaxcomm's ``sys.exit`` raises: it notices when nothing caught it.

    Python fixes the exit status of ``sys.exit(n)`` before it finalises, and
    no hook sees it; mpi4py's ``MPI_Finalize`` at exit then waits for every
    other rank, which may wait for this one: the job would hang. An
    exception that nothing caught is freed by the interpreter itself, with
    no Python frame left on the stack, just before it exits; one that
    a program caught is freed in the program's frames.
    """

    def __del__(self):
        status = _status_of(self.code)
        if status == 0 or sys.is_finalizing() or not aborting():
            return
        try:
            sys._getframe(1)
        except ValueError:
            abort_job(f"sys.exit({self.code!r})", status)


def _exit(status=None, /):
    raise _ExitRequest(status)


_exit.__doc__ = sys.exit.__doc__
_plain_exit = sys.exit


def use_kernels(kernels) -> None:
    """Hand over the kernels module, which says goodbye to the peers at exit."""
    global _kernels
    _kernels = kernels
    _kernels.set_announce_failures(_enabled)


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

    The same holds for an exception that escapes another thread
    (``threading.excepthook``), and for ``sys.exit(n)`` with ``n != 0``
    that nothing caught (the job ends with status ``n``; a rank that
    exited would otherwise wait in ``MPI_Finalize`` for ranks that wait for
    it). A ``SystemExit`` the program catches, ``sys.exit(0)`` and
    ``SystemExit`` in a thread end nothing. Where ``MPI_Abort`` returns
    (MPICH's, when its process manager cannot be reached), the process ends
    itself with the same status two seconds later.

    Interactive sessions (the REPL, ``python -i``, IPython, Jupyter) are
    never aborted. ``JAXCOMM_ABORT_ON_EXCEPTION=0`` in the environment
    turns all of this off from the start (mpi4py's plain behaviour); a
    non-zero exit status is then no longer announced to the peer watch
    (docs/errors.md) either.

    Args:
        enabled: ``True`` turns the hooks on (installing them where they
            are not in place); ``False`` turns them off: it puts back the
            ``sys.excepthook``, ``threading.excepthook`` and ``sys.exit``
            that were in place before, or, when another hook has since
            been installed over one of jaxcomm's, leaves jaxcomm's in that
            chain doing nothing but passing the exception on.

    Example:
        >>> import jax.numpy as jnp
        >>> import jaxcomm
        >>> jc = jaxcomm.JaxComm()
        >>> if jc.rank == 1:
        ...     raise ValueError("bad input")  # every rank ends, non-zero
        >>> jc.allreduce(jnp.ones(3))  # rank 0 would otherwise wait here forever
        >>> jaxcomm.abort_on_exception(False)  # mpi4py's plain behaviour from now on
    """
    global _previous, _previous_thread, _enabled
    _enabled = bool(enabled)
    if _kernels is not None:
        _kernels.set_announce_failures(_enabled)
    if _enabled and _previous is None:
        _previous = sys.excepthook
        sys.excepthook = _abort_hook
    elif not _enabled and sys.excepthook is _abort_hook:
        sys.excepthook = _previous
        _previous = None
    if _enabled and sys.exit is _plain_exit:
        sys.exit = _exit
    elif not _enabled and sys.exit is _exit:
        sys.exit = _plain_exit
    if _enabled and _previous_thread is None:
        _previous_thread = threading.excepthook
        threading.excepthook = _thread_abort_hook
    elif not _enabled and threading.excepthook is _thread_abort_hook:
        threading.excepthook = _previous_thread
        _previous_thread = None


def switched_on(variable: str) -> bool:
    """Whether the environment ``variable`` leaves a failure handler on: unset or 1, not 0."""
    text = os.environ.get(variable) or "1"
    if text not in ("0", "1"):
        raise ValueError(f"{variable} must be 0 (off) or 1 (on), got {text!r}")
    return text == "1"


abort_on_exception(switched_on(ENVIRONMENT_VARIABLE))
