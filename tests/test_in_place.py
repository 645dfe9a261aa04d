"""Ops that work in place: allreduce, reduce, scan, exscan and bcast.

Their lowering gives the output the input's buffer, and the kernels then use
the MPI call's in-place form. A loop's carry is communicated where it is, with
no copy; wherever the input is still used, XLA copies it first, so inputs are
never modified, whether a call is eager, jitted, or given a donated argument.
"""

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import unchanged

from jaxcomm.ops import _base

# op -> (call, the result on `rank` for inputs (rank + 1) * x, as a multiple of x).
IN_PLACE = {
    "allreduce": (lambda jc, x: jc.allreduce(x), lambda rank, size: size * (size + 1) / 2),
    "reduce": (
        lambda jc, x: jc.reduce(x, root=0),
        lambda rank, size: size * (size + 1) / 2 if rank == 0 else 0,
    ),
    "scan": (lambda jc, x: jc.scan(x), lambda rank, size: (rank + 1) * (rank + 2) / 2),
    "exscan": (lambda jc, x: jc.exscan(x), lambda rank, size: rank * (rank + 1) / 2),
    "bcast": (lambda jc, x: jc.bcast(x, root=0), lambda rank, size: 1),
}

BASE = np.arange(1.0, 7.0, dtype=np.float32).reshape(2, 3)


def _case(jc, name):
    """The op as a function of x, this rank's input and the result it must give."""
    call, factor = IN_PLACE[name]
    x = jnp.asarray(BASE * (jc.rank + 1))
    return partial(call, jc), x, BASE * factor(jc.rank, jc.size)


def _computations(hlo):
    """The computations of an HLO module's text, as lists of lines."""
    return [block.splitlines() for block in hlo.split("\n\n") if block.rstrip().endswith("}")]


@pytest.mark.mpi
@pytest.mark.parametrize("name", IN_PLACE)
def test_loop_carry_is_communicated_in_place(jc, name):
    op, x, _ = _case(jc, name)

    def loop(x):
        return jax.lax.fori_loop(0, 3, lambda i, c: op(c) * 0.5, x)

    hlo = jax.jit(loop).lower(x).compile().as_text()
    target = f'custom_call_target="jaxcomm_{name}"'
    (body,) = [c for c in _computations(hlo) if any(target in line for line in c)]
    (call,) = [line for line in body if target in line]
    assert "output_to_operand_aliasing={{1}: (1, {})}" in call
    assert not [line for line in body if re.search(r"= \S+ copy\(", line)], "\n".join(body)


@pytest.mark.mpi
@pytest.mark.parametrize("name", IN_PLACE)
def test_inputs_are_never_modified(jc, name):
    op, x, want = _case(jc, name)
    original = np.asarray(x).copy()

    np.testing.assert_allclose(op(x), want)
    unchanged(x, original)
    np.testing.assert_allclose(jax.jit(op)(x), want)
    unchanged(x, original)
    # The input is read again after the call, inside the same computation.
    y, again = jax.jit(lambda x: (op(x), x + 1))(x)
    np.testing.assert_allclose(y, want)
    np.testing.assert_array_equal(again, original + 1)
    unchanged(x, original)
    loop = jax.jit(lambda x: jax.lax.fori_loop(0, 2, lambda i, c: op(c), x))
    loop(x).block_until_ready()
    unchanged(x, original)


@pytest.mark.mpi
@pytest.mark.parametrize("name", IN_PLACE)
def test_donated_inputs(jc, name):
    op, x, want = _case(jc, name)
    original = np.asarray(x).copy()

    donated = jnp.array(x, copy=True)
    np.testing.assert_allclose(jax.jit(op, donate_argnums=0)(donated), want)
    # A donated input that the computation still reads after the call.
    donated = jnp.array(x, copy=True)
    y, again = jax.jit(lambda x: (op(x), x * 2), donate_argnums=0)(donated)
    np.testing.assert_allclose(y, want)
    np.testing.assert_array_equal(again, original * 2)
    unchanged(x, original)


@pytest.mark.mpi
@pytest.mark.parametrize("name", IN_PLACE)
def test_kernels_also_take_an_output_buffer_of_its_own(jc, name, monkeypatch):
    # The FFI targets do not rely on the alias: lowered without it, the output
    # has a buffer of its own and the kernels use the MPI call's plain form.
    op, x, want = _case(jc, name)
    monkeypatch.setattr(_base, "_ARRAY_IN_PLACE", None)
    step = jax.jit(op)
    assert "output_to_operand_aliasing" not in step.lower(x).compile().as_text()
    np.testing.assert_allclose(step(x), want)
