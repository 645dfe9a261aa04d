"""jaxcomm.compat.mpi4jax: mpi4jax 0.9's functions, eager and jitted, and where they differ from JaxComm."""

import inspect
import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from at_once import at_once
from conftest import rank_data, run_job, spawns_own_mpi
from mpi4py import MPI

import jaxcomm
import jaxcomm.compat.mpi4jax as mpi4jax
from jaxcomm import _runtime
from jaxcomm.compat.mpi4jax import NOTSET

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()

# mpi4jax 0.9.1's signatures: (name, kind, default) per parameter.
P, K = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
E = inspect.Parameter.empty
SIGNATURES = {
    "allreduce": [("x", P, E), ("op", P, E), ("comm", K, None), ("token", K, NOTSET)],
    "reduce": [("x", P, E), ("op", P, E), ("root", P, E), ("comm", K, None), ("token", K, NOTSET)],
    "scan": [("x", P, E), ("op", P, E), ("comm", K, None), ("token", K, NOTSET)],
    "bcast": [("x", P, E), ("root", P, E), ("comm", K, None), ("token", K, NOTSET)],
    "barrier": [("comm", K, None), ("token", K, NOTSET)],
    "allgather": [("x", P, E), ("comm", K, None), ("token", K, NOTSET)],
    "gather": [("x", P, E), ("root", P, E), ("comm", K, None), ("token", K, NOTSET)],
    "scatter": [("x", P, E), ("root", P, E), ("comm", K, None), ("token", K, NOTSET)],
    "alltoall": [("x", P, E), ("comm", K, None), ("token", K, NOTSET)],
    "send": [
        ("x", P, E),
        ("dest", P, E),
        ("tag", K, 0),
        ("comm", K, None),
        ("token", K, NOTSET),
    ],
    "recv": [
        ("x", P, E),
        ("source", P, MPI.ANY_SOURCE),
        ("tag", K, MPI.ANY_TAG),
        ("comm", K, None),
        ("status", K, None),
        ("token", K, NOTSET),
    ],
    "sendrecv": [
        ("sendbuf", P, E),
        ("recvbuf", P, E),
        ("source", P, E),
        ("dest", P, E),
        ("sendtag", K, 0),
        ("recvtag", K, MPI.ANY_TAG),
        ("comm", K, None),
        ("status", K, None),
        ("token", K, NOTSET),
    ],
    "has_cuda_support": [],
    "has_sycl_support": [],
}


def test_the_public_names_and_signatures_are_mpi4jax_s():
    assert sorted(mpi4jax.__all__) == sorted(SIGNATURES)
    for name, expected in SIGNATURES.items():
        parameters = inspect.signature(getattr(mpi4jax, name)).parameters.values()
        assert [(p.name, p.kind, p.default) for p in parameters] == expected, name
        assert getattr(mpi4jax, name).__doc__, name


def test_support_queries_are_bools():
    # The suite's backends have started: the GPUs JAX has decide.
    info = jaxcomm.cuda_info()
    assert mpi4jax.has_cuda_support() is (info["built"] and info["gpus"] > 0)
    assert mpi4jax.has_sycl_support() is False


def test_version_is_the_mpi4jax_version_implemented():
    assert mpi4jax.__version__ == "0.9.1"


HAS_CUDA_SUPPORT = """
import importlib.metadata
import jaxcomm.compat.mpi4jax as mpi4jax
from jaxcomm import _compat, _runtime
assert not _compat.backends_initialized(), "importing the compat module started JAX"
answer = mpi4jax.has_cuda_support()
plugin = any(e.name.startswith("xla_cuda") for e in importlib.metadata.entry_points(group="jax_plugins"))
print(answer, _compat.backends_initialized(), _runtime.cuda_kernels is not None and plugin)
"""


@spawns_own_mpi
def test_has_cuda_support_starts_no_backend_and_needs_a_cuda_jax(compat_jobs):
    # Started backends would make a later jax.distributed.initialize() fail.
    done = compat_jobs["has_cuda_support"]
    assert done.returncode == 0, done.stderr
    answer, started, expected = done.stdout.split()
    assert started == "False"
    assert answer == expected


