"""The kernels' own guards: freed communicators, buffer sizes and the FFI attribute table.

The public methods validate their arguments before binding a primitive; these
tests bind the primitives directly, as a bug in a rule or a cached executable
would, and check that the kernels refuse them on every rank instead of letting
MPI read or write outside XLA's buffers.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import RUNTIME_ERRORS, not_reported_again
from jax.interpreters.mlir import ir
from mpi4py import MPI
from operations import INTERNAL_TARGETS, params, select

import jaxcomm
import jaxcomm.ops
from jaxcomm import JaxComm, _runtime
from jaxcomm._runtime import _kernels_cpu
from jaxcomm.ops import _base


def _ring_sendrecv(jc, x):
    return jc.sendrecv(x, x, source=(jc.rank - 1) % jc.size, dest=(jc.rank + 1) % jc.size)


# The first row of the operation table of each op family and kind, each run
# through a captured JaxComm (point-to-point has its own test below).
FAMILIES = list(
    {(op.family, op.kind): op for op in reversed(select()) if op.kind != "p2p"}.values()
)


def _freed_then_replaced(call, check, shape=lambda size, rank: (4,)):
    """Run jit(call) on a JaxComm, free it, make another, then ``check(step, x, second)``."""
    first = JaxComm(MPI.COMM_WORLD)
    step = jax.jit(lambda x: call(first, x))
    x = jnp.arange(float(np.prod(shape(first.size, first.rank)))).reshape(
        shape(first.size, first.rank)
    )
    step(x).block_until_ready()
    first.free()
    # MPI recycles the freed handle, most likely for this very communicator:
    # the cached executable must still not run on it.
    second = JaxComm(MPI.COMM_WORLD)
    try:
        check(step, x, second)
    finally:
        second.free()


@pytest.mark.mpi
@pytest.mark.parametrize("op", params(FAMILIES))
def test_compiled_function_refuses_a_freed_communicator(op):
    def check(step, x, second):
        with pytest.raises(RUNTIME_ERRORS, match="communicator was freed"):
            step(x).block_until_ready()
        not_reported_again()
        # The refusal is contained: the new communicator works.
        y = jnp.arange(4.0)
        np.testing.assert_array_equal(second.allreduce(y), second.size * y)

    _freed_then_replaced(op.call, check, op.shape)


@pytest.mark.mpi
def test_point_to_point_refuses_a_freed_communicator():
    def check(step, x, second):
        with pytest.raises(RUNTIME_ERRORS, match="jaxcomm: sendrecv: communicator was freed"):
            step(x).block_until_ready()
        not_reported_again()
        np.testing.assert_array_equal(_ring_sendrecv(second, x), x)

    _freed_then_replaced(_ring_sendrecv, check)


@pytest.mark.mpi
def test_freed_communicator_error_names_the_op():
    first = JaxComm(MPI.COMM_WORLD)
    step = jax.jit(first.allgather)
    step(jnp.ones(2)).block_until_ready()
    first.free()
    with pytest.raises(RUNTIME_ERRORS, match=r"jaxcomm: allgather: communicator"):
        step(jnp.ones(2)).block_until_ready()
    not_reported_again()


def test_handles_are_not_reused_after_free():
    # Even where MPI hands back the same Fortran handle, the attribute a
    # compiled function holds differs.
    first = JaxComm(MPI.COMM_SELF)
    old = first._handle
    first.free()
    second = JaxComm(MPI.COMM_SELF)
    try:
        assert second._handle != old
    finally:
        second.free()


# Sizes -----------------------------------------------------------------------
#
# Each case binds a primitive with parameters that disagree with the buffers
# or the communicator, identically on every rank, so every rank must refuse.


def _size_cases(size):
    rows = np.arange(2 * size * 3, dtype=np.float32).reshape(2 * size, 3)
    return {
        # The output is shaped for one rank more than the communicator has.
        "allgather": (jaxcomm.ops.allgather_p, rows[:2], dict(size=size + 1, tiled=True)),
        "gather": (jaxcomm.ops.gather_p, rows[:2], dict(root=0, size=size + 1, tiled=True)),
        # x holds two blocks per rank, the output room for one.
        "scatter": (jaxcomm.ops.scatter_p, rows, dict(root=0, size=2 * size, tiled=True)),
        # Counts with one entry too many.
        "allgatherv": (jaxcomm.ops.allgatherv_p, rows[:1], dict(counts=(1,) * (size + 1))),
        "gatherv": (jaxcomm.ops.gatherv_p, rows[:1], dict(counts=(1,) * (size + 1), root=0)),
        # x has one row more than counts send.
        "scatterv": (
            jaxcomm.ops.scatterv_p,
            rows[: size + 1],
            dict(counts=(1,) * size, root=0, rank=0),
        ),
        "alltoallv": (
            jaxcomm.ops.alltoallv_p,
            rows[: size + 1],
            dict(sendcounts=(1,) * size, recvcounts=(1,) * size, max_rows=size),
        ),
        # A max_rows smaller than the counts it stands for.
        "alltoallv_max_rows": (
            jaxcomm.ops.alltoallv_p,
            rows[: 2 * size],
            dict(sendcounts=(2,) * size, recvcounts=(2,) * size, max_rows=1),
        ),
    }


@pytest.mark.mpi
@pytest.mark.parametrize("case", list(_size_cases(1)))
def test_kernels_refuse_buffers_that_do_not_match_their_attributes(jc, case):
    prim, x, params = _size_cases(jc.size)[case]
    op = prim.name
    step = jax.jit(lambda x: prim.bind(x, handle=jc._handle, **params))
    with pytest.raises(RUNTIME_ERRORS, match=rf"jaxcomm: {op} on rank {jc.rank}: .* expected"):
        jax.block_until_ready(step(jnp.asarray(x)))
    not_reported_again()
    # Nothing was sent: the next collective still matches on every rank.
    np.testing.assert_array_equal(jc.allreduce(jnp.ones(2)), np.full(2, jc.size))


@pytest.mark.mpi(min_size=2)
def test_alltoall_refuses_blocks_that_do_not_split(jc):
    step = jax.jit(lambda x: jaxcomm.ops.alltoall_p.bind(x, handle=jc._handle))
    with pytest.raises(RUNTIME_ERRORS, match=rf"jaxcomm: alltoall on rank {jc.rank}: .* expected"):
        jax.block_until_ready(step(jnp.arange(jc.size + 1.0)))
    not_reported_again()
    np.testing.assert_array_equal(jc.allreduce(jnp.ones(2)), np.full(2, jc.size))


# One source of truth for FFI attributes --------------------------------------


def _attribute_type(attr):
    """How the kernels name an MLIR attribute's type: int64 or int64[]."""
    i64 = ir.IntegerType.get_signless(64)
    if isinstance(attr, ir.IntegerAttr) and attr.type == i64:
        return "int64"
    if isinstance(attr, ir.DenseIntElementsAttr):
        array = ir.RankedTensorType(attr.type)
        if array.rank == 1 and array.element_type == i64:
            return "int64[]"
    return str(attr.type)


