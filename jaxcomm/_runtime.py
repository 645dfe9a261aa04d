"""Loads the compiled kernels into JAX and owns process-wide state.

Importing this module checks that the kernels were built against the MPI that
mpi4py runs and against XLA FFI headers the running jaxlib accepts, registers
every FFI target once, applies ``JAXCOMM_DEBUG`` and
installs the exit hook that drains pending MPI work before MPI is finalised.
"""

import atexit
import ctypes
import functools
import gc
import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import itertools
import math
import os
import pkgutil
import re
import signal
import sys
import threading
import time
import weakref
from typing import NamedTuple

import jax
import numpy as np
from mpi4py import MPI

from . import _abort, _compat, _malloc, _peers

try:
    from . import _build_info
except ImportError:
    raise ImportError(
        f"jaxcomm at {os.path.dirname(__file__)} has no compiled "
        "kernels: this looks like the source tree. Install jaxcomm (pip install .) and "
        "import it from another directory."
    ) from None


def _library_version():
    """``MPI_Get_library_version``'s text, without the NUL bytes Open MPI leaves at its end."""
    return MPI.Get_library_version().replace("\x00", "")


def _runtime_mpi():
    """Vendor and version of the MPI library mpi4py has loaded."""
    text = _library_version()
    match = re.search(r"MPICH Version:\s*([0-9][0-9.]*)", text)
    if match:
        return "MPICH", match.group(1)
    match = re.search(r"Open MPI v([0-9][0-9.]*)", text)
    if match:
        return "Open MPI", match.group(1)
    return "unknown", text.splitlines()[0] if text else ""


def _major_minor(version):
    return tuple(version.split(".")[:2])


def _check_mpi_matches():
    if _build_info.MPI_ABIS:
        return  # a binary wheel: select_mpi_abi() picks the kernels for the MPI running
    vendor, version = _runtime_mpi()
    built = (_build_info.MPI_VENDOR, _build_info.MPI_VERSION)
    if built[0] == "unknown" or vendor == "unknown":
        return
    if vendor != built[0] or _major_minor(version) != _major_minor(built[1]):
        raise ImportError(
            f"jaxcomm was built against {built[0]} {built[1]} "
            f"({_build_info.MPI_C_COMPILER}), but mpi4py is running {vendor} {version}. "
            "Rebuild jaxcomm against the MPI that mpi4py uses: put that MPI's mpicc first "
            "on PATH (or set JAXCOMM_MPICC to it) and run "
            "'pip install --force-reinstall --no-deps --no-cache-dir jaxcomm' from the "
            "jaxcomm source tree."
        )


# A binary wheel's kernels are compiled once per MPI ABI family against that
# family's headers (the sonames name the family in build_info) and link no
# libmpi: they take MPI's symbols from the library mpi4py loaded, whatever its
# file name. MPICH's ABI is shared by Intel MPI, MVAPICH, Cray MPICH and
# distribution builds such as Debian's libmpich.so.12; the MPI-5 standard ABI
# ("mpiabi", mpi4py's name for it) is the one every MPI may provide.
MPI_ABI_SONAMES = {"mpich": "libmpi.so.12", "openmpi": "libmpi.so.40", "mpiabi": "libmpi_abi.so.1"}

# Symbols that only one family's library defines: Open MPI's predefined
# handles are the addresses of objects its library exports (MPI_COMM_WORLD is
# &ompi_mpi_comm_world, which the openmpi kernels refer to); MPICH's ABI names
# MPI_DUP_FN MPIR_Dup_fn, and the MPI-5 standard ABI library (libmpi_abi)
# has no such symbol.
_OPENMPI_SYMBOL = "ompi_mpi_comm_world"
_MPICH_SYMBOL = "MPIR_Dup_fn"
# MPI_COMM_WORLD in MPICH's ABI: an int handle with this value.
_MPICH_COMM_WORLD = 0x44000000
# MPI_COMM_WORLD in the MPI-5 standard ABI (mpi_abi.h): a pointer-sized
# handle with this value, the same in every MPI that provides the ABI.
_STANDARD_ABI_COMM_WORLD = 0x101


class MpiLibrary(NamedTuple):
    """What the import found out about the MPI library this process runs.

    Attributes:
        paths: the files that define ``MPI_Get_library_version`` among those
            the process has mapped (one, unless two MPIs are loaded).
        exports: which of ``ompi_mpi_comm_world`` (Open MPI's) and
            ``MPIR_Dup_fn`` (MPICH's ABI) the library defines.
        abi_version: ``MPI_Abi_get_version``'s ``(major, minor)``, whose major is
            positive for the MPI-5 standard ABI; None where the library lacks it.
        handle_size: ``sizeof(MPI_Comm)`` in the headers mpi4py was built with.
        comm_world: mpi4py's ``MPI_COMM_WORLD`` handle.
        library: the first line of ``MPI_Get_library_version``'s text.
    """

    paths: tuple
    exports: frozenset
    abi_version: tuple | None
    handle_size: int
    comm_world: int
    library: str


