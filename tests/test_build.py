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
from conftest import environment_without_launcher

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


# A binary wheel's kernels exist once per MPI ABI family; the one loaded must
# link the libmpi the process runs, or a second MPI would be loaded beside it.
_BOTH = ("mpich", "openmpi")


@pytest.mark.parametrize(
    "loaded, mpi4py_abi, chosen",
    [
        (["mpich"], "mpich", "mpich"),
        (["mpich"], None, "mpich"),
        (["openmpi"], "openmpi", "openmpi"),
        (["openmpi"], None, "openmpi"),
    ],
)
def test_a_wheel_loads_the_kernels_of_the_mpi_abi_mpi4py_loaded(loaded, mpi4py_abi, chosen):
    assert _runtime.select_mpi_abi(_BOTH, loaded, mpi4py_abi, "some MPI") == chosen


@pytest.mark.parametrize(
    "available, loaded, mpi4py_abi, message",
    [
        (_BOTH, [], None, "neither of the MPI ABI families this jaxcomm wheel has kernels for"),
        (_BOTH, [], "mpiabi", "libmpi.so.12 \\(mpich\\) or libmpi.so.40 \\(openmpi\\)"),
        (_BOTH, ["mpich", "openmpi"], None, "loaded the libraries of two MPIs"),
        (_BOTH, ["openmpi"], "mpich", "built for the mpich MPI ABI, but the library loaded is"),
        (_BOTH, ["mpich"], "openmpi", "built for the openmpi MPI ABI, but the library loaded is"),
        (("mpich",), ["openmpi"], None, "kernels for the mpich MPI ABI only"),
    ],
)
def test_a_wheel_refuses_an_mpi_it_cannot_run_with_the_reason(
    available, loaded, mpi4py_abi, message
):
    with pytest.raises(ImportError, match=message) as raised:
        _runtime.select_mpi_abi(available, loaded, mpi4py_abi, "Fancy MPI 1.0")
    assert "Fancy MPI 1.0" in str(raised.value)


def test_the_libmpi_mpi4py_loaded_is_found_by_its_soname():
    from mpi4py import MPI

    library = MPI.Get_library_version()
    loaded = _runtime._loaded_mpi_abis()
    if "Open MPI" in library:
        assert loaded == ["openmpi"]
    elif "MPICH" in library or "Intel(R) MPI" in library:
        assert loaded == ["mpich"]
    assert _runtime._mpi4py_abi() in (None, *loaded)
    if _build_info.MPI_ABIS:
        assert _runtime.mpi_abi == loaded[0]
        assert f".{loaded[0]}." in os.path.basename(_runtime._kernels_cpu.__file__)
    else:
        assert _runtime.mpi_abi == ""


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