def _import_compat(tmp_path, **env):
    script = "import warnings; warnings.simplefilter('always')\n"
    script += "import jaxcomm.compat.mpi4jax\nfrom jaxcomm import _gpu\nprint(_gpu._override)\n"
    return run_job(tmp_path, script, ranks=1, **env)[0]


USE_CUDA_MPI = [("1", "(True, 'MPI4JAX_USE_CUDA_MPI')"), ("off", "(False, 'MPI4JAX_USE_CUDA_MPI')")]
REFUSED = [
    (
        {"MPI4JAX_USE_CUDA_MPI": "maybe"},
        "MPI4JAX_USE_CUDA_MPI='maybe': .* accepts 1, true or on",
    ),
    (
        {"MPI4JAX_USE_CUDA_MPI": "1", "JAXCOMM_CUDA_AWARE": "0"},
        "MPI4JAX_USE_CUDA_MPI=1 contradicts JAXCOMM_CUDA_AWARE=0",
    ),
    ({"MPI4JAX_USE_SYCL_MPI": "1"}, "MPI4JAX_USE_SYCL_MPI is set, but jaxcomm has .*no SYCL"),
    ({"MPI4JAX_DEBUG": "yes"}, "MPI4JAX_DEBUG='yes'"),
]
SKIP_ABI_CHECK = {"MPI4JAX_SKIP_ABI_CHECK": "1"}
DEBUG = [("1", True), ("0", False)]


def _debug_job(tmp_path, value):
    script = (
        "import jax.numpy as jnp\nfrom mpi4py import MPI\nimport jaxcomm.compat.mpi4jax as mpi4jax\n"
        "print(float(mpi4jax.allreduce(jnp.ones(2), op=MPI.SUM)[0]))\n"
    )
    return run_job(tmp_path, script, ranks=1, MPI4JAX_DEBUG=value)[0]


def _settings(env):
    return tuple(sorted(env.items()))


@pytest.fixture(scope="module")
def compat_jobs(tmp_path_factory):
    """The one-rank jobs whose results this file's cases check, started together."""
    cases = [{"MPI4JAX_USE_CUDA_MPI": value} for value, _ in USE_CUDA_MPI]
    cases += [env for env, _ in REFUSED] + [SKIP_ABI_CHECK]
    jobs = {
        _settings(env): partial(_import_compat, tmp_path_factory.mktemp("compat"), **env)
        for env in cases
    }
    jobs["has_cuda_support"] = partial(
        lambda folder: run_job(folder, HAS_CUDA_SUPPORT, ranks=1)[0],
        tmp_path_factory.mktemp("compat"),
    )
    for value, _ in DEBUG:
        jobs[("debug", value)] = partial(_debug_job, tmp_path_factory.mktemp("compat"), value)
    return dict(zip(jobs, at_once(*jobs.values())))


@spawns_own_mpi
@pytest.mark.parametrize("value, override", USE_CUDA_MPI)
def test_mpi4jax_use_cuda_mpi_chooses_the_gpu_data_path(compat_jobs, value, override):
    done = compat_jobs[_settings({"MPI4JAX_USE_CUDA_MPI": value})]
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == override


@spawns_own_mpi
@pytest.mark.parametrize("env, message", REFUSED)
def test_mpi4jax_settings_that_cannot_be_honoured_are_refused(compat_jobs, env, message):
    done = compat_jobs[_settings(env)]
    assert done.returncode != 0
    assert re.search(message, done.stderr), done.stderr


@spawns_own_mpi
@pytest.mark.parametrize("value, logged", DEBUG)
def test_mpi4jax_debug_logs_every_mpi_call(compat_jobs, value, logged):
    done = compat_jobs[("debug", value)]
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1.0"]
    assert ("r0 | MPI_Allreduce" in done.stderr) == logged, done.stderr


@spawns_own_mpi
def test_mpi4jax_skip_abi_check_is_not_silently_ignored(compat_jobs):
    done = compat_jobs[_settings(SKIP_ABI_CHECK)]
    assert done.returncode == 0, done.stderr
    assert "MPI4JAX_SKIP_ABI_CHECK has no effect on jaxcomm" in done.stderr


# Every function, eager and jitted -------------------------------------------------

MODES = ["eager", "jit"]


