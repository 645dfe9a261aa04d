"""Every op on GPU arrays, on both data paths: values, devices, transformations, memory.

The ops are the rows of ``operations.py``, with their expected values; the
data are small integers, exact in every dtype, so results compare exactly.
Jitted functions are built inside each test, after ``data_path`` chose the path.
"""

import functools
import gc
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ALL_DTYPES, rank_data, unchanged
from mpi4py import MPI
from operations import params, rotations, select

import jaxcomm
from jaxcomm import _runtime

from .conftest import (
    BIND_ERROR,
    BOUND_GPU,
    CPU,
    GPU,
    GPUS,
    assert_on,
    on_gpu,
    requires_gpu,
)

pytestmark = requires_gpu

F32 = np.dtype(np.float32)


def _total(arrays, shape, dtype):
    """Elementwise sum of ``arrays`` in their dtype (zeros for none)."""
    return functools.reduce(np.add, arrays, np.zeros(shape, dtype))


def _check(result, want):
    assert_on(result)
    assert result.dtype == want.dtype and result.shape == want.shape
    np.testing.assert_array_equal(np.asarray(result), want)


def _row_data(op, size):
    return lambda r: rank_data(r, op.shape(size, r), F32)


@pytest.mark.mpi
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("op", params(select()))
def test_op(jc, data_path, op, jit):
    # On every rotation of the ranks, each GPU takes every part the row's
    # call names: the root, an end of the chain, each count.
    for comm in rotations(jc):
        data = _row_data(op, comm.size)
        fn = functools.partial(op.call, comm)
        call = jax.jit(fn) if jit else fn
        x = data(comm.rank)
        xg = on_gpu(x)
        result = call(xg)
        jaxcomm.sync()
        _check(result, op.expected(data, comm.rank, comm.size))
        unchanged(xg, x)
        assert_on(xg)
        if op.kind == "nonblocking":
            assert _runtime.cuda_kernels.staging_held() == 0


def _reduction_ops(dtype):
    if dtype == np.dtype(bool):
        return {"LOR": np.logical_or, "LAND": np.logical_and}
    if np.issubdtype(dtype, np.complexfloating):
        return {"SUM": np.add}
    return {"SUM": np.add, "MAX": np.maximum}


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_dtypes(jc, data_path, dtype):
    # float16 and bfloat16 reductions go through the host on either path.
    shape = (5, 3)
    size, rank = jc.size, jc.rank
    every = [rank_data(q, shape, dtype) for q in range(size)]
    x = on_gpu(every[rank])
    right, left = (rank + 1) % size, (rank - 1) % size
    for op_name, combine in _reduction_ops(dtype).items():
        op = getattr(MPI, op_name)
        want = functools.reduce(combine, every).astype(dtype)
        reduce = functools.partial(jc.allreduce, op=op)
        for call in (reduce, jax.jit(reduce)):
            _check(call(x), want)
    for root in range(size):
        bcast = functools.partial(jc.bcast, root=root)
        for call in (bcast, jax.jit(bcast)):
            _check(call(x), every[root])
    ring = lambda v: jc.sendrecv(v, v, source=left, dest=right)
    for call in (ring, jax.jit(ring)):
        _check(call(x), every[left])
    unchanged(x, every[rank])


_LARGE_BYTES = 256 << 20


@pytest.mark.mpi
@pytest.mark.large
def test_large_allreduce_and_sendrecv(jc, data_path):
    n = _LARGE_BYTES // 4
    size, rank = jc.size, jc.rank
    left = (rank - 1) % size
    # Built on the GPU: period 1000 keeps every sum exact in float32.
    pattern = jax.jit(lambda r: (jnp.arange(n, dtype=jnp.int32) % 1000).astype(jnp.float32) + r)
    x = pattern(on_gpu(np.float32(rank)))
    total = jax.jit(jc.allreduce)(x)
    shifted = jax.jit(lambda v: jc.sendrecv(v, v, source=left, dest=(rank + 1) % size))(x)
    want_total = size * pattern(on_gpu(np.float32(0))) + sum(range(size))
    assert_on((total, shifted))
    assert bool(jnp.array_equal(total, want_total))
    assert bool(jnp.array_equal(shifted, pattern(on_gpu(np.float32(left)))))
    assert bool(jnp.array_equal(x, pattern(on_gpu(np.float32(rank)))))