def _mapped_files():
    """The address ranges of the files this process has mapped, from ``/proc/self/maps``."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/"):
                start, end = (int(part, 16) for part in fields[0].split("-"))
                ranges.append((start, end, fields[5].rstrip("\n")))
    return ranges


def _loaded_mpi_library():
    """Find the MPI library mpi4py loaded, by what it exports, whatever its file name."""
    ranges = _mapped_files()
    paths = {}
    handles = {}
    for path in dict.fromkeys(path for _, _, path in ranges):
        try:
            handle = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            address = ctypes.cast(handle.MPI_Get_library_version, ctypes.c_void_p).value
        except (OSError, AttributeError):
            continue
        # dlsym also searches the file's dependencies (mpi4py's module finds
        # libmpi's symbol): the file defines it if its own pages hold it.
        owner = next((p for start, end, p in ranges if start <= address < end), path)
        paths.setdefault(os.path.realpath(owner), None)
        if os.path.realpath(owner) == os.path.realpath(path):
            handles[os.path.realpath(owner)] = handle
    exports = set()
    abi_version = None
    if len(paths) == 1:
        handle = handles.get(next(iter(paths)))
        if handle is not None:
            exports = {name for name in (_OPENMPI_SYMBOL, _MPICH_SYMBOL) if hasattr(handle, name)}
            abi_version = _abi_version(handle)
    return MpiLibrary(
        paths=tuple(paths),
        exports=frozenset(exports),
        abi_version=abi_version,
        handle_size=MPI._sizeof(MPI.Comm),
        comm_world=MPI._handleof(MPI.COMM_WORLD),
        library=library_line() or "an MPI of unknown version",
    )


def _abi_version(handle):
    """``MPI_Abi_get_version`` of the library (MPI-5, callable at any time), or None."""
    get_version = getattr(handle, "MPI_Abi_get_version", None)
    if get_version is None:
        return None
    major, minor = ctypes.c_int(0), ctypes.c_int(0)
    get_version.restype = ctypes.c_int
    get_version.argtypes = [ctypes.POINTER(ctypes.c_int)] * 2
    if get_version(ctypes.byref(major), ctypes.byref(minor)) != 0:
        return None
    return major.value, minor.value


def mpi_abi_family(found):
    """The MPI ABI family of the library ``found`` describes, or None if it is neither.

    Args:
        found: an ``MpiLibrary``.

    Returns:
        ``"mpich"``, ``"openmpi"``, ``"mpiabi"`` (the MPI-5 standard ABI) or None.
    """
    if found.abi_version is not None and found.abi_version[0] > 0:
        # mpi4py built against mpi_abi.h, not another MPI's header.
        standard_handles = found.handle_size == 8 and found.comm_world == _STANDARD_ABI_COMM_WORLD
        return "mpiabi" if standard_handles else None
    if _OPENMPI_SYMBOL in found.exports and _MPICH_SYMBOL not in found.exports:
        # Open MPI keeps its ABI from 3.0 (soname 40) on; 1.x and 2.x differ.
        old = re.search(r"Open MPI v([0-9]+)\.", found.library)
        return "openmpi" if found.handle_size == 8 and not (old and int(old[1]) < 3) else None
    if _MPICH_SYMBOL in found.exports and _OPENMPI_SYMBOL not in found.exports:
        mpich_handles = (
            found.handle_size == 4 and found.comm_world & 0xFFFFFFFF == _MPICH_COMM_WORLD
        )
        return "mpich" if mpich_handles else None
    return None


def _evidence(found):
    """What the family was chosen from, for an error message."""
    version = "absent" if found.abi_version is None else "{}.{}".format(*found.abi_version)
    return (
        f"{found.paths[0] if found.paths else 'no loaded library'} "
        f"{'defines' if _OPENMPI_SYMBOL in found.exports else 'lacks'} {_OPENMPI_SYMBOL} "
        f"(Open MPI's) and {'defines' if _MPICH_SYMBOL in found.exports else 'lacks'} "
        f"{_MPICH_SYMBOL} (MPICH's ABI), MPI_Abi_get_version: {version}; mpi4py's MPI_Comm "
        f"is {found.handle_size} bytes, MPI_COMM_WORLD {found.comm_world:#x} (Open MPI's ABI "
        "is that of 3.0 and newer; the standard ABI's MPI_Comm is 8 bytes and its "
        "MPI_COMM_WORLD 0x101)"
    )


def _mpi4py_abi():
    """The MPI ABI mpi4py's own binary wheel chose (``MPI.mpich.cpython-*.so``), or None."""
    parts = os.path.basename(getattr(MPI, "__file__", None) or "").split(".")
    return parts[1] if len(parts) > 2 and parts[1] in ("mpich", "openmpi", "mpiabi") else None