def _run(mode, f, *args):
    return f(*args) if mode == "eager" else jax.jit(f)(*args)


def _x(rank=RANK, shape=(3, 2)):
    return jnp.asarray(rank_data(rank, shape, np.float32))


def _sum_of(shape=(3, 2)):
    return sum(rank_data(r, shape, np.float32) for r in range(SIZE))


@pytest.mark.mpi
@pytest.mark.parametrize("mode", MODES)
def test_allreduce(mode):
    np.testing.assert_array_equal(
        _run(mode, lambda x: mpi4jax.allreduce(x, MPI.SUM), _x()), _sum_of()
    )
    got = _run(mode, lambda x: mpi4jax.allreduce(x, op=MPI.MAX), _x())
    np.testing.assert_array_equal(
        got, np.max([rank_data(r, (3, 2), np.float32) for r in range(SIZE)], 0)
    )


@pytest.mark.mpi
@pytest.mark.parametrize("mode", MODES)
def test_scan(mode):
    got = _run(mode, lambda x: mpi4jax.scan(x, MPI.SUM), _x())
    np.testing.assert_array_equal(
        got, sum(rank_data(r, (3, 2), np.float32) for r in range(RANK + 1))
    )


@pytest.mark.mpi
@pytest.mark.parametrize("mode", MODES)
def test_reduce_returns_the_input_off_root(mode):
    x = _x()
    for root in range(SIZE):
        got = _run(mode, lambda v: mpi4jax.reduce(v, MPI.SUM, root), x)
        np.testing.assert_array_equal(got, _sum_of() if RANK == root else x)
    if RANK != 0:
        assert mpi4jax.reduce(x, MPI.SUM, 0) is x
    else:
        mpi4jax.reduce(x, MPI.SUM, 0)


@pytest.mark.mpi
@pytest.mark.parametrize("mode", MODES)
def test_bcast_returns_the_input_on_root(mode):
    x = _x()
    for root in range(SIZE):
        got = _run(mode, lambda v: mpi4jax.bcast(v, root), x)
        np.testing.assert_array_equal(got, rank_data(root, (3, 2), np.float32))
    plain = np.arange(3.0)
    got = mpi4jax.bcast(plain, 0)
    if RANK == 0:
        assert got is plain
    else:
        np.testing.assert_array_equal(got, plain)


@pytest.mark.mpi
@pytest.mark.parametrize("mode", MODES)
def test_barrier_and_send_return_an_empty_list(mode):
    assert _run(mode, lambda: mpi4jax.barrier()) == []
    assert mpi4jax.barrier(comm=WORLD) == []


@pytest.mark.mpi
@pytest.mark.parametrize("mode", MODES)
def test_allgather(mode):
    got = _run(mode, mpi4jax.allgather, _x())
    np.testing.assert_array_equal(
        got, np.stack([rank_data(r, (3, 2), np.float32) for r in range(SIZE)])
    )


@pytest.mark.mpi
@pytest.mark.parametrize("mode", MODES)
def test_gather_returns_the_input_off_root(mode):
    x = _x()
    stacked = np.stack([rank_data(r, (3, 2), np.float32) for r in range(SIZE)])
    for root in range(SIZE):
        got = _run(mode, lambda v: mpi4jax.gather(v, root), x)
        np.testing.assert_array_equal(got, stacked if RANK == root else x)
        assert got.shape == ((SIZE, 3, 2) if RANK == root else (3, 2))
    if RANK != 0:
        assert mpi4jax.gather(x, 0) is x
    else:
        mpi4jax.gather(x, 0)


@pytest.mark.mpi
@pytest.mark.parametrize("mode", MODES)
def test_scatter_takes_the_result_shape_off_root(mode):
    for root in range(SIZE):
        data = np.stack([rank_data(r + 10, (3, 2), np.float32) for r in range(SIZE)])
        x = jnp.asarray(data) if RANK == root else jnp.full((3, 2), -1.0, jnp.float32)
        got = _run(mode, lambda v: mpi4jax.scatter(v, root), x)
        np.testing.assert_array_equal(got, data[RANK])
        if RANK != root:
            np.testing.assert_array_equal(x, np.full((3, 2), -1.0))


