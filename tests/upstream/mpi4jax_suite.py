"""Run mpi4jax 0.9.1's own test suite against jaxcomm.compat.mpi4jax.

Usage:  python tests/upstream/mpi4jax_suite.py RANKS [pytest arguments...]

Downloads mpi4jax's source distribution from the package index (checked
against its sha256), copies its ``tests/`` and ``examples/`` into a
temporary directory, and runs them under ``mpiexec -n RANKS`` with
``import mpi4jax`` resolving to ``jaxcomm.compat.mpi4jax`` (or under the
launcher that ``JAXCOMM_SUITE_LAUNCHER`` names, a command line that takes
the program after it, such as tests/cluster/multihost.py's ``run ... --``
across hosts; the temporary directory must then be on a file system every
host sees: set ``TMPDIR``). Nothing of
mpi4jax is installed or kept. Left out, as docs/migration-mpi4jax.md says:
the tests of mpi4jax's internal modules, the one deliberate difference
(``jax.jacfwd`` through ``sendrecv`` works), and on 3 ranks the two tests
written for other rank counts, which fail with mpi4jax itself. The exit
status is pytest's (non-zero when any rank failed).
"""

import hashlib
import io
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request

VERSION = "0.9.1"
SHA256 = "dc72ba69cc70250ef097f1ba62b2bfeabc2b328943f3b4e2fc27238915bebe34"
INDEX = os.environ.get("JAXCOMM_PYPI_SIMPLE", "https://pypi.org/simple")

# Whole files that test mpi4jax's internal modules (mpi4jax._src).
INTERNAL_FILES = ["test_validation.py", "test_decorators.py", "test_jax_compat.py"]
# Tests of collective_ops/test_common.py that exercise mpi4jax's logging,
# its MPI ABI check, and the text it prints when it aborts the job (jaxcomm
# raises an exception instead).
INTERNAL_TESTS = [
    "collective_ops/test_common.py::test_debug_logging",
    "collective_ops/test_common.py::test_set_logging_from_envvar",
    "collective_ops/test_common.py::test_mpi_abi_info",
    "collective_ops/test_common.py::test_mpi_abi_compatibility_check",
    "collective_ops/test_common.py::test_mpi_abi_skip_check",
    "collective_ops/test_common.py::test_abort_on_error",
]
# It requires jax.jacfwd through sendrecv to raise; jaxcomm differentiates it.
DELIBERATE = ["collective_ops/test_sendrecv.py::test_sendrecv_jacfwd"]
# Written for other rank counts: 256 rows split in `size` parts, and an
# example that accepts 1, 2, 4, 6, 8 or 16 processes.
NOT_FOR_3_RANKS = [
    "collective_ops/test_alltoall.py::test_alltoall_transpose",
    "test_examples.py::test_shallow_water_demo",
]

SHIM = '''"""Makes `import mpi4jax` load jaxcomm.compat.mpi4jax (jaxcomm's test runs only)."""
import sys

import jaxcomm.compat.mpi4jax

sys.modules[__name__] = jaxcomm.compat.mpi4jax
'''


def sdist() -> bytes:
    """mpi4jax's source distribution, from the index, checked against its sha256."""
    name = f"mpi4jax-{VERSION}.tar.gz"
    page = urllib.request.urlopen(f"{INDEX}/mpi4jax/", timeout=60).read().decode()
    links = re.findall(r'href="([^"#]*' + re.escape(name) + r')[^"]*"', page)
    if not links:
        raise SystemExit(f"{name} is not on {INDEX}/mpi4jax/")
    data = urllib.request.urlopen(
        urllib.parse.urljoin(f"{INDEX}/mpi4jax/", links[0]), timeout=120
    ).read()
    digest = hashlib.sha256(data).hexdigest()
    if digest != SHA256:
        raise SystemExit(f"{name}: sha256 {digest}, expected {SHA256}")
    return data


def main(argv):
    if not argv or not argv[0].isdigit():
        raise SystemExit(__doc__)
    ranks, extra = int(argv[0]), argv[1:]
    work = pathlib.Path(tempfile.mkdtemp(prefix="mpi4jax-suite-"))
    try:
        with tarfile.open(fileobj=io.BytesIO(sdist()), mode="r:gz") as archive:
            top = f"mpi4jax-{VERSION}/"
            members = [
                m
                for m in archive.getmembers()
                if m.name.startswith((top + "tests/", top + "examples/"))
            ]
            archive.extractall(work, members=members, filter="data")
        root = work / f"mpi4jax-{VERSION}"
        for name in INTERNAL_FILES:
            (root / "tests" / name).unlink()
        (work / "shim").mkdir()
        (work / "shim" / "mpi4jax.py").write_text(SHIM)
        left_out = INTERNAL_TESTS + DELIBERATE + (NOT_FOR_3_RANKS if ranks == 3 else [])
        deselect = [arg for test in left_out for arg in ("--deselect", f"tests/{test}")]
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join([str(work / "shim"), os.environ.get("PYTHONPATH", "")]),
        )
        mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or "mpiexec"
        launcher = os.environ.get("JAXCOMM_SUITE_LAUNCHER")
        command = [
            *(shlex.split(launcher) if launcher else [mpiexec, "-n", str(ranks)]),
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
        ]
        print(
            f"mpi4jax {VERSION}'s tests against jaxcomm.compat.mpi4jax on {ranks} ranks", flush=True
        )
        return subprocess.run([*command, *deselect, *extra, "tests"], cwd=root, env=env).returncode
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