def select_mpi_abi(available, found, mpi4py_abi, override=""):
    """The MPI ABI family whose kernels a binary wheel loads into this process.

    The family is what the library mpi4py loaded is (its exports and handles),
    never its file name. Kernels of one family in a process that runs another
    would crash at the first call, so every doubt is an ``ImportError``.

    Args:
        available: the families the wheel has kernels for (``_build_info.MPI_ABIS``).
        found: the ``MpiLibrary`` the process runs.
        mpi4py_abi: the family mpi4py's binary wheel says it chose, or None
            (an mpi4py built from source says nothing).
        override: ``JAXCOMM_MPI_ABI``, a family the user says the library has
            ("" to tell it from the library).

    Returns:
        One of ``available``.

    Raises:
        ImportError: if the process runs two MPIs, one of neither family or one
            the wheel has no kernels for, or one other than mpi4py's; or if
            ``override`` names no family the wheel has.
    """
    rebuild = (
        "Build jaxcomm from source against the MPI that mpi4py uses instead: with that "
        "MPI's mpicc first on PATH, 'pip install --no-binary jaxcomm jaxcomm' (or "
        "'pip install .' in the jaxcomm source tree)."
    )
    if override:
        if override not in available:
            raise ImportError(
                f"JAXCOMM_MPI_ABI={override}, but this jaxcomm wheel has kernels for the "
                f"{' and '.join(available)} MPI ABI families only (mpi4py runs "
                f"'{found.library}')."
            )
        return override
    if len(found.paths) > 1:
        raise ImportError(
            f"this process has loaded two MPI libraries ({', '.join(found.paths)}), so "
            f"jaxcomm cannot tell which one mpi4py runs ('{found.library}'). Load one MPI "
            "only, for example by leaving the other's lib directory off LD_LIBRARY_PATH."
        )
    abi = mpi_abi_family(found)
    if abi == "mpiabi" and abi not in available:
        raise ImportError(
            f"mpi4py runs '{found.library}' through the MPI-5 standard ABI "
            f"({found.paths[0] if found.paths else 'libmpi_abi'}), which this jaxcomm has "
            f"no kernels for (it has the {' and '.join(available)} families'). Let mpi4py "
            "load the MPI's own library instead (for MPICH, libmpi.so.12: an mpi4py built "
            "with mpicc rather than mpicc_abi, MPI4PY_MPIABI and MPI4PY_LIBMPI unset), or: "
            + rebuild
        )
    if abi is None:
        raise ImportError(
            f"mpi4py runs '{found.library}', whose library is of neither MPI ABI family "
            f"this jaxcomm wheel has kernels for (MPICH's, which covers MPICH, Intel MPI, "
            f"MVAPICH and Cray MPICH, Open MPI's, and the MPI-5 standard ABI). Checked: "
            f"{_evidence(found)}. If you "
            "know that this MPI has one of those ABIs, set JAXCOMM_MPI_ABI=mpich or "
            f"JAXCOMM_MPI_ABI=openmpi. {rebuild}"
        )
    if mpi4py_abi is not None and mpi4py_abi != abi:
        raise ImportError(
            f"mpi4py's MPI module was built for the {mpi4py_abi} MPI ABI, but the library "
            f"loaded, {found.paths[0]}, has the {abi} ABI: '{found.library}'. Make mpi4py "
            "load the MPI it was built for (MPI4PY_MPIABI, MPI4PY_LIBMPI) or reinstall mpi4py."
        )
    if abi not in available:
        raise ImportError(
            f"this jaxcomm has kernels for the {', '.join(available)} MPI ABI only, but "
            f"mpi4py runs '{found.library}' ({abi}). {rebuild}"
        )
    return abi


def library_line():
    """The first line of the MPI library's own version string, spaces collapsed ("" if none)."""
    text = _library_version()
    return " ".join(text.splitlines()[0].split()) if text else ""


def _select_mpi_abi():
    found = _loaded_mpi_library()
    override = os.environ.get("JAXCOMM_MPI_ABI", "").strip().lower()
    abi = select_mpi_abi(_build_info.MPI_ABIS, found, _mpi4py_abi(), override)
    # The kernels link no libmpi: their MPI symbols come from the global scope,
    # where mpi4py's library (loaded RTLD_LOCAL with its module) is promoted.
    for path in found.paths:
        ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL | os.RTLD_LAZY)
    return abi


# The MPI ABI family of a binary wheel's kernels for this process ("" for a
# build against one MPI).
mpi_abi = _select_mpi_abi() if _build_info.MPI_ABIS else ""