@pytest.mark.mpi
@pytest.mark.parametrize("mode", MODES)
def test_scatter_under_vmap_works_on_every_rank(mode):
    batch = 3
    for root in range(SIZE):
        data = np.stack(
            [
                np.stack([rank_data(10 * b + r, (2,), np.float32) for r in range(SIZE)])
                for b in range(batch)
            ]
        )
        x = jnp.asarray(data) if RANK == root else jnp.full((batch, 2), -1.0, jnp.float32)
        got = _run(mode, jax.vmap(lambda v: mpi4jax.scatter(v, root)), x)
        np.testing.assert_array_equal(got, data[:, RANK])


@pytest.mark.mpi
@pytest.mark.parametrize("mode", MODES)
def test_alltoall(mode):
    x = jnp.asarray(np.arange(SIZE, dtype=np.float32)[:, None] + 10 * RANK) * jnp.ones((SIZE, 2))
    got = _run(mode, mpi4jax.alltoall, x)
    np.testing.assert_array_equal(
        got, (np.arange(SIZE) * 10.0 + RANK)[:, None] * np.ones((SIZE, 2))
    )


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", MODES)
def test_send_and_recv_with_status(mode):
    status = MPI.Status()
    if RANK == 0:
        assert _run(mode, lambda v: mpi4jax.send(v, 1, tag=4), _x()) == []
    elif RANK == 1:
        got = _run(mode, lambda t: mpi4jax.recv(t, status=status), jnp.zeros((3, 2), jnp.float32))
        np.testing.assert_array_equal(got, rank_data(0, (3, 2), np.float32))
        assert (status.Get_source(), status.Get_tag(), status.Get_count(MPI.FLOAT)) == (0, 4, 6)
        got = _run(mode, lambda t: mpi4jax.recv(t, 0, tag=5), jnp.zeros(2, jnp.int32))
        np.testing.assert_array_equal(got, [7, 8])
    if RANK == 0:
        mpi4jax.send(jnp.array([7, 8], jnp.int32), dest=1, tag=5)
    mpi4jax.barrier()


@pytest.mark.mpi
@pytest.mark.parametrize("mode", MODES)
def test_sendrecv_on_a_ring_with_status(mode):
    right, left = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    status = MPI.Status()

    def exchange(x):
        return mpi4jax.sendrecv(x, x, left, right, sendtag=RANK, status=status)

    got = _run(mode, exchange, _x())
    np.testing.assert_array_equal(got, rank_data(left, (3, 2), np.float32))
    assert (status.Get_source(), status.Get_tag(), status.Get_count(MPI.FLOAT)) == (left, left, 6)


@pytest.mark.mpi
@pytest.mark.parametrize("mode", MODES)
def test_sendrecv_with_another_receive_shape_and_dtype(mode):
    # As in mpi4jax, recvbuf gives the result's shape and dtype, which may
    # differ from sendbuf's.
    right, left = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    status = MPI.Status()

    def exchange(x):
        return mpi4jax.sendrecv(x, jnp.zeros(4, jnp.int32), left, right, sendtag=7, status=status)

    got = _run(mode, exchange, jnp.arange(4, dtype=jnp.int32) + 10 * RANK)
    np.testing.assert_array_equal(got, np.arange(4) + 10 * left)
    assert got.dtype == jnp.int32
    assert (status.Get_source(), status.Get_tag(), status.Get_count(MPI.INT)) == (left, 7, 4)
    wide = jax.ShapeDtypeStruct((2, 3), jnp.float32)
    got = _run(
        mode, lambda x: mpi4jax.sendrecv(x, wide, left, right), jnp.full(6, RANK, jnp.float32)
    )
    np.testing.assert_array_equal(got, np.full((2, 3), left))


# More than mpi4jax: every transformation --------------------------------------------


