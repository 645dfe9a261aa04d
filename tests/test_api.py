"""JaxComm construction and lifetime, package metadata, docstrings."""

import inspect
import pathlib
import re
import subprocess
import sys
from functools import partial

import jax.numpy as jnp
import jaxlib
import numpy as np
import pytest
from at_once import at_once
from conftest import (
    THREAD_LEVEL,
    environment_without_launcher,
    mpi_debug,
    run_job,
    spawns_own_mpi,
    unmonitored,
)
from mpi4py import MPI

import jaxcomm
import jaxcomm.compat.mpi4jax as mpi4jax
from jaxcomm import JaxComm, _build_info, _runtime


def test_version_and_typing_marker():
    assert isinstance(jaxcomm.__version__, str) and jaxcomm.__version__.count(".") >= 2
    assert (pathlib.Path(jaxcomm.__file__).parent / "py.typed").exists()


def _public_callables():
    for name in jaxcomm.__all__:
        obj = getattr(jaxcomm, name)
        if callable(obj):
            yield name, obj
    for name, member in inspect.getmembers(JaxComm):
        if not name.startswith("_"):
            yield f"JaxComm.{name}", member
    for name in mpi4jax.__all__:
        yield f"compat.mpi4jax.{name}", getattr(mpi4jax, name)


@pytest.mark.parametrize("name,obj", list(_public_callables()), ids=lambda v: str(v)[:40])
def test_public_names_have_docstrings(name, obj):
    doc = inspect.getdoc(obj.fget if isinstance(obj, property) else obj)
    assert doc, f"{name} has no docstring"
    lines = doc.splitlines()
    assert lines[0].strip() and lines[0].endswith("."), f"{name}: summary line must be a sentence"
    # The API reference and help() show the first line alone as the summary.
    assert len(lines) == 1 or not lines[1].strip(), (
        f"{name}: the summary must fit on the first line, followed by a blank line"
    )


def test_every_public_name_is_checked_for_a_docstring():
    names = {name for name, _ in _public_callables()}
    assert set(jaxcomm.__all__) - {"__version__"} <= names


def test_build_info_names_the_mpi_it_was_built_against_and_the_one_running():
    info = jaxcomm.build_info()
    assert set(info) == {
        "mpi_built",
        "mpi_compiler",
        "mpi_runtime",
        "mpi_library",
        "cuda",
        "jaxlib_built",
        "mpi_abi",
    }
    # Kernels built for the running jaxlib or an older one (a newer one is refused at import).
    built = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)\S* \(XLA FFI API \d+\.\d+\)", info["jaxlib_built"])
    assert built, info["jaxlib_built"]
    running = tuple(int(part) for part in jaxlib.__version__.split(".")[:3])
    assert tuple(int(part) for part in built.groups()) <= running
    library = MPI.Get_library_version()
    assert info["mpi_library"] and info["mpi_library"].split()[0] in library
    vendor = "MPICH" if "MPICH" in library else "Open MPI" if "Open MPI" in library else None
    if _build_info.MPI_ABIS:
        # A binary wheel: the kernels of the family whose libmpi mpi4py loaded.
        soname = _runtime.MPI_ABI_SONAMES[info["mpi_abi"]]
        assert f"({soname})" in info["mpi_built"]
    elif vendor is not None:
        # The import check passed, so the build's vendor and major.minor version match.
        assert info["mpi_runtime"].startswith(vendor) and info["mpi_built"].startswith(vendor)
        built, running = (
            info[k].rsplit(" ", 1)[1].split(".")[:2] for k in ("mpi_built", "mpi_runtime")
        )
        assert built == running
    assert info["cuda"] == (jaxcomm.cuda_info()["built"])


_ROOT = pathlib.Path(__file__).resolve().parent.parent
_EXAMPLE_NAME = re.compile(r"examples/[A-Za-z0-9_]+\.py")


def _documented_examples():
    pages = [_ROOT / "README.md", *sorted((_ROOT / "docs").rglob("*.md"))]
    return {
        name: page.relative_to(_ROOT)
        for page in pages
        for name in _EXAMPLE_NAME.findall(page.read_text(encoding="utf-8"))
    }


