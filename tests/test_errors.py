"""Real MPI errors, raised in Python on the rank where they happen, and the end of a job.

Each failing case is local to one rank (rank 1 receives a message larger than
its buffer: ``MPI_ERR_TRUNCATE``) and every rank completes its part: the
sender's messages are small enough for MPI to deliver eagerly, so its sends
return whether or not the receive fails. Afterwards every rank communicates
again, to show the failure left the communicator usable.

The tests that start jobs of their own (the end of a job: work in flight at
exit, a failure pending at exit, ``jaxcomm.abort_on_exception``) run in the
plain ``pytest`` run.
"""

import re
import subprocess
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    RUNTIME_ERRORS,
    environment_without_launcher,
    mpiexec,
    not_reported_again,
    run_job,
    spawns_own_mpi,
    unmonitored,
)
from jax import lax
from mpi4py import MPI

import jaxcomm
from jaxcomm import _abort, _compat

# MPI's own errors, which the checker would report (earlier) as mismatches.
pytestmark = unmonitored


def truncated(function):
    """The message of ``function``'s MPI_ERR_TRUNCATE on rank 1: function, rank and MPI's reason.

    MPI libraries word their reasons differently (and MPICH appends an error
    stack), so the reason is the library's own string for the error class.
    """
    reason = re.escape(MPI.Get_error_string(MPI.ERR_TRUNCATE))
    return rf"jaxcomm: {function} failed on rank 1: {reason}"


def still_usable(jc):
    """Every rank communicates again: eager and jitted, collective and point to point."""
    np.testing.assert_array_equal(jc.allreduce(jnp.ones(2)), np.full(2, jc.size))
    right, left = (jc.rank + 1) % jc.size, (jc.rank - 1) % jc.size
    ring = jax.jit(lambda x: jc.sendrecv(x, x, source=left, dest=right))
    np.testing.assert_array_equal(ring(jnp.full(3, jc.rank)), np.full(3, left))
    jaxcomm.sync()


@pytest.mark.mpi(min_size=2)
def test_truncated_receive_eager(jc):
    if jc.rank == 0:
        jc.send(jnp.arange(10.0, dtype=jnp.float32), 1, tag=21)
    elif jc.rank == 1:
        with pytest.raises(RUNTIME_ERRORS, match=truncated("MPI_Recv")):
            np.asarray(jc.recv(jnp.zeros(5, jnp.float32), source=0, tag=21))
        not_reported_again()
    still_usable(jc)


@pytest.mark.mpi(min_size=2)
def test_truncated_receive_jitted(jc):
    # Shapes agree on each rank; they differ between the sender and the
    # receiver, which only MPI sees.
    if jc.rank == 0:
        step = jax.jit(lambda x: jc.send(x, 1, tag=22))
    else:
        step = jax.jit(lambda x: jc.recv(x[:5], source=0, tag=22))
    x = jnp.arange(10.0, dtype=jnp.float32)
    # The first call takes JAX's Python dispatch, the second its C++ path.
    for _ in range(2):
        if jc.rank == 1:
            with pytest.raises(RUNTIME_ERRORS, match=truncated("MPI_Recv")):
                step(x).block_until_ready()
            not_reported_again()
        elif jc.rank == 0:
            step(x)
    still_usable(jc)


@pytest.mark.mpi(min_size=2)
def test_truncated_receive_in_a_loop(jc):
    # Rank 0 sends 10 elements in each of 3 iterations; rank 1 receives them
    # whole, but only 5 in the last one, so nothing is left unreceived.
    trips = 3

    def body(i, carry):
        if jc.rank == 0:
            jc.send(jnp.arange(10.0, dtype=jnp.float32) + i, 1, tag=23)
            return carry
        if jc.rank == 1:
            got = lax.cond(
                i == trips - 1,
                lambda: jc.recv(jnp.zeros(5, jnp.float32), source=0, tag=23),
                lambda: jc.recv(jnp.zeros(10, jnp.float32), source=0, tag=23)[:5],
            )
            return carry + got
        return carry

    loop = jax.jit(lambda: lax.fori_loop(0, trips, body, jnp.zeros(5, jnp.float32)))
    if jc.rank == 1:
        with pytest.raises(RUNTIME_ERRORS, match=truncated("MPI_Recv")):
            loop().block_until_ready()
        not_reported_again()
    else:
        loop().block_until_ready()
    still_usable(jc)


