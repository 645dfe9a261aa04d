"""Ops that work in place: the rows of ``operations.py`` marked ``in_place``.

Their lowering gives the output the input's buffer, and the kernels then use
the MPI call's in-place form. A loop's carry is communicated where it is, with
no copy; wherever the input is still used, XLA copies it first, so inputs are
never modified, whether a call is eager, jitted, or given a donated argument.
An argument of the jitted function that its caller keeps (not donated) is the
exception: XLA would copy it, so its output gets a buffer of its own and the
kernels use the MPI call's plain form.
"""

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import unchanged
from operations import params, select

from jaxcomm import _runtime
from jaxcomm.ops import _base

IN_PLACE = params(select(in_place=True))
ALIASED = "output_to_operand_aliasing={{1}: (1, {})}"


def _data(op, size):
    """Rank ``r``'s input: nonzero and different on every rank, so a result never equals it."""

    def data(r):
        shape = op.shape(size, r)
        return np.arange(1.0, 1.0 + np.prod(shape), dtype=np.float32).reshape(shape) * (r + 1)

    return data


def _case(jc, op):
    """The op as a function of x, this rank's input and the result it must give."""
    data = _data(op, jc.size)
    return partial(op.call, jc), jnp.asarray(data(jc.rank)), op.expected(data, jc.rank, jc.size)


def _computations(hlo):
    """The computations of an HLO module's text, as lists of lines."""
    return [block.splitlines() for block in hlo.split("\n\n") if block.rstrip().endswith("}")]


@pytest.mark.mpi
@pytest.mark.parametrize("op", IN_PLACE)
def test_loop_carry_is_communicated_in_place(jc, op):
    call, x, _ = _case(jc, op)

    def loop(x):
        return jax.lax.fori_loop(0, 3, lambda i, c: call(c) * 0.5, x)

    hlo = jax.jit(loop).lower(x).compile().as_text()
    target = f'custom_call_target="jaxcomm_{op.targets[0]}"'
    (body,) = [c for c in _computations(hlo) if any(target in line for line in c)]
    (custom_call,) = [line for line in body if target in line]
    assert ALIASED in custom_call
    assert not [line for line in body if re.search(r"= \S+ copy\(", line)], "\n".join(body)


@pytest.mark.mpi
@pytest.mark.parametrize("op", params(select(in_place=False)))
def test_other_operations_write_a_buffer_of_their_own(jc, op):
    # The table's in_place column holds both ways: no other row's result
    # takes its input's buffer.
    x = jax.ShapeDtypeStruct(op.shape(jc.size, jc.rank), np.float32)
    assert ALIASED not in jax.jit(partial(op.call, jc)).lower(x).compile().as_text()


# The tests below make every call on every rank before they assert anything:
# an assertion failing on one rank only would otherwise leave the others
# waiting in the next call.


@pytest.mark.mpi
@pytest.mark.parametrize("op", IN_PLACE)
def test_inputs_are_never_modified(jc, op):
    call, x, want = _case(jc, op)
    original = np.asarray(x).copy()
    seen = []  # x after each call

    eager = np.asarray(call(x))
    seen.append(np.asarray(x).copy())
    jitted = np.asarray(jax.jit(call)(x))
    seen.append(np.asarray(x).copy())
    # The input is read again after the call, inside the same computation.
    y, again = jax.jit(lambda x: (call(x), x + 1))(x)
    seen.append(np.asarray(x).copy())
    loop = jax.jit(lambda x: jax.lax.fori_loop(0, 2, lambda i, c: call(c), x))
    loop(x).block_until_ready()
    seen.append(np.asarray(x).copy())

    np.testing.assert_allclose(eager, want)
    np.testing.assert_allclose(jitted, want)
    np.testing.assert_allclose(y, want)
    np.testing.assert_array_equal(again, original + 1)
    for after in seen:
        unchanged(after, original)


@pytest.mark.mpi
@pytest.mark.parametrize("op", IN_PLACE)
def test_donated_inputs(jc, op):
    call, x, want = _case(jc, op)
    original = np.asarray(x).copy()

    donated = jnp.array(x, copy=True)
    alone = np.asarray(jax.jit(call, donate_argnums=0)(donated))
    # A donated input that the computation still reads after the call.
    donated = jnp.array(x, copy=True)
    y, again = jax.jit(lambda x: (call(x), x * 2), donate_argnums=0)(donated)

    np.testing.assert_allclose(alone, want)
    np.testing.assert_allclose(y, want)
    np.testing.assert_array_equal(again, original * 2)
    unchanged(x, original)


@pytest.mark.mpi
@pytest.mark.parametrize("op", IN_PLACE)
def test_kernels_also_take_an_output_buffer_of_its_own(jc, op, monkeypatch):
    # The FFI targets do not rely on the alias: lowered without it, the output
    # has a buffer of its own and the kernels use the MPI call's plain form.
    call, x, want = _case(jc, op)
    monkeypatch.setattr(_base, "_ARRAY_IN_PLACE", None)
    # Donated, so that only the patch keeps the alias out.
    step = jax.jit(call, donate_argnums=0)
    hlo = step.lower(x).compile().as_text()
    got = step(jnp.array(x, copy=True))
    assert "output_to_operand_aliasing" not in hlo
    np.testing.assert_allclose(got, want)


@pytest.mark.mpi
@pytest.mark.parametrize("op", IN_PLACE)
def test_an_argument_the_caller_keeps_is_not_copied(jc, op):
    # XLA would copy a jitted function's argument that is not donated into
    # an output aliased to it: a pass over the message before MPI sees it.
    # The lowering leaves that output unaliased, and the kernel uses the MPI
    # call's plain form; a donated argument keeps the alias. This holds for
    # a program lowered for the CPU alone, so x is placed there even where
    # JAX's default device is a GPU (the next test covers GPU programs).
    call, x, want = _case(jc, op)
    x = jax.device_put(x, jax.devices("cpu")[0])
    kept = jax.jit(call).lower(x).compile().as_text()
    donated = jax.jit(call, donate_argnums=0).lower(x).compile().as_text()
    got = jax.jit(call)(x)
    assert ALIASED not in kept
    assert not re.search(r"= \S+ copy\(", kept), kept
    assert ALIASED in donated
    np.testing.assert_allclose(got, want)


@pytest.mark.mpi
@pytest.mark.parametrize("op", IN_PLACE)
def test_a_kept_argument_stays_aliased_on_a_gpu(jc, op, monkeypatch):
    # On a GPU, XLA's copy of the argument runs on the device and keeps the
    # host staging in place, which measured faster than the plain form there
    # (docs/gpu.md). Lowered, not compiled: this machine need have no GPU,
    # and a stand-in for the CUDA module lets the CUDA lowering run.
    if _runtime.cuda_kernels is None:
        monkeypatch.setattr(_runtime, "cuda_kernels", object())
    call, x, _ = _case(jc, op)
    traced = jax.jit(call).trace(x)
    gpu = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "output_operand_aliases" in gpu, gpu
    cpu = traced.lower(lowering_platforms=("cpu",)).as_text()
    assert "output_operand_aliases" not in cpu, cpu
