"""The hang watchdog (jaxcomm.set_timeout, JAXCOMM_TIMEOUT).

The hang tests start their own jobs (a planted hang would otherwise end the
test run), so they run in the plain ``pytest`` run.
"""

import os
import re
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import environment_without_launcher, mpiexec, spawns_own_mpi

import jaxcomm

PRELUDE = """
import sys, time
import jax, jax.numpy as jnp
from mpi4py import MPI
import jaxcomm
jc = jaxcomm.JaxComm(MPI.COMM_WORLD)
x = jnp.arange(4, dtype=jnp.float32)
jc.allreduce(x).block_until_ready()

def say(*words):
    # One write per line: print() writes text and newline apart, and mpiexec
    # may interleave the ranks' pieces.
    sys.stdout.write(" ".join(map(str, words)) + "\\n")
    sys.stdout.flush()
"""

INTERRUPT_SOON = """
import os, signal, threading
def interrupt_soon(seconds):
    threading.Timer(seconds, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
"""


def _run_job(tmp_path, body, *, ranks=2, timeout=120, **env):
    script = tmp_path / "job.py"
    script.write_text(PRELUDE + INTERRUPT_SOON + textwrap.dedent(body))
    start = time.monotonic()
    done = subprocess.run(
        [*mpiexec(ranks), sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environment_without_launcher(**env),
        cwd=tmp_path,
    )
    return done, time.monotonic() - start, str(script)


def _line_of(script, text):
    with open(script) as f:
        return next(i for i, line in enumerate(f, 1) if text in line)


@spawns_own_mpi
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_planted_hang_ends_the_job_with_a_diagnosis(tmp_path, jit):
    # Rank 0 waits for a message rank 1 never sends; rank 1 sleeps in Python,
    # so only rank 0's watchdog can fire, and its report is the diagnosis.
    body = f"""
    def recv(t):
        return jc.recv(t, source=1, tag=7)  # the planted hang
    if {jit}:
        recv = jax.jit(recv)
    if jc.rank == 0:
        print(recv(x))
    else:
        time.sleep(60)
    """
    done, seconds, script = _run_job(tmp_path, body, JAXCOMM_TIMEOUT="2")
    assert done.returncode != 0, (done.stdout, done.stderr)
    line = _line_of(script, "the planted hang")
    site = f"{script}:{line}"
    assert re.search(r"jaxcomm watchdog: rank 0 on host \S+ has waited", done.stderr), done.stderr
    assert "recv from rank 1 (tag 7, up to count 4 float32)" in done.stderr, done.stderr
    assert site in done.stderr, (site, done.stderr)
    assert "longer than the timeout of 2 s" in done.stderr
    # Two seconds, at most one more before the watchdog looks, then the abort;
    # the rest is start-up. Without the watchdog the job would wait 60 s.
    assert seconds < 45, seconds


@spawns_own_mpi
@pytest.mark.parametrize("how", ["JaxComm", "compat"])
def test_a_rank_that_never_joins_a_jaxcomm_s_creation_is_diagnosed(tmp_path, how):
    # Creating a JaxComm clones its communicator, a collective; rank 1,
    # asleep in Python, never joins it. Through the compat module the
    # creation is the first call on a communicator.
    create = {
        "JaxComm": "jaxcomm.JaxComm(sub)",
        "compat": "mpi4jax.send(x, 1, comm=sub)",
    }[how]
    body = f"""
    import jaxcomm.compat.mpi4jax as mpi4jax
    sub = MPI.COMM_WORLD.Dup()
    if jc.rank == 0:
        {create}  # the creation that hangs
    else:
        time.sleep(60)
    """
    done, seconds, script = _run_job(tmp_path, body, JAXCOMM_TIMEOUT="2")
    assert done.returncode != 0, (done.stdout, done.stderr)
    line = _line_of(script, "the creation that hangs")
    assert re.search(r"jaxcomm watchdog: rank 0 on host \S+ has waited", done.stderr), done.stderr
    assert (
        f"in JaxComm creation (MPI_Comm_dup, collective) at {script}:{line} (<module>) "
        "on a communicator of 2 ranks (rank 0 there)"
    ) in done.stderr, done.stderr
    assert seconds < 45, seconds


@spawns_own_mpi
def test_ragged_start_hang_names_the_start(tmp_path):
    # Rank 1 never starts the exchange: rank 0 waits in the start's header
    # exchange, which the watchdog names with the start's call site.
    body = """
    if jc.rank == 0:
        zeros = jnp.zeros(2, jnp.int32)
        start = jax.jit(lambda x: jc.wait(jc.iragged_all_to_all(x, x, zeros, zeros, zeros, zeros)))
        start(x).block_until_ready()
    else:
        time.sleep(60)
    """
    done, seconds, script = _run_job(tmp_path, body, JAXCOMM_TIMEOUT="2")
    assert done.returncode != 0
    line = _line_of(script, "jc.iragged_all_to_all(")
    assert re.search(r"jaxcomm watchdog: rank 0 on host \S+ has waited", done.stderr), done.stderr
    assert "iragged_all_to_all" in done.stderr, done.stderr
    assert f"{script}:{line}" in done.stderr, done.stderr
    assert seconds < 45, seconds


@spawns_own_mpi
def test_collective_hang_inside_a_loop(tmp_path):
    # Rank 1 leaves the loop early: rank 0 waits in the loop's last allreduce.
    body = """
    steps = 5 if jc.rank == 0 else 4
    loop = jax.jit(lambda x, n: jax.lax.fori_loop(0, n, lambda i, c: jc.allreduce(c) / 2, x))
    print(loop(x, steps))
    if jc.rank != 0:
        time.sleep(60)
    """
    done, seconds, script = _run_job(tmp_path, body, JAXCOMM_TIMEOUT="2")
    assert done.returncode != 0
    line = _line_of(script, "lambda i, c: jc.allreduce(c)")
    assert re.search(r"jaxcomm watchdog: rank 0 on host \S+ has waited", done.stderr), done.stderr
    assert f"allreduce(op SUM, count 4 float32) at {script}:{line}" in done.stderr, done.stderr
    assert seconds < 45, seconds


@spawns_own_mpi
def test_set_timeout_from_python_and_slow_calls_that_finish(tmp_path):
    # A call that waits 1.5 s for its peer finishes under a 3 s timeout, and
    # so do jitted calls over 4 s; the watchdog then goes off and a longer
    # wait is harmless.
    body = """
    jaxcomm.set_timeout(3)
    for delay in (0.0, 1.5, 0.0):
        if jc.rank == 1:
            time.sleep(delay)
        y = jc.bcast(x + jc.rank, root=1)
    # A new program for each call (compiled while the peer may wait), for
    # longer in all than the timeout: the watchdog times each call, not the
    # run of them. Rank 0's clock decides when the run ends, for every rank.
    end = time.monotonic() + 4
    while True:
        y = jax.jit(jc.allreduce)(y) / jc.size
        if not jc.bcast(jnp.asarray(time.monotonic() < end), root=0):
            break
    jaxcomm.set_timeout(None)
    if jc.rank == 1:
        time.sleep(4)
    jc.barrier()
    say("result", y.tolist())
    """
    done, _, _ = _run_job(tmp_path, body)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("result [1.0, 2.0, 3.0, 4.0]") == 2, done.stdout
    assert "watchdog" not in done.stderr


@pytest.mark.parametrize(
    "seconds, error, match",
    [
        ("2", TypeError, "seconds must be a number or None, got str"),
        (True, TypeError, "got bool"),
        (-1, ValueError, "seconds must be a positive number"),
        (float("inf"), ValueError, "seconds must be a positive number"),
        (float("nan"), ValueError, "seconds must be a positive number"),
    ],
)
def test_set_timeout_rejects_bad_values(seconds, error, match):
    with pytest.raises(error, match=match):
        jaxcomm.set_timeout(seconds)


@spawns_own_mpi
def test_bad_environment_value_is_refused():
    done = subprocess.run(
        [sys.executable, "-c", "import jaxcomm"],
        capture_output=True,
        text=True,
        timeout=120,
        env=environment_without_launcher(JAXCOMM_TIMEOUT="soon"),
        cwd=os.path.dirname(sys.executable),
    )
    assert done.returncode != 0
    assert "JAXCOMM_TIMEOUT must be a number of seconds, got 'soon'" in done.stderr


# Interrupts -------------------------------------------------------------------


@spawns_own_mpi
def test_interrupt_while_blocked_in_mpi_ends_the_job(tmp_path):
    body = """
    if jc.rank == 0:
        interrupt_soon(2)
        print(jc.recv(x, source=1, tag=7))  # blocked here
    else:
        time.sleep(60)
    """
    done, seconds, script = _run_job(tmp_path, body)
    assert done.returncode != 0
    line = _line_of(script, "blocked here")
    assert (
        f"jaxcomm: interrupted (SIGINT) on rank 0 while it waits in an MPI call made at "
        f"{script}:{line}" in done.stderr
    ), done.stderr
    # Without jaxcomm's interrupt thread the job waits out rank 1's 60 s.
    assert seconds < 45, seconds


@spawns_own_mpi
def test_interrupt_outside_mpi_raises_keyboard_interrupt(tmp_path):
    body = """
    y = jc.allreduce(x)
    try:
        interrupt_soon(0.5)
        time.sleep(30)
    except KeyboardInterrupt:
        say("KeyboardInterrupt on rank", jc.rank)
    say("result", jc.allreduce(y).tolist())
    """
    done, _, _ = _run_job(tmp_path, body)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("KeyboardInterrupt on rank") == 2, done.stdout
    assert done.stdout.count("result [0.0, 4.0, 8.0, 12.0]") == 2, done.stdout