@pytest.mark.mpi(min_size=2)
def test_truncated_sendrecv(jc):
    # Ranks 0 and 1 exchange 10 and 5 elements: rank 0 receives 5 of its 10
    # (the rest zeros), rank 1 cannot take 10.
    if jc.rank in (0, 1):
        n = 10 if jc.rank == 0 else 5
        peer = 1 - jc.rank
        x = jnp.ones(n, jnp.float32)
        exchange = jax.jit(
            lambda x: jc.sendrecv(x, x, source=peer, dest=peer, sendtag=24, return_status=True)
        )
        if jc.rank == 1:
            with pytest.raises(RUNTIME_ERRORS, match=truncated("MPI_Sendrecv")):
                exchange(x)[0].block_until_ready()
            not_reported_again()
        else:
            y, status = exchange(x)
            np.testing.assert_array_equal(y, np.r_[np.ones(5), np.zeros(5)])
            assert np.asarray(status).tolist() == [1, 24, 5]
    still_usable(jc)


@pytest.mark.mpi(min_size=2)
def test_receive_into_a_narrower_dtype_is_truncated(jc):
    # The same shape on both ranks; int32 elements do not fit int8 ones.
    x = jnp.arange(6, dtype=jnp.int32)
    if jc.rank == 0:
        jc.send(x, 1, tag=25)
    elif jc.rank == 1:
        with pytest.raises(RUNTIME_ERRORS, match=truncated("MPI_Recv")):
            np.asarray(jc.recv(x.astype(jnp.int8), source=0, tag=25))
        not_reported_again()
    still_usable(jc)


@pytest.mark.mpi(min_size=2)
@pytest.mark.skipif(
    not _compat.fast_dispatch_enabled,
    reason="with runtime tokens, JAX keeps the failure in the token, failing every later call",
)
def test_failure_of_a_computation_without_outputs_is_raised_by_sync(jc):
    # Rank 1's computation returns nothing, and receives after a matrix
    # product: it fails after its call returned, with nowhere to report to.
    product = jnp.ones((256, 256), jnp.float32)

    @jax.jit
    def step(m):
        jc.recv(jnp.zeros(5, jnp.float32) * jnp.sin(m @ m).sum(), source=0, tag=27)

    for n in (5, 10):
        if jc.rank == 0:
            jc.send(jnp.ones(n, jnp.float32), 1, tag=27)
        elif jc.rank == 1:
            try:
                step(product)
            except RUNTIME_ERRORS:
                pass
    if jc.rank == 1:
        with pytest.raises(RuntimeError, match="earlier failed: " + truncated("MPI_Recv")):
            jaxcomm.sync()
    jaxcomm.sync()
    still_usable(jc)


@pytest.mark.mpi(min_size=2)
def test_a_failure_read_from_the_results_is_raised_once(jc):
    # Rank 1's computation receives after a matrix product: XLA runs it on
    # one of its threads after the call returned, and JAX raises the failure
    # from its result. The program had it: sync() and later calls do not
    # raise it again.
    product = jnp.ones((256, 256), jnp.float32)
    step = jax.jit(
        lambda m: jc.recv(jnp.zeros(5, jnp.float32) * jnp.sin(m @ m).sum(), source=0, tag=29)
    )
    caught = []
    for n in (5, 10, 5):
        if jc.rank == 0:
            jc.send(jnp.ones(n, jnp.float32), 1, tag=29)
        elif jc.rank == 1:
            try:
                np.asarray(step(product))
            except RUNTIME_ERRORS as err:
                caught.append(str(err))
    try:
        jaxcomm.sync()
        again = None
    except RuntimeError as err:
        again = err
    still_usable(jc)
    assert again is None, again
    if jc.rank == 1:
        assert len(caught) == 1 and re.search(truncated("MPI_Recv"), caught[0]), caught


# abort_on_exception ---------------------------------------------------------


@pytest.fixture
def excepthook():
    """Restore the hooks (sys.excepthook, threading.excepthook, sys.exit) and jaxcomm's state."""
    saved = (
        sys.excepthook,
        threading.excepthook,
        sys.exit,
        _abort._previous,
        _abort._previous_thread,
        _abort._enabled,
    )
    yield
    (
        sys.excepthook,
        threading.excepthook,
        sys.exit,
        _abort._previous,
        _abort._previous_thread,
        _abort._enabled,
    ) = saved


def test_abort_on_exception_is_installed_at_import(excepthook):
    # The suite's processes import jaxcomm without JAXCOMM_ABORT_ON_EXCEPTION.
    assert sys.excepthook is _abort._abort_hook and _abort._enabled
    # pytest puts its own threading.excepthook in place during each test.
    assert _abort._previous_thread is not None
    assert sys.exit is _abort._exit