def _load_kernels(name):
    """Import the kernels module ``name`` built for the MPI this process runs."""
    if not mpi_abi:
        return importlib.import_module(f"{__package__}.{name}")
    fullname = f"{__package__}.{name}"
    here = os.path.dirname(os.path.abspath(__file__))
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(here, f"{name}.{mpi_abi}{suffix}")
        if os.path.isfile(path):
            spec = importlib.util.spec_from_file_location(fullname, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[fullname] = module
            spec.loader.exec_module(module)
            return module
    raise ImportError(f"No module named {fullname!r} for the {mpi_abi} MPI ABI", name=fullname)


_check_mpi_matches()


def _running_ffi_api():
    """The XLA FFI API version of the running jaxlib, from its headers (None if absent)."""
    import jaxlib

    header = os.path.join(
        os.path.dirname(jaxlib.__file__), "include", "xla", "ffi", "api", "c_api.h"
    )
    try:
        with open(header) as file:
            text = file.read()
    except OSError:
        return None
    parts = [
        re.search(rf"^#define XLA_FFI_API_{part} (\d+)", text, re.M) for part in ("MAJOR", "MINOR")
    ]
    return tuple(int(m.group(1)) for m in parts) if all(parts) else None


def ffi_api_mismatch(built, built_jaxlib, running, running_jaxlib):
    """Why a jaxlib would refuse the kernels' FFI handlers, or None when it accepts them.

    XLA accepts handlers built against its own FFI API version and, for a time,
    older minor versions; it refuses newer ones at the first use of a backend,
    with a message that does not say how to get kernels that load.

    Args:
        built: ``(major, minor)`` of the headers the kernels were compiled against.
        built_jaxlib: the jaxlib those headers came from.
        running: ``(major, minor)`` of the running jaxlib, or None if unknown.
        running_jaxlib: the running jaxlib's version.
    """
    if running is None or (built[0] == running[0] and built[1] <= running[1]):
        return None
    return (
        f"jaxcomm's kernels were built against the XLA FFI headers of jaxlib {built_jaxlib} "
        f"(FFI API {built[0]}.{built[1]}), but this process runs jaxlib {running_jaxlib} "
        f"(FFI API {running[0]}.{running[1]}), which refuses them. Reinstall jaxcomm (a "
        "default build compiles against jaxlib 0.6.2's headers, which every supported jaxlib "
        "accepts): 'pip install --force-reinstall --no-deps --no-cache-dir .' from the jaxcomm "
        "source tree."
    )


def _check_ffi_api_matches():
    import jaxlib

    reason = ffi_api_mismatch(
        _build_info.FFI_API, _build_info.JAXLIB_VERSION, _running_ffi_api(), jaxlib.__version__
    )
    if reason:
        raise ImportError(reason)


_check_ffi_api_matches()


def build_info() -> dict:
    """Say which MPI jaxcomm's kernels were built against and which one runs.

    jaxcomm's import already refuses an MPI of another vendor or major.minor
    version than the build's; this shows both, for example to check a
    cluster installation against the site's MPI module.

    Returns:
        A dict with ``mpi_built`` (vendor and version the kernels were
        compiled against, ``"unknown"`` when the build could not tell; for
        a binary wheel, each family's MPI and libmpi soname),
        ``mpi_compiler`` (the compiler wrapper the build used),
        ``mpi_runtime`` (vendor and version of the MPI library mpi4py has
        loaded), ``mpi_library`` (the first line of that library's own
        version string), ``cuda`` (whether the CUDA kernels were built),
        ``jaxlib_built`` (the jaxlib whose XLA FFI headers the kernels were
        compiled against, with their FFI API version) and ``mpi_abi`` (for a
        binary wheel, the MPI ABI family whose kernels were loaded,
        ``"mpich"`` or ``"openmpi"``; ``""`` for a build against one MPI).

    Example:
        >>> import jaxcomm
        >>> jaxcomm.build_info()["mpi_built"]  # doctest: +SKIP
        'MPICH 5.0.2'
    """
    vendor, version = _runtime_mpi()
    return {
        "mpi_built": f"{_build_info.MPI_VENDOR} {_build_info.MPI_VERSION}".strip(),
        "mpi_compiler": _build_info.MPI_C_COMPILER,
        "mpi_runtime": f"{vendor} {version}",
        "mpi_library": library_line(),
        "cuda": CUDA_BUILT,
        "jaxlib_built": f"{_build_info.JAXLIB_VERSION} (XLA FFI API "
        f"{'.'.join(map(str, _build_info.FFI_API))})",
        "mpi_abi": mpi_abi,
    }


_kernels_cpu = _load_kernels("_kernels_cpu")  # only once the MPI is known to match
_abort.use_kernels(_kernels_cpu)


def cuda_plugin_installed() -> bool:
    """Whether JAX can run on CUDA here: its CUDA plugin (``jax[cuda12]``, ``jax[cuda13]``).

    Read from the installed packages (the ``jax_plugins`` entry points and
    namespace, as JAX finds its plugins) without importing the plugin or
    starting a backend.
    """
    if any(
        entry.name.startswith("xla_cuda")
        for entry in importlib.metadata.entry_points(group="jax_plugins")
    ):
        return True
    namespace = sys.modules.get("jax_plugins")
    return namespace is not None and any(
        name.startswith("xla_cuda") for _, name, _ in pkgutil.iter_modules(namespace.__path__)
    )


# Whether this build has the CUDA kernels.
CUDA_BUILT = bool(_build_info.CUDA)

# The CUDA kernels: loaded (and their FFI targets registered for CUDA) where
# JAX has a CUDA plugin, else only when asked for (load_cuda_kernels). A
# CPU-only program never loads them. Loading initialises no CUDA either: the
# module links its runtime statically, which starts on the first call.
cuda_kernels = None


def load_cuda_kernels():
    """The CUDA kernels module, loaded and registered on first use; None if not built.

    Called at import where JAX has a CUDA plugin, and by whatever needs the
    module later: a lowering for a GPU (so a CUDA backend that the plugin
    check missed still gets its kernels), cuda_info(), tests.
    """
    global cuda_kernels
    if cuda_kernels is None and CUDA_BUILT:
        kernels = _load_kernels("_kernels_cuda")
        for name, capsule in kernels.registrations().items():
            jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
        kernels.set_cuda_aware(_cuda_aware_mode)  # a data path chosen before the load
        cuda_kernels = kernels
    return cuda_kernels


# The data path of device buffers, as the CUDA module's set_cuda_aware takes
# it (1 straight to MPI, 0 staged, -1 as the MPI library says), kept here so
# a module loaded later starts with it.
_cuda_aware_mode = -1


def set_cuda_aware_mode(mode: int) -> None:
    """Set the data path of device buffers now and for a CUDA module loaded later (_gpu)."""
    global _cuda_aware_mode
    _cuda_aware_mode = mode
    if cuda_kernels is not None:
        cuda_kernels.set_cuda_aware(mode)


if CUDA_BUILT and cuda_plugin_installed():
    load_cuda_kernels()

# A developer check (tests/cuda_emulation/README.md): XLA's CPU runs the CUDA
# kernels' platform layer over an emulated CUDA runtime, in place of the CPU
# kernels, so the whole test suite exercises it without a GPU.
_cpu_handlers = _kernels_cpu
if os.environ.get("JAXCOMM_EMULATE_CUDA", "") not in ("", "0"):
    try:
        _cpu_handlers = _load_kernels("_kernels_cuda_emulated")
    except ImportError:
        raise ImportError(
            "JAXCOMM_EMULATE_CUDA is set, but this jaxcomm was built without the emulated "
            "CUDA module: rebuild with -C cmake.define.JAXCOMM_CUDA_EMULATION=ON"
        ) from None
    cuda_kernels = _cpu_handlers

for _name, _capsule in _cpu_handlers.registrations().items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")
jax.ffi.register_ffi_target("jaxcomm_zero_after", _kernels_cpu.zero_after(), platform="cpu")


def register_comm(comm: MPI.Comm) -> int:
    """Make ``comm`` known to the kernels until :func:`unregister_comm`.

    Returns:
        The value of the ``comm`` parameter of jaxcomm's primitives that stands
        for ``comm``. It is never reused in this process, even when MPI reuses
        the communicator's handle, so compiled code that captured a freed
        communicator raises instead of running on a newer one.
    """
    return _kernels_cpu.register_comm(comm.py2f())


def clone(comm: MPI.Intracomm) -> MPI.Intracomm:
    """``comm.Clone()`` (collective), seen by the watchdog and interrupts as a call of its own.

    A rank that never joins the clone is reported as for any jaxcomm call,
    naming the user's call site.
    """
    site = site_id(_compat.current_site())
    return type(comm).f2py(_kernels_cpu.dup_watched(comm.py2f(), site))


def unregister_comm(handle: int) -> None:
    """Make the kernels refuse ``handle`` (from :func:`register_comm`) from now on."""
    _kernels_cpu.unregister_comm(handle)


def mpi_comm(handle: int) -> MPI.Comm:
    """The mpi4py communicator behind a handle from :func:`register_comm`."""
    return MPI.Comm.f2py(_kernels_cpu.fortran_handle(handle))


def set_debug(enabled: bool = True) -> None:
    """Turn logging of every MPI call made by jaxcomm kernels on or off.

    Each call writes one line to stderr, for example
    ``r0 | MPI_Send -> 1 tag 0 count 9 float32``. Setting the environment
    variable ``JAXCOMM_DEBUG=1`` before import turns it on from the start.

    Args:
        enabled: whether to log.

    Raises:
        TypeError: ``enabled`` is not a bool.
    """
    if not isinstance(enabled, (bool, np.bool_)):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    _kernels_cpu.set_debug(bool(enabled))


# Every call site registered, by id, for the timeline's files (jaxcomm.trace),
# and the recording to tell about new ones (None: none running).
_sites = {}
site_listener = None


@functools.cache
def site_id(text: str) -> int:
    """The id of a call site's text, which the kernels name in checker and watchdog reports."""
    site = _kernels_cpu.register_site(text)
    _sites[site] = text
    if site_listener is not None:
        site_listener(site, text)
    return site


def sites() -> dict:
    """Every call site registered so far, by id."""
    return dict(_sites)


def kernels_cpu():
    """The CPU kernels module (which also holds the state every kernels module shares)."""
    return _kernels_cpu


# The JaxComms alive, in creation order: set_check gives them checking
# communicators, collectively, in the same order on every rank.
_live_comms = weakref.WeakValueDictionary()
_comm_serials = itertools.count()


def track_comm(jc) -> None:
    """Note a new JaxComm (and give it checking communicators when checking is on)."""
    _live_comms[next(_comm_serials)] = jc
    _peers.start(jc._derivative, _kernels_cpu)
    if checking():
        jc._make_check_comm()


def set_check_comm(handle: int, comm) -> None:
    """Hand the kernels the checker's communicator for ``handle`` (None: forget it)."""
    _kernels_cpu.set_check_comm(handle, (MPI.COMM_NULL if comm is None else comm).py2f())


def checking() -> bool:
    """Whether the collective mismatch checker is on."""
    return bool(_kernels_cpu.monitor_flags() & 1)


def monitoring() -> bool:
    """Whether the checker, the watchdog or the timeline recorder is on: calls then need their own call sites."""
    return _kernels_cpu.monitor_flags() != 0 or _kernels_cpu.tracing()


def set_check(enabled: bool = True) -> None:
    """Turn the collective mismatch checker on or off.

    With the checker on, every jaxcomm MPI call first compares what the
    ranks involved are about to do. A collective's ranks compare the
    operation, root, reduction op, element count, dtype and ``*v`` counts;
    when they disagree, no rank makes the call and every rank raises an error
    naming each rank's call and its Python call site (file, line and function
    of the jaxcomm method call), where the program would otherwise hang or
    corrupt data. A message's sender sends its signature ahead of it; a
    receiver whose buffer cannot take the message (another dtype, more
    elements) discards it and raises, naming both calls. The sender's send
    completes, as MPI lets a small send complete before its receive is
    posted: waiting for the receiver's verdict would deadlock programs that
    receive messages in another order than they were sent.

    Each checked collective costs an extra ``MPI_Allgather`` of a few hundred
    bytes per rank, each message one small extra message. Ranks may call the
    same collective from different lines (rank-dependent branches are
    legitimate SPMD code), so call sites are reported, not compared. A
    program where one rank makes a collective while its peer makes a
    point-to-point call still hangs (neither can tell what the other is
    doing): the watchdog (:func:`set_timeout`) reports those.

    Setting the environment variable ``JAXCOMM_CHECK=1`` turns it on from the
    start. Turning it on later is collective: call it on every rank at the
    same point of the program. It creates a private communicator per live
    ``JaxComm`` (and per one created later) to check on.

    Args:
        enabled: whether to check.

    Raises:
        TypeError: if ``enabled`` is not a bool.
    """
    if not isinstance(enabled, (bool, np.bool_)):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    enabled = bool(enabled)
    if enabled:
        wait_for_dispatched()
        # A JaxComm nothing refers to may wait for the cycle collector (its
        # compiled functions refer back to it), which runs at a different
        # moment on each rank: collect now, so that every rank clones the
        # same communicators, in the same order.
        gc.collect()
        for _, jc in sorted(_live_comms.items()):
            if not jc.freed:
                jc._make_check_comm()
    _kernels_cpu.set_check(enabled)


def set_timeout(seconds: float | None) -> None:
    """Abort the job when one jaxcomm MPI call takes longer than ``seconds`` (the watchdog).

    A thread that wakes at most once a second (no busy waiting) looks at the
    MPI call each rank is in. When one has run longer than the timeout, the
    rank prints what it waits in (operation, peer or root, tag, count, dtype
    and the Python call site) and calls ``MPI_Abort`` on ``MPI_COMM_WORLD``
    with exit status 124, so a batch job that would hang forever ends with a
    diagnosis instead. MPI cannot cancel a collective a rank is waiting in,
    so raising an exception on that rank instead would leave the others
    hanging. Setting ``JAXCOMM_TIMEOUT=seconds`` turns it on from the start.
    It is off by default: a rank waits as long as its slowest peer computes
    between calls, so pick a bound well above that (docs/errors.md).

    The same number of seconds is the peer watch's limit of silence: a
    rank not heard from for that long (a partition, a host down) ends the
    job; without a timeout the limit is 60 s.

    Args:
        seconds: the timeout, a positive number; ``None`` or 0 turns the
            watchdog off (and puts the peer watch's limit back to 60 s).

    Raises:
        TypeError: if ``seconds`` is not a number.
        ValueError: if ``seconds`` is negative or not finite.
    """
    if seconds is None:
        seconds = 0.0
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float, np.integer, np.floating)):
        raise TypeError(f"seconds must be a number or None, got {type(seconds).__name__}")
    seconds = float(seconds)
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"seconds must be a positive number (or 0 / None: off), got {seconds}")
    _kernels_cpu.set_timeout(seconds)
    _kernels_cpu.set_peer_silence(seconds or _peers.DEFAULT_SILENCE_S)