@pytest.fixture
def pipelined():
    previous = jaxcomm.pipeline_bytes()
    jaxcomm.set_pipeline_bytes(256 << 10)
    try:
        yield 256 << 10
    finally:
        jaxcomm.set_pipeline_bytes(previous)


# 2 MiB + 12 B of float32: eight pieces of 256 KiB and a short one, with real
# streams: a piece read before its copy arrived, or a copy back not joined
# before the next kernel, shows as a wrong value.
PIPELINED_N = (2 << 20) // 4 + 3


@jax.jit
def _pattern(r):
    return (jnp.arange(PIPELINED_N, dtype=jnp.int32) % 1000).astype(jnp.float32) + r


def _pipelined_pattern(r):
    """Rank r's data for the pipelined tests, made on the GPU (compiled once)."""
    return _pattern(on_gpu(np.float32(r)))


@pytest.mark.mpi
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_pipelined_collectives(jc, data_path, pipelined, jit):
    n, size, rank = PIPELINED_N, jc.size, jc.rank
    every = [_pipelined_pattern(q) for q in range(size)]
    x = every[rank]
    wrap = jax.jit if jit else (lambda f: f)
    total = functools.reduce(jnp.add, every)
    assert bool(jnp.array_equal(wrap(jc.allreduce)(x), total))
    assert bool(jnp.array_equal(wrap(jc.scan)(x), functools.reduce(jnp.add, every[: rank + 1])))
    exscan = wrap(jc.exscan)(x)
    assert bool(jnp.array_equal(exscan, functools.reduce(jnp.add, every[:rank], jnp.zeros(n))))
    for root in range(size):
        got = wrap(lambda v, root=root: jc.bcast(v, root=root))(x)
        assert bool(jnp.array_equal(got, every[root]))
        reduced = wrap(lambda v, root=root: jc.reduce(v, root=root))(x)
        assert bool(jnp.array_equal(reduced, total if rank == root else jnp.zeros(n)))
    gathered = wrap(lambda v: jc.allgather(v, tiled=True))(x)
    assert_on(gathered)
    assert bool(jnp.array_equal(gathered, jnp.concatenate(every)))
    assert bool(jnp.array_equal(x, _pipelined_pattern(rank)))


@pytest.mark.mpi
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_pipelined_nonblocking_collectives(jc, data_path, pipelined, jit):
    # The starts stage their input piece by piece and start one MPI call per
    # piece once it reached the host; the waits copy each piece back as it
    # completes. The input is computed right before the start and the output
    # read by a kernel right after the wait.
    n, size, rank = PIPELINED_N, jc.size, jc.rank
    every = [_pipelined_pattern(q) for q in range(size)]
    root = size - 1

    def run(v):
        w = v * 2
        requests = [jc.iallreduce(w), jc.ireduce(w, root=root), jc.iscan(w), jc.ibcast(w, root)]
        return [r + 1 for r in jc.waitall(requests)]

    wrap = jax.jit if jit else (lambda f: f)
    total, reduced, scanned, sent = wrap(run)(every[rank])
    assert_on((total, reduced, scanned, sent))
    want = functools.reduce(jnp.add, every) * 2 + 1
    assert bool(jnp.array_equal(total, want))
    assert bool(jnp.array_equal(reduced, want if rank == root else jnp.ones(n)))
    assert bool(jnp.array_equal(scanned, functools.reduce(jnp.add, every[: rank + 1]) * 2 + 1))
    assert bool(jnp.array_equal(sent, every[root] * 2 + 1))