def _operations(op):
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                yield inner
                yield from _operations(inner.operation)


def _custom_call_attributes(lowered):
    """{target: {attribute: type}} of every jaxcomm custom call in a lowering."""
    found = {}
    module = lowered.compiler_ir("stablehlo")
    with module.context:
        for op in _operations(module.operation):
            if op.operation.name != "stablehlo.custom_call":
                continue
            target = ir.StringAttr(op.attributes["call_target_name"]).value
            if target.startswith("jaxcomm_"):
                config = ir.DictAttr(op.attributes["mhlo.backend_config"])
                found[target] = {a.name: _attribute_type(a.attr) for a in config}
    return found


def _every_method(jc, platform="cpu"):
    """Every row of the operation table, and the calls that reach the internal targets.

    Lowered for ``platform``, never run.
    """
    size, rank = jc.size, jc.rank
    rows = select(grid=None)
    grid = JaxComm.from_cart([size], periods=[True])

    def program(xs, x):
        out = [op.call(grid if op.grid else jc, x) for op, x in zip(rows, xs)]
        return out + [internal.call(jc, x) for internal in INTERNAL_TARGETS.values()]

    xs = [jnp.ones(op.shape(size, rank)) for op in rows]
    try:
        return jax.jit(program).trace(xs, jnp.ones((2, 3))).lower(lowering_platforms=(platform,))
    finally:
        grid.free()


# Each platform's kernels module; the CUDA one only where this build has it.
_MODULES = {"cpu": _kernels_cpu, "cuda": _runtime.load_cuda_kernels()}


@pytest.mark.mpi
@pytest.mark.parametrize("platform", sorted(_MODULES))
def test_every_ffi_target_has_a_primitive_and_back(platform):
    module = _MODULES[platform]
    if module is None:
        pytest.skip("jaxcomm was built without CUDA kernels")
    targets = set(module.attributes())
    assert set(module.registrations()) == targets
    primitives = {target for target, _ in _base.PRIMITIVES.values()}
    assert primitives == targets


@pytest.mark.mpi
@pytest.mark.parametrize("platform", sorted(_MODULES))
def test_primitive_attributes_match_the_kernels_bindings(jc, platform):
    module = _MODULES[platform]
    if module is None:
        pytest.skip("jaxcomm was built without CUDA kernels")
    kernels = {target: dict(attributes) for target, attributes in module.attributes().items()}
    # Names, as each primitive declares them; the lowering adds every call's site.
    for name, (target, attrs) in _base.PRIMITIVES.items():
        assert set(attrs) | {"site"} == set(kernels[target]), name
    # Names and types, as the lowerings for the platform emit them (lowering
    # for CUDA needs no GPU).
    emitted = _custom_call_attributes(_every_method(jc, platform))
    # No operation's target: the zeros off root of gather's rows, lowered for
    # the CPU alone (ops/_base.py). It takes no attribute.
    assert emitted.pop("jaxcomm_zero_after", {}) == {}
    assert set(emitted) == set(kernels)
    assert emitted == kernels


@pytest.mark.mpi
def test_gpu_lowering_without_cuda_kernels_names_the_fix(jc, monkeypatch):
    monkeypatch.setattr(_runtime, "cuda_kernels", None)
    monkeypatch.setattr(_runtime, "CUDA_BUILT", False)
    with pytest.raises(RuntimeError, match=r"built without its CUDA kernels.*JAXCOMM_CUDA=ON"):
        _every_method(jc, "cuda")