def test_abort_on_exception_installs_once_and_uninstalls(excepthook):
    jaxcomm.abort_on_exception(False)
    original = sys.excepthook
    assert original is not _abort._abort_hook
    jaxcomm.abort_on_exception()
    installed = sys.excepthook
    assert installed is _abort._abort_hook
    jaxcomm.abort_on_exception()
    assert sys.excepthook is installed
    jaxcomm.abort_on_exception(False)
    assert sys.excepthook is original
    assert threading.excepthook is not _abort._thread_abort_hook
    assert sys.exit is _abort._plain_exit
    jaxcomm.abort_on_exception(False)
    assert sys.excepthook is original


def test_abort_on_exception_stays_in_a_chain_of_hooks(excepthook):
    seen = []
    jaxcomm.abort_on_exception()
    ours = sys.excepthook

    def later(*info):
        seen.append(info[0])
        ours(*info)

    sys.excepthook = later
    jaxcomm.abort_on_exception(False)
    assert sys.excepthook is later
    # Disabled, jaxcomm's hook only passes the exception on (to the default
    # hook, which prints it); it must not abort this process.
    sys.excepthook(KeyError, KeyError("k"), None)
    assert seen == [KeyError]
    jaxcomm.abort_on_exception()
    assert sys.excepthook is later


@pytest.mark.parametrize("session", ["repl", "python -i", "ipython"])
def test_interactive_sessions_are_not_aborted(excepthook, monkeypatch, session):
    jaxcomm.abort_on_exception()
    if session == "repl":
        monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)
    elif session == "python -i":
        monkeypatch.setattr(sys, "flags", type("Flags", (), {"interactive": 1})())
    else:
        shell = type(sys)("IPython")
        shell.get_ipython = lambda: object()
        monkeypatch.setitem(sys.modules, "IPython", shell)
    assert _abort.interactive() and not _abort.aborting()
    # The hook prints and returns: an abort would end this test run.
    sys.excepthook(KeyError, KeyError("k"), None)