@pytest.mark.mpi
def test_pipelined_results_feed_the_next_kernel(jc, data_path, pipelined):
    # Each step's result is read by a kernel at once and is the next step's
    # operand, reduced in place: the copies back must have landed first.
    n = (2 << 20) // 4 + 3
    size = jc.size

    @jax.jit
    def steps(v):
        def body(_, w):
            return jc.allreduce(w) * 0.5 + jc.bcast(w, root=size - 1) * 0.25

        return jax.lax.fori_loop(0, 4, body, v)

    x = on_gpu((np.arange(n) % 7).astype(np.float32) + jc.rank)
    every = [(np.arange(n) % 7).astype(np.float32) + q for q in range(size)]
    for _ in range(4):
        every = [sum(every) * 0.5 + every[size - 1] * 0.25 for _ in every]
    np.testing.assert_allclose(np.asarray(steps(x)), every[jc.rank], rtol=1e-6)


@pytest.mark.mpi
def test_grad_of_jitted_allreduce(jc, data_path):
    every = [rank_data(q, (4, 3), F32) for q in range(jc.size)]
    x = on_gpu(every[jc.rank])
    loss = jax.jit(lambda v: jnp.sum(jnp.sin(jc.allreduce(v))))
    # Replicated-value convention: allreduce(SUM) transposes to the identity.
    want = np.cos(_total(every, (4, 3), F32))
    for grad in (jax.grad(loss), jax.jit(jax.grad(loss))):
        g = grad(x)
        assert_on(g)
        np.testing.assert_allclose(np.asarray(g), want, rtol=1e-6)


@pytest.mark.mpi
def test_vmap(jc, data_path):
    size, rank = jc.size, jc.rank
    every = [rank_data(q, (6, 4), F32) for q in range(size)]
    x = on_gpu(every[rank])
    left = (rank - 1) % size
    total = jax.vmap(jc.allreduce)(x)
    ring = jax.jit(jax.vmap(lambda v: jc.sendrecv(v, v, source=left, dest=(rank + 1) % size)))
    shifted = ring(x)
    assert_on((total, shifted))
    np.testing.assert_array_equal(np.asarray(total), _total(every, (6, 4), F32))
    np.testing.assert_array_equal(np.asarray(shifted), every[left])


@pytest.mark.mpi
def test_fori_loop_ring_shifts(jc, data_path):
    size, rank = jc.size, jc.rank
    right, left = (rank + 1) % size, (rank - 1) % size

    @jax.jit
    def pass_around(x):
        # After `size` shifts every value is back home, having visited all.
        def body(_, state):
            value, seen = state
            value = jc.sendrecv(value, value, source=left, dest=right)
            return value, seen + value

        return jax.lax.fori_loop(0, size, body, (x, jnp.zeros_like(x)))

    value, seen = pass_around(on_gpu(np.full(1000, float(rank), F32)))
    assert_on((value, seen))
    np.testing.assert_array_equal(np.asarray(value), np.full(1000, float(rank), F32))
    np.testing.assert_array_equal(np.asarray(seen), np.full(1000, float(sum(range(size))), F32))


@pytest.mark.mpi
def test_proc_null_gives_zeros(jc, data_path):
    x = on_gpu(rank_data(jc.rank, (4, 3), F32) + 1)
    calls = [
        lambda v: jc.recv(v, source=MPI.PROC_NULL),
        lambda v: jc.sendrecv(v, v, source=MPI.PROC_NULL, dest=MPI.PROC_NULL),
    ]
    for call in (*calls, *map(jax.jit, calls)):
        _check(call(x), np.zeros((4, 3), F32))


@pytest.mark.mpi(min_size=2)
def test_gpu_and_cpu_peers(jc, data_path):
    # Rank 1 keeps its arrays in host memory; every other rank uses its GPU.
    size, rank = jc.size, jc.rank
    device = CPU if rank == 1 else GPU
    right, left = (rank + 1) % size, (rank - 1) % size
    every = [rank_data(q, (4, 3), F32) for q in range(size)]
    x = jax.device_put(every[rank], device)
    ring = lambda v: jc.sendrecv(v, v, source=left, dest=right)
    for call in (jc.allreduce, jax.jit(jc.allreduce)):
        total = call(x)
        assert_on(total, device)
        np.testing.assert_array_equal(np.asarray(total), _total(every, (4, 3), F32))
    for call in (ring, jax.jit(ring)):
        shifted = call(x)
        assert_on(shifted, device)
        np.testing.assert_array_equal(np.asarray(shifted), every[left])
    unchanged(x, every[rank])