def set_pipeline_bytes(nbytes: int) -> None:
    """Hand large collectives to MPI in pieces of ``nbytes`` bytes from now on (0: whole).

    ``allreduce``, ``reduce``, ``scan``, ``exscan``, ``bcast`` and
    ``allgather`` of at least two pieces then make one MPI call per piece,
    and ``iallreduce``, ``ireduce``, ``iscan`` and ``ibcast`` start one
    request per piece. On GPU arrays without a CUDA-aware MPI this pipelines
    the staging: each piece goes to MPI as soon as its copy to host memory
    arrived, and back to the GPU while MPI moves the next (see docs/gpu.md
    for the measured piece size). The pieces are cut the same way on every
    platform, so that a rank with GPU arrays and one with CPU arrays make the
    same MPI calls: every rank of a communicator must use the same setting,
    as with any argument of a collective. ``JAXCOMM_PIPELINE_BYTES`` sets it
    at import; the default, 4 MiB, is the best piece size measured on GPU
    arrays.

    Args:
        nbytes: the piece size in bytes, or 0 to hand every message to MPI whole.

    Raises:
        TypeError: if ``nbytes`` is not an integer.
        ValueError: if ``nbytes`` is negative.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)):
        raise TypeError(f"nbytes must be an integer, got {type(nbytes).__name__}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be 0 (off) or a positive number of bytes, got {nbytes}")
    _kernels_cpu.set_pipeline_bytes(int(nbytes))


def pipeline_bytes() -> int:
    """The piece size of pipelined collectives in bytes (0: off); see :func:`set_pipeline_bytes`."""
    return int(_kernels_cpu.pipeline_bytes())


def _env_bytes(name):
    text = os.environ.get(name, "")
    if text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name} must be a whole number of bytes, got {text!r}") from None


def _env_seconds(name):
    text = os.environ.get(name, "")
    if text in ("", "0"):
        return 0.0
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {text!r}") from None


def raise_recorded_error() -> None:
    """Raise the first failure of a jaxcomm kernel not yet reported, if there is one."""
    message = _kernels_cpu.take_error()
    if message is not None:
        raise RuntimeError(f"an MPI call jaxcomm dispatched earlier failed: {message}")


_compat.runtime_error_seen = _kernels_cpu.forget_error

_increment = jax.jit(lambda x: x + 1)


@functools.cache
def _probe_input(device):
    return jax.device_put(np.int8(0), device)


# Set by ops/nonblocking.py: the (slot, serial) of every eager request alive
# and not waited yet.
eager_request_keys = set


def raise_unfinished_requests(*, at_exit: bool = False) -> None:
    """Raise for nonblocking requests started and never waited, each reported once.

    Requests started eagerly whose ``Request`` is still alive may yet be
    waited: they are left out, except at exit.
    """
    unfinished = _kernels_cpu.unfinished_requests()
    if not unfinished:
        return
    alive = set() if at_exit else eager_request_keys()
    lost = [item for item in unfinished if tuple(item[:2]) not in alive]
    if not lost:
        return
    for slot, serial, _ in lost:
        _kernels_cpu.mark_request_reported(slot, serial)
    where = "the program ends with" if at_exit else "there are"
    raise RuntimeError(
        f"jaxcomm: {where} {len(lost)} nonblocking request(s) started and never "
        "completed by JaxComm.wait: " + "; ".join(text for _, _, text in lost) + ". "
        "A request dropped without a wait, or a compiled function that failed "
        "between a start and its wait, leaves its operation to MPI: its buffers "
        "stay allocated and the peers' matching calls may never complete."
    )


def sync() -> None:
    """Wait until every dispatched jaxcomm operation has finished.

    JAX dispatches work asynchronously, so MPI calls from a jitted function may
    still be running when Python moves on. Call ``sync()`` before handing over
    to plain mpi4py code that must see their effects (for example before
    freeing a communicator or finalising MPI).

    Raises:
        RuntimeError: if an MPI call that jaxcomm dispatched failed since the
            last ``sync()`` in a computation XLA ran after its call returned,
            and the program was not given the failure. JAX raises such a
            failure from its outputs, if they are read, but a computation
            with no outputs (or outputs never read) has nowhere to report
            it; jaxcomm keeps the first one for ``sync()`` (and the exit
            hook), so no failure goes unnoticed. A failure JAX raised to the
            program, in the call that ran it or from its results, is the
            program's and is not raised again. It is raised once, and
            jaxcomm goes on working. Also for nonblocking requests started
            and never waited (an eager request dropped without
            ``JaxComm.wait``), each reported once.
    """
    wait_for_dispatched()
    raise_recorded_error()
    raise_unfinished_requests()


def wait_for_dispatched() -> None:
    """Wait until every dispatched jaxcomm operation has finished, raising nothing of jaxcomm's.

    For collective steps (freeing or splitting a communicator): raising on the
    one rank whose kernel failed would leave the others waiting in them.
    """
    _compat.effects_barrier()
    _wait_for_fast_device()


def _wait_for_fast_device():
    # A device runs its computations in dispatch order, so a computation
    # dispatched now finishes after every earlier one.
    if _compat.fast_device is not None:
        with _compat.outside_mesh():
            _increment(_probe_input(_compat.fast_device)).block_until_ready()


_compat.wait_for_fast_device = _wait_for_fast_device


def check_thread_level() -> None:
    """Raise if MPI was initialised below ``MPI_THREAD_SERIALIZED``.

    XLA runs jaxcomm kernels on its own threads while Python goes on. At
    ``MPI_THREAD_MULTIPLE`` (mpi4py's default) Python may call MPI through
    mpi4py meanwhile. At ``MPI_THREAD_SERIALIZED`` only one thread may be
    inside MPI at a time: jaxcomm's kernels run one at a time in program order
    (one token chain per process), its own MPI calls from Python wait for them
    (:func:`before_mpi_from_python`), and the program's mpi4py calls must do
    the same (docs/sharp-bits.md). Lower levels allow no MPI call from XLA's
    threads at all.
    """
    provided = MPI.Query_thread()
    if provided < MPI.THREAD_SERIALIZED:
        raise RuntimeError(
            "jaxcomm needs MPI_THREAD_MULTIPLE (mpi4py's default) or MPI_THREAD_SERIALIZED, "
            f"but MPI was initialised with thread level {provided}. Leave "
            "mpi4py.rc.thread_level at 'multiple' (or set it to 'serialized' before "
            "importing mpi4py.MPI) and check that your MPI library supports that level."
        )


def before_mpi_from_python() -> None:
    """Before jaxcomm calls MPI from Python: at ``MPI_THREAD_SERIALIZED``, wait for its kernels.

    A kernel dispatched earlier may still be inside MPI on one of XLA's
    threads; at ``MPI_THREAD_MULTIPLE`` that is allowed, at
    ``MPI_THREAD_SERIALIZED`` it is not.
    """
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        wait_for_dispatched()


set_debug(os.environ.get("JAXCOMM_DEBUG", "") not in ("", "0"))
_kernels_cpu.set_check(os.environ.get("JAXCOMM_CHECK", "") not in ("", "0"))
set_timeout(_env_seconds("JAXCOMM_TIMEOUT"))
if _env_bytes("JAXCOMM_PIPELINE_BYTES") is not None:
    set_pipeline_bytes(_env_bytes("JAXCOMM_PIPELINE_BYTES"))
# Host buffers from this many bytes on transparent huge pages (memory.cc).
_huge_page_bytes = _env_bytes("JAXCOMM_HUGE_PAGES")
if _huge_page_bytes is not None:
    if _huge_page_bytes < 0:
        raise ValueError("JAXCOMM_HUGE_PAGES must be 0 (off) or a number of bytes")
    _kernels_cpu.set_huge_page_bytes(_huge_page_bytes)
# Bytes of freed memory glibc keeps for the next call's buffers (_malloc.py).
malloc_pad = _malloc.keep_freed_memory(_env_bytes("JAXCOMM_MALLOC_PAD"))


# Interrupts ------------------------------------------------------------------
#
# Python raises KeyboardInterrupt only when the main thread returns to the
# interpreter, never while it waits for a jaxcomm call that MPI keeps blocked
# (a receive nobody sends to), and MPI cannot cancel such a call. So a thread
# woken through Python's signal wakeup descriptor looks at SIGINT: if jaxcomm
# calls are still running a moment later, it names the latest one and aborts
# the job; otherwise Python raises KeyboardInterrupt as usual.

_INTERRUPT_GRACE_S = 1.0
_INTERRUPT_EXIT = 130  # 128 + SIGINT, as shells report an interrupted program


def _watch_interrupts(fd):
    while True:
        try:
            data = os.read(fd, 512)
        except OSError:
            return
        if not data:
            return
        if signal.SIGINT not in data:
            continue
        deadline = time.monotonic() + _INTERRUPT_GRACE_S
        while _kernels_cpu.calls_in_flight() and time.monotonic() < deadline:
            time.sleep(0.05)
        if _kernels_cpu.calls_in_flight():
            sys.stderr.write(
                f"jaxcomm: interrupted (SIGINT) on rank {MPI.COMM_WORLD.Get_rank()} while "
                f"it waits in an MPI call made at {_kernels_cpu.latest_site()}, which MPI "
                "cannot cancel: aborting the job\n"
            )
            sys.stderr.flush()
            time.sleep(0.5)  # mpiexec may drop what a rank wrote just before it aborts
            MPI.COMM_WORLD.Abort(_INTERRUPT_EXIT)


def _watch_for_interrupts():
    """Start the interrupt thread, unless something else owns the wakeup descriptor."""
    if os.environ.get("JAXCOMM_INTERRUPT_ABORT", "1") == "0":
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    try:
        previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    except ValueError:  # imported outside the main thread
        previous = None
    if previous != -1:
        if previous is not None:
            signal.set_wakeup_fd(previous)
        os.close(read)
        os.close(write)
        return
    threading.Thread(
        target=_watch_interrupts, args=(read,), name="jaxcomm-interrupts", daemon=True
    ).start()


_watch_for_interrupts()


def _report_at_exit(failure):
    """Report a failure found at exit on stderr, and end the job, or the process, with status 1.

    An exception raised by an exit hook is printed, but leaves the exit
    status at 0: a job whose MPI call failed would look successful. The
    failed call may also have left peers waiting for calls this rank will
    not make, so, as for an uncaught exception, the job is aborted
    (``jaxcomm.abort_on_exception``).
    """
    sys.stderr.write(f"jaxcomm: at exit: {type(failure).__name__}: {failure}\n")
    sys.stderr.flush()
    if _abort.aborting():
        _abort.abort_job("a failure at exit")
    _kernels_cpu.exit_with_status(1)


@atexit.register
def _drain_before_finalize():
    try:
        if MPI.Is_initialized() and not MPI.Is_finalized():
            try:
                sync()
                raise_unfinished_requests(at_exit=True)
            except Exception as failure:  # noqa: BLE001 (reported, and in the exit status)
                _report_at_exit(failure)
    finally:
        if cuda_kernels is not None:
            cuda_kernels.free_staging()