@pytest.mark.mpi
def test_transformations_mpi4jax_lacks():
    x = _x()
    # allreduce(SUM) transposes to the identity (mpi4jax's convention too).
    grad = jax.grad(lambda v: mpi4jax.allreduce(v, MPI.SUM).sum())(x)
    np.testing.assert_array_equal(grad, np.ones((3, 2)))
    batched = jax.vmap(mpi4jax.allgather)(jnp.stack([x, 2 * x]))
    np.testing.assert_array_equal(
        batched[1], 2 * np.stack([rank_data(r, (3, 2), np.float32) for r in range(SIZE)])
    )
    # mpi4jax refuses forward mode through sendrecv; jaxcomm differentiates it.
    right, left = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    jacobian = jax.jacfwd(lambda v: mpi4jax.sendrecv(v, v, left, right).sum())(x)
    np.testing.assert_array_equal(jacobian, np.ones((3, 2)))
    got = mpi4jax.allreduce(x.astype(jnp.bfloat16), MPI.SUM)
    np.testing.assert_array_equal(got.astype(np.float32), _sum_of())


# Errors, as mpi4jax raises them --------------------------------------------------


CALLS = {
    "allreduce": lambda **kw: mpi4jax.allreduce(jnp.ones(2), MPI.SUM, **kw),
    "reduce": lambda **kw: mpi4jax.reduce(jnp.ones(2), MPI.SUM, 0, **kw),
    "scan": lambda **kw: mpi4jax.scan(jnp.ones(2), MPI.SUM, **kw),
    "bcast": lambda **kw: mpi4jax.bcast(jnp.ones(2), 0, **kw),
    "barrier": lambda **kw: mpi4jax.barrier(**kw),
    "allgather": lambda **kw: mpi4jax.allgather(jnp.ones(2), **kw),
    "gather": lambda **kw: mpi4jax.gather(jnp.ones(2), 0, **kw),
    "scatter": lambda **kw: mpi4jax.scatter(jnp.ones((SIZE, 2)), 0, **kw),
    "alltoall": lambda **kw: mpi4jax.alltoall(jnp.ones((SIZE, 2)), **kw),
    "send": lambda **kw: mpi4jax.send(jnp.ones(2), 0, **kw),
    "recv": lambda **kw: mpi4jax.recv(jnp.ones(2), 0, **kw),
    "sendrecv": lambda **kw: mpi4jax.sendrecv(jnp.ones(2), jnp.ones(2), 0, 0, **kw),
}


@pytest.mark.mpi
@pytest.mark.parametrize("name", sorted(CALLS))
@pytest.mark.parametrize("token", [None, object()], ids=["None", "a token"])
def test_token_is_refused(name, token):
    with pytest.raises(RuntimeError, match="Explicit token management is not supported"):
        CALLS[name](token=token)


@pytest.mark.mpi
@pytest.mark.parametrize("name", sorted(CALLS))
@pytest.mark.parametrize("comm", [5, MPI.Comm(), "world"], ids=["int", "Comm", "str"])
def test_a_communicator_of_another_type_is_a_type_error(name, comm):
    with pytest.raises(TypeError, match="comm must be an mpi4py Intracomm"):
        CALLS[name](comm=comm)


@pytest.mark.mpi
def test_bad_arguments_raise_mpi4jax_s_exception_types():
    x = jnp.ones(2)
    for op in ("sum", None):
        with pytest.raises(TypeError):
            mpi4jax.allreduce(x, op)
    for root in (0.0, True, "0", None):
        with pytest.raises(TypeError):
            mpi4jax.bcast(x, root)
        with pytest.raises(TypeError):
            mpi4jax.gather(x, root)
    with pytest.raises(TypeError):
        mpi4jax.send(x, 1.0)
    with pytest.raises(TypeError):
        mpi4jax.recv(x, 0, tag="a")
    with pytest.raises(TypeError, match="status must be an MPI.Status"):
        mpi4jax.recv(x, 0, status="s")
    with pytest.raises(TypeError):
        mpi4jax.allreduce(x, MPI.SUM, WORLD)  # comm is keyword-only
    with pytest.raises(TypeError, match="static"):
        jax.jit(lambda v, r: mpi4jax.bcast(v, r))(x, 0)


@pytest.mark.mpi
def test_alltoall_and_scatter_check_the_leading_axis():
    with pytest.raises(ValueError, match=r"Alltoall input must have shape \(nproc, ...\)"):
        mpi4jax.alltoall(jnp.ones((SIZE + 1, 2)))
    # Only root checks scatter's input: the other ranks pass the result's shape.
    if RANK == 0:
        with pytest.raises(ValueError, match=r"Scatter input must have shape \(nproc, ...\)"):
            mpi4jax.scatter(jnp.ones((SIZE + 1, 2)), 0)