@spawns_own_mpi
def test_abort_on_exception_setting_is_checked(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", "import jaxcomm"],
        env=environment_without_launcher(JAXCOMM_ABORT_ON_EXCEPTION="no"),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode != 0
    assert "JAXCOMM_ABORT_ON_EXCEPTION must be 0 (off) or 1 (on), got 'no'" in done.stderr


# The end of a job -----------------------------------------------------------


@spawns_own_mpi
def test_work_in_flight_at_exit_finishes(tmp_path):
    # The script ends without waiting for its 30 steps; the kernels log each
    # MPI call on stderr (JAXCOMM_DEBUG) as it runs.
    steps = 30
    done, _ = run_job(
        tmp_path,
        f"""
        import os
        import jax, jax.numpy as jnp
        from jaxcomm import JaxComm

        jc = JaxComm()
        step = jax.jit(lambda m: jc.allreduce(jnp.tanh(m @ m)))
        m = jnp.full((384, 384), 1e-3, jnp.float32)
        for _ in range({steps}):
            m = step(m)
        # One write for the whole line: the kernels' log lines come from
        # another thread, and print() writes the text and its newline apart.
        os.write(2, f"rank {{jc.rank}}: dispatched\\n".encode())
        """,
        JAXCOMM_DEBUG="1",
    )
    assert done.returncode == 0, done.stderr
    for rank in range(2):
        lines = [
            line
            for line in done.stderr.splitlines()
            if line.startswith((f"r{rank} | MPI_Allreduce", f"rank {rank}: "))
        ]
        assert lines.count(f"rank {rank}: dispatched") == 1, done.stderr
        assert len(lines) == steps + 1, done.stderr
        # Some of the work was still in flight when the script ended.
        assert lines[-1] != f"rank {rank}: dispatched", done.stderr


@spawns_own_mpi
def test_failure_pending_at_exit_is_reported(tmp_path):
    # Rank 1's last computation fails after its call returned and nothing
    # waits for it: the exit hook reports it, and the job fails.
    done, _ = run_job(
        tmp_path,
        """
        import jax, jax.numpy as jnp
        from jaxcomm import JaxComm

        jc = JaxComm()
        product = jnp.ones((256, 256), jnp.float32)

        @jax.jit
        def step(m):
            jc.recv(jnp.zeros(5, jnp.float32) * jnp.sin(m @ m).sum(), source=0, tag=7)

        for n in (5, 10):
            if jc.rank == 0:
                jc.send(jnp.ones(n, jnp.float32), 1, tag=7)
            else:
                try:
                    step(product)
                except Exception as e:
                    print(f"rank 1 raised at the call: {e}", flush=True)
        print(f"rank {jc.rank} done", flush=True)
        """,
    )
    assert done.returncode not in (0, 124, 137), (done.returncode, done.stderr)
    assert "rank 0 done" in done.stdout and "rank 1 done" in done.stdout, done.stdout
    assert "jaxcomm: at exit: RuntimeError: an MPI call jaxcomm dispatched earlier failed: " in (
        done.stderr
    ), done.stderr
    assert "jaxcomm: MPI_Recv failed on rank 1: " in done.stderr, done.stderr
    assert "Exception ignored" not in done.stderr, done.stderr


@spawns_own_mpi
def test_a_failure_the_program_caught_leaves_the_exit_status_alone(tmp_path):
    # Rank 1 receives a message too long for its buffer, jitted and through
    # the compat module eagerly, catches the error and goes on: an error the
    # program was given is not reported again at exit, and the job succeeds.
    done, _ = run_job(
        tmp_path,
        """
        import numpy as np
        import jax, jax.numpy as jnp
        from jaxcomm import JaxComm
        import jaxcomm.compat.mpi4jax as mpi4jax

        jc = JaxComm()
        recv = jax.jit(lambda t: jc.recv(t, source=0, tag=7))
        for n in (5, 10, 10):
            if jc.rank == 0:
                jc.send(jnp.ones(n, jnp.float32), 1, tag=7)
            else:
                try:
                    recv(jnp.zeros(5, jnp.float32)).block_until_ready()
                except Exception as e:
                    print(f"rank 1 caught {type(e).__name__}", flush=True)
        if jc.rank == 0:
            mpi4jax.send(jnp.ones(10, jnp.float32), 1, tag=8)
        else:
            try:
                np.asarray(mpi4jax.recv(jnp.zeros(5, jnp.float32), 0, tag=8))
            except Exception as e:
                print(f"rank 1 caught {type(e).__name__}", flush=True)
        jc.barrier()
        print(f"rank {jc.rank} done", flush=True)
        """,
    )
    assert done.returncode == 0, (done.returncode, done.stderr)
    assert done.stdout.count("rank 1 caught") == 3, done.stdout
    assert "rank 0 done" in done.stdout and "rank 1 done" in done.stdout, done.stdout
    assert "at exit" not in done.stderr, done.stderr


CAUGHT_JOB = """
    import sys
    import numpy as np
    import jax, jax.numpy as jnp
    import jaxcomm
    from jaxcomm import JaxComm

    jc = JaxComm()
    product = jnp.ones((256, 256), jnp.float32)
    step = jax.jit(
        lambda m: jc.recv(jnp.zeros(5, jnp.float32) * jnp.sin(m @ m).sum(), source=0, tag=7)
    )
    for n in (5, 10, 5):
        if jc.rank == 0:
            jc.send(jnp.ones(n, jnp.float32), 1, tag=7)
        else:
            try:
                np.asarray(step(product))
            except Exception as e:
                print(f"rank 1 caught {type(e).__name__}", flush=True)
    total = np.asarray(jc.allreduce(jnp.ones(2)))
    if sys.argv[1:] == ["sync"]:
        jaxcomm.sync()
    print(f"rank {jc.rank} done {total}", flush=True)
"""


@spawns_own_mpi
@pytest.mark.parametrize("fast_dispatch", ["1", "0"])
@pytest.mark.parametrize("sync", [False, True])
def test_a_failure_read_from_the_results_leaves_the_exit_status_alone(
    tmp_path, fast_dispatch, sync
):
    done, _ = run_job(
        tmp_path, CAUGHT_JOB, *(["sync"] if sync else []), JAXCOMM_FAST_DISPATCH=fast_dispatch
    )
    assert done.returncode == 0, (done.returncode, done.stderr)
    assert done.stdout.count("rank 1 caught") == 1, done.stdout
    assert "rank 0 done [2. 2.]" in done.stdout and "rank 1 done [2. 2.]" in done.stdout
    assert "at exit" not in done.stderr, done.stderr


# A failed rank ends the job: drills. Rank 1 raises while rank 0 goes on
# communicating (or already waits for rank 1). Each drill asserts only that
# the job ended before its time limit, with a non-zero status and the
# traceback; the seconds it took are printed (pytest -s shows them).
DRILL_JOB = """
    import sys, time
    import jax, jax.numpy as jnp
    from mpi4py import MPI
    import jaxcomm

    drill = sys.argv[1]
    jc = jaxcomm.JaxComm()
    x = jnp.ones(1024, jnp.float32)


    def give_up(step):
        if jc.rank == 1:
            print(f"rank 1 raises at {time.time()}", flush=True)
            raise ValueError(f"rank 1 gives up at step {step}")


    if drill == "eager":
        for step in range(1000):
            if step == 20:
                give_up(step)
            x = jc.allreduce(x) / jc.size
    elif drill == "jitted loop":
        step_fn = jax.jit(lambda v: jax.lax.fori_loop(
            0, 10, lambda i, v: jc.allreduce(jnp.tanh(v)) / jc.size, v))
        for step in range(1000):
            if step == 20:
                give_up(step)
            x = step_fn(x)
    elif drill == "blocking call in flight":
        # Rank 0 waits in a receive (eager, then jitted) that only rank 1 could match.
        jc.allreduce(x).block_until_ready()
        if jc.rank == 0:
            jc.recv(x, source=1, tag=5).block_until_ready()
            jax.jit(lambda t: jc.recv(t, source=1, tag=6))(x).block_until_ready()
        time.sleep(0.5)
        give_up(0)
    elif drill == "nonblocking send in flight":
        # Rank 1's send (large: no eager delivery) is never received.
        big = jnp.ones(1 << 22, jnp.float32)
        if jc.rank == 1:
            request = jc.isend(big, 0, tag=9)
            give_up(0)
        jc.allreduce(x).block_until_ready()
    print(f"rank {jc.rank} finished", flush=True)
"""

DRILLS = ["eager", "jitted loop", "blocking call in flight", "nonblocking send in flight"]


def seconds_to_end(done):
    """Seconds from rank 1's raise to the end of the job (printed by the drills)."""
    raised = re.search(r"rank 1 raises at ([0-9.]+)", done.stdout)
    return time.time() - float(raised.group(1)) if raised else float("nan")


@spawns_own_mpi
@pytest.mark.parametrize("drill", DRILLS)
def test_an_uncaught_exception_ends_the_job(tmp_path, drill):
    done, _ = run_job(tmp_path, DRILL_JOB, drill, limit=120)
    print(f"{drill}: the job ended {seconds_to_end(done):.1f} s after rank 1 raised")
    assert done.returncode not in (0, 124, 137), (done.returncode, done.stderr)
    assert "Traceback" in done.stderr and "ValueError: rank 1 gives up" in done.stderr, done.stderr
    assert re.search(
        r"jaxcomm: uncaught ValueError on rank 1 \(world\) on host \S+: aborting the MPI job",
        done.stderr,
    ), done.stderr
    assert "rank 0 finished" not in done.stdout, done.stdout


# How long the negative control must still be running after rank 1 raised:
# the drills above end within a few seconds of it.
HANG_SECONDS = 15


@spawns_own_mpi
@pytest.mark.skipif(
    "MPICH" not in MPI.Get_library_version(), reason="the hang is shown with MPICH only"
)
def test_with_the_opt_out_the_job_hangs(tmp_path):
    # The negative control (JAXCOMM_ABORT_ON_EXCEPTION=0; abort_on_exception(False)
    # is the same switch): rank 0 waits in its collective, still waiting
    # HANG_SECONDS after rank 1 raised. Timed from the raise, not from the
    # launch, so a slow start-up neither shortens the hang shown nor fails it.
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(DRILL_JOB))
    with open(tmp_path / "stderr", "w+") as stderr:
        job = subprocess.Popen(
            ["timeout", "-k", "10", "120", *mpiexec(2), sys.executable, str(path), "eager"],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=environment_without_launcher(JAXCOMM_ABORT_ON_EXCEPTION="0"),
            cwd=tmp_path,
        )
        stdout = ""
        for line in job.stdout:
            stdout += line
            if line.startswith("rank 1 raises at"):
                break
        try:
            ended = job.wait(timeout=HANG_SECONDS)
        except subprocess.TimeoutExpired:
            ended = None
            job.terminate()  # timeout passes the signal on to mpiexec
            job.wait(timeout=60)
        stdout += job.stdout.read()
        job.stdout.close()
        stderr.seek(0)
        errors = stderr.read()
    assert "rank 1 raises at" in stdout, (stdout, errors)
    assert ended is None, (ended, errors)
    assert "ValueError: rank 1 gives up" in errors, errors
    assert "aborting" not in errors, errors
