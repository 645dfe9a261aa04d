"""What jaxcomm does on a jax it was not tested with: it still imports, keeps every
MPI call in program order, and names what it skipped in one warning. And a
program shape that one tested jax's compiler could not take."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from at_once import at_once
from conftest import run_job, spawns_own_mpi

from jaxcomm import _compat

# Pretends to be a newer jax (and, optionally, removes internals) before the
# import, then checks the warning, and that a jitted call is ordered by
# JAX's runtime tokens and right, on every rank.
NEWER_JAX = """
import sys, warnings
import jax
from jax._src import effects
jax.__version__ = "0.99.0"
for name in sys.argv[1:]:
    delattr(effects, name)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import jaxcomm
    from jaxcomm import _compat
mine = [str(w.message) for w in caught if issubclass(w.category, _compat.JaxVersionWarning)]
assert len(mine) == 1, mine
import jax.numpy as jnp
from mpi4py import MPI
jc = jaxcomm.JaxComm(MPI.COMM_WORLD)
step = jax.jit(lambda x: jc.allreduce(x, op=MPI.SUM))
assert _compat.runtime_token_effects(step.lower(jnp.ones(3)).compile())
assert not _compat.fast_dispatch_enabled
assert float(step(jnp.ones(3))[0]) == MPI.COMM_WORLD.size
if MPI.COMM_WORLD.rank == 0:  # one line: the ranks' output would interleave
    print(mine[0])
"""


def test_the_tested_jax_skips_nothing():
    assert _compat.NEWEST_TESTED_JAX >= _compat.JAX_VERSION >= _compat.OLDEST_JAX
    assert _compat._skipped == []


REFUSED_WITHOUT = ["ordered_effects", "control_flow_allowed_effects"]


@pytest.fixture(scope="module")
def newer_jax(tmp_path_factory):
    """NEWER_JAX's job for each set of removed internals, the jobs started together."""
    cases = {(): 2, ("partial_eval_kept_effects",): 1, **{(name,): 1 for name in REFUSED_WITHOUT}}
    jobs = (
        partial(run_job, tmp_path_factory.mktemp("jax"), NEWER_JAX, *removed, ranks=n, limit=180)
        for removed, n in cases.items()
    )
    return {removed: done for removed, (done, _) in zip(cases, at_once(*jobs))}


@spawns_own_mpi
def test_a_newer_jax_imports_with_one_warning_and_runtime_tokens(newer_jax):
    done = newer_jax[()]
    assert done.returncode == 0, done.stderr
    warning = done.stdout
    assert "jaxcomm on jax 0.99.0 (tested with 0.6 to " in warning
    assert "MPI calls stay in program order" in warning and "fast dispatch" in warning


@spawns_own_mpi
def test_a_newer_jax_without_an_optional_internal_names_what_is_lost(newer_jax):
    done = newer_jax[("partial_eval_kept_effects",)]
    assert done.returncode == 0, done.stderr
    assert "the derivatives of send (reverse mode)" in done.stdout


@spawns_own_mpi
@pytest.mark.parametrize("internal", REFUSED_WITHOUT)
def test_a_jax_without_what_ordering_rests_on_is_refused_at_import(newer_jax, internal):
    done = newer_jax[(internal,)]
    assert done.returncode != 0
    assert "ImportError: jaxcomm orders MPI calls with JAX internals that jax 0.99.0" in done.stderr


@pytest.mark.parametrize("op", ["allreduce", "bcast", "allgather", "sendrecv"])
@pytest.mark.parametrize("shape", [(4, 4), (4, 4, 3)], ids=["matvec", "tensordot"])
def test_a_product_feeding_a_call_whose_results_are_returned_compiles(jc, op, shape):
    # XLA:CPU of jaxlib 0.6 read the backend config of the computation's root
    # while emitting a small or matrix-vector product, and aborted the process
    # when the root was a jaxcomm call (returning exactly its results makes it
    # the root on jax 0.6 to 0.9, where the token is returned too).
    a = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape) + jc.rank
    x = jnp.ones(shape[1], jnp.float32)
    calls = {
        "allreduce": lambda y: jc.allreduce(y),
        "bcast": lambda y: jc.bcast(y, 0),
        "allgather": lambda y: jc.allgather(y),
        "sendrecv": lambda y: jc.sendrecv(y, y, (jc.rank - 1) % jc.size, (jc.rank + 1) % jc.size),
    }
    got = jax.jit(lambda a, x: calls[op](jnp.tensordot(x, a, axes=(0, 1))))(a, x)
    products = [
        np.tensordot(np.ones(shape[1]), np.arange(np.prod(shape)).reshape(shape) + r, axes=(0, 1))
        for r in range(jc.size)
    ]
    want = {
        "allreduce": sum(products),
        "bcast": products[0],
        "allgather": np.stack(products),
        "sendrecv": products[(jc.rank - 1) % jc.size],
    }[op]
    np.testing.assert_allclose(got, want)
