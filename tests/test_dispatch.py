"""Fast dispatch: jitted jaxcomm calls without runtime tokens, and what it relies on.

jaxcomm lowers a computation with its MPI token created inside it, so that
JAX dispatches it like any jitted function, and leaves the order between
computations to the runtime (see ``_compat.py``). These tests check that
assumption on the installed jax (``test_runtime_*``, the dispatch-ahead
stress and its negative control), and what the scheme must keep: ``sync()``
waits for work in flight, and a failure with nowhere to go is still raised.
"""

import os
import re
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    RUNTIME_ERRORS,
    backend_compiles,
    environment_without_launcher,
    mpiexec,
    spawns_own_mpi,
)
from dispatch_ahead import dispatch_ahead, out_of_order
from mpi4py import MPI

import jaxcomm
from jaxcomm import JaxComm, _compat

_HERE = os.path.dirname(os.path.abspath(__file__))


def test_runtime_runs_computations_in_dispatch_order():
    # Computations that block inside a custom call (as an MPI call does), some
    # after a large product, must never be overtaken by later ones.
    log = []

    def record(number, delay):
        time.sleep(float(delay))
        log.append(int(number))
        return number

    def blocking(number, delay):
        return jax.pure_callback(record, jax.ShapeDtypeStruct((), jnp.int32), number, delay)

    product = jnp.ones((256, 256), jnp.float32)
    kinds = [
        jax.jit(blocking),
        jax.jit(lambda n, d, m: blocking(n + (jnp.sin(m @ m).sum() > 1e30).astype(n.dtype), d)),
        jax.jit(lambda n, d: jax.lax.fori_loop(0, 2, lambda i, c: blocking(c, d), n)),
    ]
    rng = np.random.default_rng(0)
    results = []
    for number in range(200):
        kind = int(rng.integers(len(kinds)))
        delay = np.float32(rng.choice([0.0, 0.0, 0.002]))
        args = (jnp.int32(number), delay) + ((product,) if kind == 1 else ())
        results.append(kinds[kind](*args))
    jax.block_until_ready(results)
    # The loop kind records its number twice, in a row.
    assert [n for i, n in enumerate(log) if i == 0 or log[i - 1] != n] == list(range(200))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dispatch_ahead_keeps_every_rank_in_program_order(jc, seed):
    numbers = dispatch_ahead(jc, seed)
    assert out_of_order(numbers) == 0, numbers
    assert numbers == list(range(len(numbers)))


@pytest.mark.mpi
def test_eager_calls_recognise_arrays_by_type_and_still_refuse_tracers(jc):
    # An eager call notes the type of a concrete array it takes; a tracer of
    # a transformation that comes afterwards must still take the traced path.
    x = jnp.arange(1.0, 4.0)
    np.testing.assert_array_equal(jc.allreduce(x), jc.size * x)
    assert type(x) in jaxcomm._eager._ARRAY_TYPES
    assert not any(issubclass(t, jax.core.Tracer) for t in jaxcomm._eager._ARRAY_TYPES)
    programs = len(jc._eager)
    grad = jax.grad(lambda v: jc.allreduce(v).sum())(x)
    np.testing.assert_array_equal(grad, np.ones(3))  # allreduce(SUM) transposes to the identity
    np.testing.assert_array_equal(jax.jit(jc.allreduce)(x), jc.size * x)
    np.testing.assert_array_equal(jax.vmap(jc.allreduce)(x[:, None]), jc.size * x[:, None])
    # The transformations' calls kept no eager program; the eager call's key is the one it had.
    np.testing.assert_array_equal(jc.allreduce(x), jc.size * x)
    assert len(jc._eager) == programs
    assert jaxcomm._eager._call_key("allreduce", (), {}) == (
        "allreduce",
        jaxcomm._eager._static_key(()),
        jaxcomm._eager._static_key([]),
    )


@spawns_own_mpi
def test_dispatch_ahead_without_order_between_devices_is_caught():
    # The negative control: the same stress, its sends spread over two
    # devices of each process with nothing ordering them, must be caught.
    done = subprocess.run(
        [*mpiexec(2), sys.executable, os.path.join(_HERE, "dispatch_ahead.py")],
        capture_output=True,
        text=True,
        timeout=300,
        env=environment_without_launcher(),
        cwd=os.path.dirname(sys.executable),
    )
    assert done.returncode == 0, done.stderr
    counts = [int(n) for n in re.findall(r"out of order (\d+) of", done.stdout)]
    assert len(counts) == 2, done.stdout
    assert max(counts) > 0, done.stdout


