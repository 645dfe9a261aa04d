"""Whether the build can use the ``mpicc`` on ``PATH`` (standard library only)."""

import shutil
import subprocess
import sys


def mpicc_on_path_works():
    """True if ``mpicc`` is on PATH and runs; MPICH's and Open MPI's wrappers both answer --version.

    A wrapper that cannot run (a pyenv shim left behind for an MPI since
    uninstalled, a wrapper whose compiler is gone) counts as none, with a line
    on stderr saying so, and the build falls back to the mpich wheel.
    """
    mpicc = shutil.which("mpicc")
    if mpicc is None:
        return False
    try:
        ok = subprocess.run([mpicc, "--version"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    if not ok:
        print(f"jaxcomm: {mpicc} does not run; building against the mpich wheel", file=sys.stderr)
    return ok