def test_examples_named_in_the_docs_exist():
    documented = _documented_examples()
    assert "examples/global_sum.py" in documented  # the pattern finds what it should
    missing = {name: str(page) for name, page in documented.items() if not (_ROOT / name).is_file()}
    assert not missing, f"examples named in the docs but not in the tree: {missing}"


def test_mpi_wrapping_methods_name_their_mpi_call():
    wrapped = {
        "allreduce": "MPI_Allreduce",
        "reduce": "MPI_Reduce",
        "scan": "MPI_Scan",
        "exscan": "MPI_Exscan",
        "reduce_scatter": "MPI_Reduce_scatter_block",
        "bcast": "MPI_Bcast",
        "barrier": "MPI_Barrier",
        "send": "MPI_Send",
        "recv": "MPI_Recv",
        "sendrecv": "MPI_Sendrecv",
        "allgather": "MPI_Allgather",
        "gather": "MPI_Gather",
        "scatter": "MPI_Scatter",
        "alltoall": "MPI_Alltoall",
        "allgatherv": "MPI_Allgatherv",
        "gatherv": "MPI_Gatherv",
        "scatterv": "MPI_Scatterv",
        "alltoallv": "MPI_Alltoallv",
        "neighbor_allgatherv": "MPI_Neighbor_allgatherv",
        "ineighbor_allgatherv": "MPI_Ineighbor_allgatherv",
        "isend": "MPI_Isend",
        "irecv": "MPI_Irecv",
        "iallreduce": "MPI_Iallreduce",
        "ibcast": "MPI_Ibcast",
        "iallgather": "MPI_Iallgather",
        "ialltoall": "MPI_Ialltoall",
        "wait": "MPI_Wait",
        "waitall": "MPI_Wait",
    }
    for method, call in wrapped.items():
        assert call in getattr(JaxComm, method).__doc__


def test_rejects_non_intracomms():
    with pytest.raises(TypeError, match="Intracomm"):
        JaxComm("world")
    with pytest.raises(TypeError, match="Intracomm"):
        JaxComm(MPI.COMM_NULL)
    with pytest.raises(TypeError, match="Intracomm"):
        JaxComm(MPI.Comm(MPI.COMM_WORLD))


@pytest.mark.mpi
def test_clone_properties_and_free():
    world = MPI.COMM_WORLD
    jc = JaxComm(world)
    assert (jc.rank, jc.size) == (world.rank, world.size)
    assert jc.comm != world
    assert MPI.Comm.Compare(jc.comm, world) == MPI.CONGRUENT
    assert "rank" in repr(jc)
    jc.free()
    assert jc.freed and "freed" in repr(jc)
    jc.free()  # twice is harmless
    with pytest.raises(RuntimeError, match="freed"):
        jc.allreduce(jnp.ones(2))
    with pytest.raises(RuntimeError, match="freed"):
        _ = jc.comm


@pytest.mark.mpi
def test_default_comm_context_manager_and_subcommunicators():
    world = MPI.COMM_WORLD
    with JaxComm() as jc:
        assert jc.size == world.size
        np.testing.assert_array_equal(jc.allreduce(jnp.ones(2)), np.full(2, world.size))
    assert jc.freed

    # A split communicator: even and odd ranks reduce separately.
    half = world.Split(world.rank % 2, world.rank)
    with JaxComm(half) as jc_half:
        members = [r for r in range(world.size) if r % 2 == world.rank % 2]
        assert int(jc_half.allreduce(world.rank)) == sum(members)
    half.Free()

    # A Cartesian communicator is an Intracomm too.
    cart = world.Create_cart([world.size], periods=[True])
    with JaxComm(cart) as jc_cart:
        assert isinstance(jc_cart.comm, MPI.Cartcomm)
        left, right = cart.Shift(0, 1)
        got = jc_cart.sendrecv(jnp.asarray(world.rank), jnp.asarray(0), source=left, dest=right)
        assert int(got) == left
    cart.Free()