@pytest.mark.mpi
def test_jitted_and_eager_calls_need_no_runtime_token(jc):
    x = jnp.arange(3.0)
    compiled = jax.jit(jc.allreduce).lower(x).compile()
    assert _compat.runtime_token_effects(compiled) == (not _compat.fast_dispatch_enabled), (
        _compat.fast_device,
        x.devices(),
    )
    np.testing.assert_array_equal(compiled(x), jc.size * x)


@pytest.mark.mpi
def test_eager_programs_kept_are_bounded(monkeypatch):
    # Eager calls keep one compiled program per set of static arguments (here
    # the op); a program sending with ever new tags must not keep them all.
    monkeypatch.setattr(jaxcomm._eager, "EAGER_CACHE_SIZE", 2)
    x = np.arange(1.0, 4.0)
    with JaxComm(MPI.COMM_WORLD) as jc:
        expected = {"SUM": x * jc.size, "PROD": x**jc.size, "MAX": x}
        ops = {"SUM": MPI.SUM, "PROD": MPI.PROD, "MAX": MPI.MAX}
        # SUM is used again before MAX comes in, so PROD is the one dropped.
        for name in ("SUM", "PROD", "SUM", "MAX"):
            np.testing.assert_array_equal(jc.allreduce(x, op=ops[name]), expected[name])
        assert len(jc._eager) == 2
        for name, programs_compiled in (("SUM", 0), ("PROD", 1)):
            with backend_compiles() as compiles:
                np.testing.assert_array_equal(jc.allreduce(x, op=ops[name]), expected[name])
            assert len(compiles) == programs_compiled, name


@spawns_own_mpi
def test_fast_dispatch_can_be_turned_off():
    script = (
        "import jax, jax.numpy as jnp\n"
        "from jaxcomm import JaxComm, _compat\n"
        "jc = JaxComm()\n"
        "compiled = jax.jit(jc.allreduce).lower(jnp.ones(2)).compile()\n"
        "print(_compat.fast_dispatch_enabled, _compat.runtime_token_effects(compiled),"
        " compiled(jnp.ones(2)).tolist())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env=environment_without_launcher(JAXCOMM_FAST_DISPATCH="0"),
        cwd=os.path.dirname(sys.executable),
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True", "[1.0,", "1.0]"], done.stdout


@pytest.mark.mpi
def test_sync_waits_for_a_computation_in_flight(jc):
    finished = threading.Event()

    def finish(value):
        time.sleep(0.3)
        finished.set()
        return value

    step = jax.jit(
        lambda m: jc.allreduce(
            jax.pure_callback(finish, jax.ShapeDtypeStruct((), m.dtype), jnp.sin(m @ m).sum())
        )
    )
    step(jnp.ones((64, 64), jnp.float32))
    jaxcomm.sync()
    assert finished.is_set()


# Two ranks at least: MPI_Send to oneself may wait for the receive forever.
@pytest.mark.mpi(min_size=2)
@pytest.mark.skipif(
    not _compat.fast_dispatch_enabled,
    reason="with runtime tokens, JAX keeps the failure in the token, failing every later call",
)
def test_failure_in_a_computation_without_outputs_is_raised_once():
    first = JaxComm(MPI.COMM_WORLD)
    dest, source = (first.rank + 1) % first.size, (first.rank - 1) % first.size
    product = jnp.ones((256, 256), jnp.float32)
    step = jax.jit(lambda m: first.send(jnp.sin(m @ m).sum(), dest))
    step(product)
    first.recv(jnp.float32(0), source)
    first.free()
    # The kernel refuses the freed communicator on every rank. The computation
    # has no outputs: if it ran after the call returned, only jaxcomm's
    # record of the failure is left.
    try:
        step(product)
    except RUNTIME_ERRORS:
        pass
    with pytest.raises(RuntimeError, match="earlier failed: jaxcomm: send: communicator was freed"):
        jaxcomm.sync()
    jaxcomm.sync()