# Communicators passed per call ----------------------------------------------------


@pytest.fixture
def watchdog():
    """A short watchdog (JAXCOMM_TIMEOUT's), so a regression that hangs ends the job with a diagnosis."""
    jaxcomm.set_timeout(60)
    yield
    jaxcomm.set_timeout(_runtime._env_seconds("JAXCOMM_TIMEOUT"))


@pytest.mark.mpi
def test_comm_world_and_none_each_have_a_jaxcomm_made_at_import():
    none, world = mpi4jax._jaxcomm(None), mpi4jax._jaxcomm(WORLD)
    assert none is not world and mpi4jax._jaxcomm(None) is none
    assert mpi4jax._jaxcomm(MPI.Intracomm(WORLD)) is world
    for jc in (none, world):
        assert jc.comm != WORLD and MPI.Comm.Compare(jc.comm, WORLD) == MPI.CONGRUENT
    assert MPI.Comm.Compare(none.comm, world.comm) == MPI.CONGRUENT


@pytest.mark.mpi(min_size=2)
def test_comm_none_is_a_communicator_of_its_own(watchdog):
    # As in mpi4jax (a private clone of COMM_WORLD): the first message, sent
    # with comm=None, must not match the first receive on COMM_WORLD.
    if RANK == 0:
        mpi4jax.send(jnp.full(2, 1.0), 1, tag=5, comm=None)
        mpi4jax.send(jnp.full(2, 2.0), 1, tag=5, comm=WORLD)
    elif RANK == 1:
        on_world = mpi4jax.recv(jnp.zeros(2), 0, tag=5, comm=WORLD)
        on_none = mpi4jax.recv(jnp.zeros(2), 0, tag=5, comm=None)
        np.testing.assert_array_equal(on_world, [2.0, 2.0])
        np.testing.assert_array_equal(on_none, [1.0, 1.0])


@pytest.mark.mpi
def test_a_split_communicator_s_first_call_is_a_collective_of_its_ranks(watchdog):
    color = RANK % 2
    sub = WORLD.Split(color, RANK)
    try:
        members = [r for r in range(SIZE) if r % 2 == color]
        got = mpi4jax.allreduce(jnp.full(2, RANK, jnp.float32), MPI.SUM, comm=sub)
        np.testing.assert_array_equal(got, np.full(2, sum(members)))
        # Another Python object for the same communicator finds the same JaxComm.
        assert mpi4jax._jaxcomm(MPI.Intracomm(sub)) is mpi4jax._jaxcomm(sub)
        got = jax.jit(lambda v: mpi4jax.allgather(v, comm=sub))(jnp.full(1, RANK))
        np.testing.assert_array_equal(got[:, 0], members)
    finally:
        jaxcomm.sync()
        sub.Free()


@pytest.mark.mpi(min_size=2)
def test_first_call_on_world_may_be_a_message_between_some_ranks(watchdog):
    # Ranks 0 and 1 exchange first; the others wait, through plain mpi4py,
    # for a message rank 1 sends only after its exchange. A JaxComm created
    # at this first call would wait for ranks that never come (the watchdog,
    # when it is on, would end the job).
    peer = {0: 1, 1: 0}.get(RANK)
    if peer is not None:
        got = mpi4jax.sendrecv(
            jnp.full(2, RANK, jnp.int32), jnp.zeros(2, jnp.int32), peer, peer, sendtag=9
        )
        np.testing.assert_array_equal(got, np.full(2, peer))
    if RANK == 1:
        for other in range(2, SIZE):
            WORLD.send("after the exchange", dest=other, tag=77)
    elif RANK >= 2:
        assert WORLD.recv(source=1, tag=77) == "after the exchange"
    mpi4jax.barrier()