@pytest.mark.mpi
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_nonblocking_max_against_its_blocking_twin(jc, data_path, jit):
    # jaxcomm's own reduction (NaN-propagating MAX): staged on either path.
    nonblocking = lambda v: jc.wait(jc.iallreduce(v, op=MPI.MAX))
    x = rank_data(jc.rank, (jc.size, 4), F32)
    xg = on_gpu(x)
    want = np.asarray(jax.jit(lambda v: jc.allreduce(v, op=MPI.MAX))(xg))
    _check((jax.jit(nonblocking) if jit else nonblocking)(xg), want)
    unchanged(xg, x)
    jaxcomm.sync()
    assert _runtime.cuda_kernels.staging_held() == 0


@pytest.mark.mpi
def test_nonblocking_overlaps_gpu_work(jc, data_path):
    # The message travels while XLA's kernels run on the stream: the sent
    # carry is dead after the start but for the wait, and the result feeds
    # the next iteration, so a staging block released early, a copy back
    # ordered before the wait or a read of the receive buffer before it
    # would show as a wrong sum.
    size, rank = jc.size, jc.rank
    right, left = (rank + 1) % size, (rank - 1) % size
    n = 1 << 22  # 16 MiB

    @jax.jit
    def pass_around(x):
        def body(_, state):
            value, seen, work = state
            receiving = jc.irecv(value, source=left, tag=9)
            sending = jc.isend(value, right, tag=9)
            work = jc.during([receiving, sending], lambda w: jnp.sin(w) * 0.5 + w, work)
            value, _ = jc.waitall([receiving, sending])
            return value, seen + value, work

        start = (x, jnp.zeros_like(x), jnp.zeros(1 << 20, jnp.float32))
        return jax.lax.fori_loop(0, 3 * size, body, start)

    value, seen, _ = pass_around(on_gpu(np.full(n, float(rank), F32)))
    assert_on((value, seen))
    assert bool(jnp.all(value == float(rank)))
    assert bool(jnp.all(seen == float(3 * sum(range(size)))))
    jaxcomm.sync()
    assert _runtime.cuda_kernels.staging_held() == 0


@pytest.mark.mpi
def test_nonblocking_staging_is_reused(jc, data_path):
    x = on_gpu(np.full(1 << 16, float(jc.rank), F32))
    loop = jax.jit(
        lambda v, n: jax.lax.fori_loop(0, n, lambda _, w: jc.wait(jc.iallreduce(w)) / jc.size, v)
    )
    jax.block_until_ready(loop(x, 10))
    held = jaxcomm.cuda_info()["staging_bytes"]
    result = loop(x, 1000)
    mean = sum(range(jc.size)) / jc.size
    np.testing.assert_array_equal(np.asarray(result), np.full(1 << 16, mean, F32))
    jaxcomm.sync()
    assert jaxcomm.cuda_info()["staging_bytes"] == held
    assert _runtime.cuda_kernels.staging_held() == 0


def _rss_bytes():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _memory():
    """Pinned staging bytes, GPU bytes in use and process RSS."""
    return jaxcomm.cuda_info()["staging_bytes"], GPU.memory_stats()["bytes_in_use"], _rss_bytes()


# Every array made between two readings is dropped before the second, so
# JAX's allocator should be back where it was; 1 MiB leaves room for its
# bookkeeping while one leaked 64 KiB result per eager call (12.5 MiB over
# 200 calls) would not fit.
GPU_BYTES_TOLERANCE = 1 << 20
RSS_GROWTH_LIMIT = 64 << 20