@unmonitored
@pytest.mark.x64
@pytest.mark.mpi
def test_debug_log_lines(jc, capfd):
    with mpi_debug():
        jc.allreduce(jnp.ones(9, jnp.float32)).block_until_ready()
        jc.reduce(jnp.ones(9, jnp.float32), root=jc.size - 1).block_until_ready()
        jc.scan(jnp.ones(9, jnp.float32), op=MPI.MAX).block_until_ready()
        jc.exscan(jnp.ones(9, jnp.int8), op=MPI.BXOR).block_until_ready()
        jc.reduce_scatter(jnp.ones((jc.size, 2, 3), jnp.float32)).block_until_ready()
        right, left = (jc.rank + 1) % jc.size, (jc.rank - 1) % jc.size
        jc.sendrecv(jnp.ones(2), jnp.ones(2), source=left, dest=right).block_until_ready()
        jc.barrier()
    err = capfd.readouterr().err.splitlines()
    r = jc.rank
    assert f"r{r} | MPI_Allreduce op SUM count 9 float32" in err
    assert f"r{r} | MPI_Reduce op SUM root {jc.size - 1} count 9 float32" in err
    assert f"r{r} | MPI_Scan op MAX count 9 float32" in err
    assert f"r{r} | MPI_Exscan op BXOR count 9 int8" in err
    assert f"r{r} | MPI_Reduce_scatter_block op SUM count 6 float32" in err
    assert (
        f"r{r} | MPI_Sendrecv -> {right} tag 0 count 2 float64 <- {left} tag any count 2 float64"
        in err
    )
    assert f"r{r} | MPI_Barrier" in err
    jc.barrier()
    assert capfd.readouterr().err == ""


def test_thread_level_is_the_one_asked_for():
    want = {"multiple": MPI.THREAD_MULTIPLE, "serialized": MPI.THREAD_SERIALIZED}[THREAD_LEVEL]
    assert MPI.Query_thread() == want


@spawns_own_mpi
def test_exit_with_dispatched_work_does_not_hang(tmp_path):
    # A program that leaves jitted MPI work behind and simply ends: the exit
    # hook must drain it before mpi4py finalises MPI.
    script = tmp_path / "leave_work_behind.py"
    script.write_text(
        "import jax, jax.numpy as jnp\n"
        "from jaxcomm import JaxComm\n"
        "jc = JaxComm()\n"
        "f = jax.jit(lambda x: [jc.allreduce(x + i) for i in range(20)])\n"
        "outs = [f(jnp.ones(100_000)) for _ in range(5)]\n"
        "print('dispatched', flush=True)\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "dispatched" in done.stdout


_SERIALIZED_PROGRAM = """
import mpi4py
mpi4py.rc.thread_level = "serialized"
import jax, jax.numpy as jnp, numpy as np
import jaxcomm
from mpi4py import MPI
from jaxcomm import JaxComm
assert MPI.Query_thread() == MPI.THREAD_SERIALIZED
jc = JaxComm()
rank, size = jc.rank, jc.size
flight = jax.jit(lambda x: [jc.allreduce(x + i) for i in range(20)])
# Each creation below is a collective MPI call from this thread while
# dispatched work may still be inside MPI on one of XLA's: it must wait.
pending = flight(jnp.ones(100_000))
sub = JaxComm(MPI.COMM_WORLD)
later = flight(jnp.ones(100_000))
grid = JaxComm.from_cart([size], periods=[True])
half = sub.split(color=rank % 2)
loop = jax.jit(lambda v: jax.lax.fori_loop(0, 1000, lambda i, w: sub.allreduce(w) / size, v))
np.testing.assert_allclose(loop(jnp.full(3, 1.0 + rank)), np.full(3, (size + 1) / 2))
source, dest = grid.cart_shift(0)
ring = grid.sendrecv(jnp.full(2, rank), jnp.zeros(2, int), source=source, dest=dest)
np.testing.assert_array_equal(ring, np.full(2, (rank - 1) % size))
np.testing.assert_array_equal(jc.wait(jc.iallreduce(jnp.ones(4))), np.full(4, size))
np.testing.assert_allclose(pending[19], np.full(100_000, 20.0 * size))
np.testing.assert_allclose(later[0], np.full(100_000, size))
jaxcomm.sync()  # before the program's own mpi4py calls
assert MPI.COMM_WORLD.allreduce(1) == size
for c in (half, grid, sub, jc):
    c.free()
open(f"ok-{rank}", "w").close()
"""


@spawns_own_mpi
@pytest.mark.parametrize("ranks", [1, 2])
def test_serialized_thread_level_runs_programs(tmp_path, ranks):
    done, _ = run_job(tmp_path, _SERIALIZED_PROGRAM, ranks=ranks, limit=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.glob("ok-*")) == [f"ok-{r}" for r in range(ranks)]


LOW_LEVELS = ["single", "funneled"]


def _low_level(folder, level):
    script = folder / "low.py"
    script.write_text(
        "import mpi4py\n"
        f"mpi4py.rc.thread_level = {level!r}\n"
        "from jaxcomm import JaxComm\n"
        "JaxComm()\n"
    )
    return subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=environment_without_launcher(),
        cwd=folder,
        timeout=120,
    )


