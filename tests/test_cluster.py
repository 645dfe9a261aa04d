"""The namespace cluster's launchers (tests/cluster/multihost.py), without a cluster.

The multi-host runs themselves need root and namespaces (CI's multi-host
leg and tests/cluster's scripts); what each launcher is told can be checked
anywhere.
"""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "cluster"))
import multihost  # noqa: E402 - tests/cluster's module, found through the path above


def forwarded_names(command):
    """The variables an ``mpirun`` command line passes on with ``-x``."""
    return {command[i + 1] for i, word in enumerate(command) if word == "-x"}


@pytest.fixture
def caller(monkeypatch):
    """The environment of a caller that set a Python path and jaxcomm settings."""
    for name, value in {
        "PYTHONPATH": "/shared/shim",
        "JAXCOMM_TIMEOUT": "10",
        "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false",
        "HOSTNAME": "login",
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_MCA_btl_base_verbose": "100",
        "OMPI_COMM_WORLD_RANK": "0",
        "SLURM_JOB_ID": "7",
        "PMI_RANK": "0",
    }.items():
        monkeypatch.setenv(name, value)


def test_mpirun_passes_the_callers_environment_as_srun_and_mpiexec_do(caller):
    # srun and MPICH's mpiexec give the ranks the caller's environment; Open
    # MPI's mpirun passes only what -x names (mpi4jax's suite under mpirun
    # found no PYTHONPATH, hence no shim, before every variable was named).
    command = multihost.launch_command("mpirun", 2, 2, ["python", "prog.py"], {"EXTRA": "1"})
    names = forwarded_names(command)
    assert {"PATH", "PYTHONPATH", "JAXCOMM_TIMEOUT", "XLA_FLAGS", "EXTRA"} <= names
    assert "OMPI_MCA_btl_base_verbose" in names
    # The caller's host name and the launchers' own variables stay behind.
    assert not names & {"HOSTNAME", "OMPI_ALLOW_RUN_AS_ROOT", "OMPI_COMM_WORLD_RANK"}
    assert not names & {"SLURM_JOB_ID", "PMI_RANK"}
    assert command[command.index("-n") + 1 :] == ["4", "python", "prog.py"]


@pytest.mark.parametrize("launcher", ["srun", "mpiexec"])
def test_other_launchers_carry_the_environment_themselves(caller, launcher):
    command = multihost.launch_command(launcher, 2, 1, ["python", "prog.py"], {"EXTRA": "1"})
    assert "-x" not in command
    assert command[-2:] == ["python", "prog.py"]