@pytest.mark.mpi
def test_no_memory_growth_over_10000_calls(jc, data_path):
    size, rank = jc.size, jc.rank
    right, left = (rank + 1) % size, (rank - 1) % size
    x = on_gpu(np.full(16384, float(rank), F32))  # 64 KiB

    def step(v):
        v = jc.allreduce(v, op=MPI.MAX)  # every rank holds size - 1 from here on
        return jc.sendrecv(v, v, source=left, dest=right)

    loop = jax.jit(lambda v, n: jax.lax.fori_loop(0, n, lambda _, w: step(w), v))

    def run(iterations, eager_calls):
        y = loop(x, iterations)
        for _ in range(eager_calls):
            y = step(y)
        result = np.asarray(y)
        del y
        jaxcomm.sync()
        gc.collect()
        return result

    run(10, 20)  # compiles, and lets staging buffers reach their size
    staging, gpu_bytes, rss = _memory()
    result = run(10_000, 200)
    after = _memory()

    np.testing.assert_array_equal(result, np.full(16384, float(size - 1), F32))
    assert after[0] <= staging, f"staging buffers grew from {staging} to {after[0]} bytes"
    assert abs(after[1] - gpu_bytes) <= GPU_BYTES_TOLERANCE, (
        f"GPU bytes in use went from {gpu_bytes} to {after[1]}"
    )
    assert after[2] - rss < RSS_GROWTH_LIMIT, f"RSS grew by {(after[2] - rss) >> 20} MiB"


_INFO_KEYS = {"built", "gpus", "mpi_cuda_support", "cuda_aware", "path", "reason", "staging_bytes"}


def _check_info(info):
    assert set(info) == _INFO_KEYS, info
    assert info["built"] is True, info
    assert info["gpus"] == len(jax.devices("gpu")), info
    assert info["mpi_cuda_support"] in (True, False, None), info
    assert isinstance(info["cuda_aware"], bool), info
    assert info["path"] == ("cuda-aware" if info["cuda_aware"] else "host staging"), info
    assert isinstance(info["reason"], str) and info["reason"], info
    assert isinstance(info["staging_bytes"], int) and info["staging_bytes"] >= 0, info


@pytest.mark.mpi
def test_cuda_info_is_consistent(jc, cuda_aware_mpi):
    info = jaxcomm.cuda_info()
    everyone = jc.comm.allgather(info["mpi_cuda_support"])
    try:
        _check_info(info)
        assert len(set(everyone)) == 1, f"ranks disagree on mpi_cuda_support: {everyone}"
        if info["mpi_cuda_support"] is not True and "JAXCOMM_CUDA_AWARE" not in os.environ:
            assert info["cuda_aware"] is False, f"automatic path on a plain MPI: {info}"
        jaxcomm.set_cuda_aware(False)
        forced = jaxcomm.cuda_info()
        _check_info(forced)
        assert (forced["cuda_aware"], forced["path"]) == (False, "host staging"), forced
        if cuda_aware_mpi:
            jaxcomm.set_cuda_aware(True)
            forced = jaxcomm.cuda_info()
            _check_info(forced)
            assert (forced["cuda_aware"], forced["path"]) == (True, "cuda-aware"), forced
        jaxcomm.set_cuda_aware(None)
        assert jaxcomm.cuda_info()["cuda_aware"] is info["cuda_aware"]
    finally:
        jaxcomm.set_cuda_aware(None)


@pytest.mark.mpi
def test_bind_local_gpu():
    if BIND_ERROR is not None:
        raise BIND_ERROR
    assert isinstance(BOUND_GPU, int) and BOUND_GPU >= 0, BOUND_GPU
    assert os.environ.get("CUDA_VISIBLE_DEVICES"), "bind_local_gpu left CUDA_VISIBLE_DEVICES unset"
    assert GPUS == 1, f"each rank should see only its own GPU, JAX sees {GPUS}"
    with pytest.raises(RuntimeError):
        jaxcomm.bind_local_gpu()  # JAX's backends are up by now