@pytest.fixture(scope="module")
def low_levels(tmp_path_factory):
    """A program at each level below serialized, the programs started together."""
    jobs = (partial(_low_level, tmp_path_factory.mktemp(level), level) for level in LOW_LEVELS)
    return dict(zip(LOW_LEVELS, at_once(*jobs)))


@spawns_own_mpi
@pytest.mark.parametrize("level", LOW_LEVELS)
def test_thread_levels_below_serialized_are_refused(low_levels, level):
    done = low_levels[level]
    assert done.returncode == 1
    assert "jaxcomm needs MPI_THREAD_MULTIPLE (mpi4py's default) or MPI_THREAD_SERIALIZED" in (
        done.stderr
    )


@spawns_own_mpi
def test_set_check_clones_the_same_communicators_on_every_rank(tmp_path):
    # A JaxComm in a reference cycle outlives its last reference until the
    # cycle collector runs, which one rank may do earlier than another: the
    # checker's collective clones must not depend on it.
    done, _ = run_job(
        tmp_path,
        "import gc\n"
        "import jax.numpy as jnp\n"
        "import jaxcomm\n"
        "from jaxcomm import JaxComm\n"
        "jc = JaxComm()\n"
        "gc.disable()\n"
        "dropped = JaxComm()\n"
        "dropped.me = dropped\n"
        "del dropped\n"
        "if jc.rank == 0:\n"
        "    gc.collect()\n"
        "jaxcomm.set_check(True)\n"
        "assert float(jc.allreduce(jnp.ones(())).block_until_ready()) == jc.size\n"
        "open(f'ok-{jc.rank}', 'w').close()\n",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.glob("ok-*")) == ["ok-0", "ok-1"]


def test_kernels_built_for_another_mpi_are_refused(monkeypatch):
    vendor, version = _runtime._runtime_mpi()
    if not _build_info.MPI_ABIS:
        _runtime._check_mpi_matches()  # the installed build matches
    # What a build against one MPI checks (a binary wheel checks the ABI family).
    monkeypatch.setattr(_build_info, "MPI_ABIS", ())
    monkeypatch.setattr(_build_info, "MPI_VERSION", version)
    other = "Open MPI" if vendor == "MPICH" else "MPICH"
    monkeypatch.setattr(_build_info, "MPI_VENDOR", other)
    with pytest.raises(ImportError, match=f"built against {other} .* mpi4py is running {vendor}"):
        _runtime._check_mpi_matches()
    monkeypatch.setattr(_build_info, "MPI_VENDOR", vendor)
    major = int(version.split(".")[0])
    monkeypatch.setattr(_build_info, "MPI_VERSION", f"{major + 1}.0.0")
    with pytest.raises(ImportError, match="Rebuild jaxcomm against the MPI that mpi4py uses"):
        _runtime._check_mpi_matches()