@pytest.mark.mpi(min_size=2)
def test_first_call_on_a_new_communicator_may_be_a_message_between_some_ranks(watchdog):
    # Creating a communicator's JaxComm is collective: it completes once every
    # rank of the communicator makes its first call on it, in any order.
    comm = WORLD.Dup()
    try:
        if RANK == 0:
            mpi4jax.send(jnp.arange(3.0), 1, tag=2, comm=comm)
        elif RANK == 1:
            got = mpi4jax.recv(jnp.zeros(3), 0, tag=2, comm=comm)
            np.testing.assert_array_equal(got, np.arange(3.0))
        mpi4jax.barrier(comm=comm)
    finally:
        jaxcomm.sync()
        comm.Free()


@pytest.mark.mpi
def test_a_communicator_reusing_a_freed_handle_gets_its_own_jaxcomm():
    # MPI hands a freed communicator's handle to the next one it creates
    # (MPICH does): the JaxComm of the freed one must not be found for it.
    first = WORLD.Dup()
    mpi4jax.barrier(comm=first)
    jaxcomm.sync()
    first.Free()
    color = RANK % 2
    second = WORLD.Split(color, RANK)
    try:
        members = [r for r in range(SIZE) if r % 2 == color]
        jc = mpi4jax._jaxcomm(second)
        assert jc.size == len(members)
        got = mpi4jax.allreduce(jnp.full(1, RANK), MPI.SUM, comm=second)
        np.testing.assert_array_equal(got, [sum(members)])
    finally:
        jaxcomm.sync()
        second.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("which", ["world", "new"])
def test_messages_never_match_mpi4py_receives_on_the_same_communicator(which, watchdog):
    comm = WORLD if which == "world" else WORLD.Dup()
    try:
        if which == "new":
            # The JaxComm of a new communicator is made at its first call,
            # which every rank must reach before it waits for another rank
            # (here, in the mpi4py receive below).
            mpi4jax.barrier(comm=comm)
        if RANK == 0:
            mpi4jax.send(jnp.arange(4.0), 1, tag=5, comm=comm)
            comm.Send(np.full(4, 7.0), dest=1, tag=5)
        elif RANK == 1:
            # A wildcard mpi4py receive on the same communicator, posted
            # before either message, gets mpi4py's message even though
            # jaxcomm's went first. It is posted nonblocking because MPI_Send
            # may wait for its receive (it does over TCP): rank 0's first
            # send completes once jaxcomm's receive below is posted.
            got = np.zeros(4)
            request = comm.Irecv(got, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)
            np.testing.assert_array_equal(mpi4jax.recv(jnp.zeros(4), comm=comm), np.arange(4.0))
            request.Wait()
            np.testing.assert_array_equal(got, np.full(4, 7.0))
        mpi4jax.barrier(comm=comm)
    finally:
        jaxcomm.sync()
        if which == "new":
            comm.Free()


# The same patterns as a program's very first calls, in jobs of their own:
# in the suite above, earlier tests have long made the JaxComms.

FIRST_CALLS = """
import sys
import jax.numpy as jnp
from mpi4py import MPI
import jaxcomm.compat.mpi4jax as mpi4jax

world = MPI.COMM_WORLD
rank = world.Get_rank()
# A collective on a Split sub-communicator, first: only its ranks call it.
sub = world.Split(rank % 2, rank)
total = mpi4jax.allreduce(jnp.full(1, rank), MPI.SUM, comm=sub)
# A message between ranks 0 and 1, first on COMM_WORLD; rank 2 waits for
# rank 1 through mpi4py meanwhile.
if rank < 2:
    got = mpi4jax.sendrecv(jnp.full(1, rank), jnp.zeros(1, jnp.int32), 1 - rank, 1 - rank)
    if rank == 1:
        world.send("exchanged", dest=2)
else:
    got = jnp.full(1, -1)
    world.recv(source=1)
sys.stdout.write(f"rank {rank}: sub total {int(total[0])}, got {int(got[0])}\\n")
"""


@spawns_own_mpi
def test_first_calls_of_a_job_need_not_involve_every_rank(tmp_path):
    done, _ = run_job(tmp_path, FIRST_CALLS, ranks=3, limit=180, JAXCOMM_TIMEOUT="20")
    assert done.returncode == 0, (done.returncode, done.stderr)
    lines = sorted(done.stdout.splitlines())
    assert lines == [
        "rank 0: sub total 2, got 1",
        "rank 1: sub total 1, got 0",
        "rank 2: sub total 2, got -1",
    ], done.stdout
