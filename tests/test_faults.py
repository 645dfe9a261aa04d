"""A rank that ends, dies or falls silent ends the whole job, promptly and with a message.

Each test starts a job of its own (so they run in the plain ``pytest`` run):
the last rank fails in a jitted loop of ``allreduce`` while the others go on
calling it, and the job must end within the time limit, with a non-zero
status and a line naming the rank, its host and the call. Faults that MPI
itself does not report (a killed process, a process stopped as by a
partition) are shown where the launcher does not end the job either:
MPICH's ``mpiexec -disable-auto-cleanup``, as ``srun`` without
``--kill-on-bad-exit`` does.
"""

import re
import shutil
import subprocess
import sys

import pytest
from conftest import mpiexec, run_job, spawns_own_mpi
from mpi4py import MPI

from jaxcomm import _abort

FAULT_JOB = """
import os, signal, sys, threading, time
import jax, jax.numpy as jnp
import jaxcomm

jc = jaxcomm.JaxComm()
fault = sys.argv[1]
x = jnp.ones(2)
step = jax.jit(lambda v: jc.allreduce(v) / jc.size)
for i in range(400):
    if i == 20 and fault == "computes":
        # Every rank computes between two calls (pure Python, holding the
        # GIL) for several times the silence limit: nothing is in flight, and
        # the peer watch's heartbeats come from a thread that needs no GIL.
        end = time.monotonic() + 4 * float(os.environ["JAXCOMM_TIMEOUT"])
        while time.monotonic() < end:
            sum(range(1000))
    if i == 20 and jc.rank == jc.size - 1:
        print(f"rank {jc.rank} faults at {time.time()}", flush=True)
        if fault == "sys.exit":
            sys.exit(3)
        elif fault == "caught sys.exit":
            try:
                sys.exit(3)
            except SystemExit:
                pass
        elif fault == "SIGKILL":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault == "SIGSTOP":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif fault == "exception":
            raise ValueError("the last rank gives up")
        elif fault == "thread":
            def work():
                raise ValueError("a worker thread gives up")
            worker = threading.Thread(target=work, name="worker")
            worker.start()
            worker.join()
    x = step(x)
x.block_until_ready()
print(f"rank {jc.rank} finished", flush=True)
"""

MPICH = "MPICH" in MPI.Get_library_version()
mpich_only = pytest.mark.skipif(
    not MPICH, reason="the launcher that keeps going is MPICH's -disable-auto-cleanup"
)


def launcher_keeps_going(ranks):
    """``mpiexec`` that leaves the other ranks running when one process dies."""
    command = mpiexec(ranks)
    return [command[0], "-disable-auto-cleanup", *command[1:]]


def run_fault(tmp_path, fault, *, ranks=2, keep_going=False, limit=120, **env):
    """Run FAULT_JOB with ``fault``: the result, after checking it neither hung nor finished."""
    if keep_going:
        path = tmp_path / "job.py"
        path.write_text(FAULT_JOB)
        done = subprocess.run(
            [
                "timeout",
                "-k",
                "10",
                str(limit),
                *launcher_keeps_going(ranks),
                sys.executable,
                str(path),
                fault,
            ],
            capture_output=True,
            text=True,
            env=_environment(env),
            cwd=tmp_path,
        )
    else:
        done, _ = run_job(tmp_path, FAULT_JOB, fault, ranks=ranks, limit=limit, **env)
    assert done.returncode not in (0, 124, 137), (done.returncode, done.stdout, done.stderr)
    assert "faults at" in done.stdout, done.stdout
    assert "rank 0 finished" not in done.stdout, done.stdout
    return done


def _environment(env):
    from conftest import environment_without_launcher

    return environment_without_launcher(**env)


def survivor_report(rank, what):
    """The peer watch's line on a survivor: the failed rank, its host, and the call in flight."""
    return re.compile(
        rf"jaxcomm: rank {rank} on host \S+ {what}[^;]*; rank \d+ on host \S+ was in "
        r"allreduce\b[^;]* at \S+job\.py:\d+ \(<lambda>\)[^;]*: aborting the job"
    )


def test_exit_status_of_sys_exit():
    assert [_abort._status_of(code) for code in (None, 0, 3, 256 + 4, "text")] == [0, 0, 3, 4, 1]


@spawns_own_mpi
def test_sys_exit_with_an_error_status_ends_the_job(tmp_path):
    done = run_fault(tmp_path, "sys.exit")
    assert re.search(
        r"jaxcomm: sys.exit\(3\) on rank 1 \(world\) on host \S+: aborting the MPI job",
        done.stderr,
    ), done.stderr


@spawns_own_mpi
def test_a_caught_sys_exit_ends_nothing(tmp_path):
    done, _ = run_job(tmp_path, FAULT_JOB, "caught sys.exit")
    assert done.returncode == 0, (done.returncode, done.stderr)
    assert "rank 0 finished" in done.stdout and "rank 1 finished" in done.stdout, done.stdout


@spawns_own_mpi
def test_an_exception_in_a_thread_ends_the_job(tmp_path):
    done = run_fault(tmp_path, "thread")
    assert "ValueError: a worker thread gives up" in done.stderr, done.stderr
    assert re.search(
        r"jaxcomm: uncaught ValueError in thread 'worker' on rank 1 \(world\) on host \S+",
        done.stderr,
    ), done.stderr


@spawns_own_mpi
@mpich_only
def test_a_killed_rank_ends_the_job(tmp_path):
    # 3 ranks: the killed rank's two neighbours in the ring of connections
    # are two different processes, and the job must end on all of them.
    done = run_fault(tmp_path, "SIGKILL", ranks=3, keep_going=True)
    assert survivor_report(2, r"ended without a goodbye").search(done.stderr), done.stderr


@spawns_own_mpi
@mpich_only
def test_a_silent_rank_ends_the_job(tmp_path):
    # A stopped process answers nothing, as a host cut off from the network:
    # its peers end the job once it was silent for JAXCOMM_TIMEOUT.
    done = run_fault(tmp_path, "SIGSTOP", keep_going=True, JAXCOMM_TIMEOUT="3")
    assert survivor_report(1, r"has not been heard from for \d+ s").search(done.stderr) or (
        re.search(r"jaxcomm watchdog: rank 0 on host \S+ has waited", done.stderr)
    ), done.stderr


@spawns_own_mpi
def test_a_long_computation_between_calls_is_not_a_fault(tmp_path):
    done, _ = run_job(tmp_path, FAULT_JOB, "computes", JAXCOMM_TIMEOUT="1")
    assert done.returncode == 0, (done.returncode, done.stderr)
    assert "rank 0 finished" in done.stdout and "rank 1 finished" in done.stdout, done.stdout


SHIM = """
#include <stdio.h>
/* MPI_Abort that returns, as MPICH's does when its process manager cannot
   be reached. The handle's type differs between MPIs; it is not read. */
int MPI_Abort(long comm, int code) {
  (void)comm;
  fprintf(stderr, "shim: MPI_Abort(%d) returns\\n", code);
  return 0;
}
"""


@spawns_own_mpi
def test_a_returning_mpi_abort_still_ends_the_process(tmp_path):
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler for the MPI_Abort shim")
    (tmp_path / "shim.c").write_text(SHIM)
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-o", str(tmp_path / "shim.so"), str(tmp_path / "shim.c")],
        check=True,
    )
    done = run_fault(tmp_path, "exception", LD_PRELOAD=str(tmp_path / "shim.so"))
    assert "shim: MPI_Abort(1) returns" in done.stderr, done.stderr
    assert re.search(
        r"jaxcomm: MPI_Abort returned on rank 1: this process ends itself with status 1",
        done.stderr,
    ), done.stderr
