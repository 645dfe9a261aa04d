"""Random programs of jaxcomm calls, checked against NumPy.

Hypothesis draws a seed; rank 0's is broadcast, so every rank builds the same
program from ``numpy.random.default_rng(seed)``: blocks of calls of every op
(random shapes, 0-d and empty included, dtypes, roots, reduction ops, tiled
or not, counts, tags and wildcards), each block run eagerly, jitted, under
``vmap``, inside ``lax.scan`` or differentiated with ``grad``. Every rank's
inputs come from the seed too, so each rank computes its expected results
with NumPy from all ranks' inputs, and the expected gradients as the
transposes of those linear maps (under the replicated-value convention of
docs/autodiff.md).

A failure on any rank fails the test on every rank, printing the seed, the
program and how to replay it: ``JAXCOMM_RANDOM_SEED=<seed> mpiexec -n N
python -m pytest --with-mpi tests/test_random_programs.py``.
``JAXCOMM_RANDOM_EXAMPLES`` sets how many programs run (default 6).
"""

import dataclasses
import os
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ALL_DTYPES, X64
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from jax import lax
from mpi4py import MPI
from operations import select

import jaxcomm

SEED = os.environ.get("JAXCOMM_RANDOM_SEED")
EXAMPLES = 1 if SEED else int(os.environ.get("JAXCOMM_RANDOM_EXAMPLES", "6"))

_64_BIT = ("int64", "uint64", "float64", "complex128")
DTYPES = [d for d in ALL_DTYPES if X64 or d.name not in _64_BIT]
_INTEGER = [d for d in DTYPES if d.kind in "iu"]
_FLOAT = [d for d in DTYPES if d.kind == "f" or d == np.dtype(jnp.bfloat16)]
_COMPLEX = [d for d in DTYPES if d.kind == "c"]
_BOOL = [np.dtype(bool)]
# The dtypes each reduction is defined for (README, "Reductions").
REDUCTIONS = {
    "SUM": _INTEGER + _FLOAT + _COMPLEX,
    "PROD": _INTEGER + _FLOAT + _COMPLEX,
    "MIN": _INTEGER + _FLOAT,
    "MAX": _INTEGER + _FLOAT,
    "LAND": _INTEGER + _BOOL,
    "LOR": _INTEGER + _BOOL,
    "LXOR": _INTEGER + _BOOL,
    "BAND": _INTEGER,
    "BOR": _INTEGER,
    "BXOR": _INTEGER,
}
# Real dtypes that gradients are checked in.
_GRAD_DTYPES = [d for d in DTYPES if d.name in ("float32", "float64")]

_REDUCING = tuple(dict.fromkeys(op.method for op in select(family="reduction")))
# Ops that take pytrees.
_TREES = ("allreduce", "reduce", "bcast", "allgather", "gather")
# Ops whose output is the same on every rank: one value, its cotangent not summed.
_REPLICATED = tuple(dict.fromkeys(op.method for op in select(replicated=True)))
# The table's blocking operations ("pair": send/recv); each has a model below.
# The exchanges whose counts are data have their own random patterns and
# NumPy model (test_ragged.py).
_BLOCKING = [op for op in select() if op.kind != "nonblocking" and op.family != "ragged"]
OPS = tuple(dict.fromkeys("pair" if op.id == "send/recv" else op.method for op in _BLOCKING))
TRANSFORMS = ("eager", "jit", "vmap", "jit-vmap", "scan", "jit-scan", "grad", "jit-grad")


@dataclasses.dataclass
class Step:
    """One jaxcomm call: ``op`` on leaves of ``dtypes``, with ``shapes[rank][leaf]``.

    ``tree`` says how the leaves are passed: one array, a dict or a tuple.
    ``special`` puts NaN and signed zeros into float inputs.
    """

    op: str
    dtypes: tuple
    shapes: tuple
    tree: str = "array"
    params: dict = dataclasses.field(default_factory=dict)
    special: bool = False

    def __str__(self):
        leaves = ", ".join(f"{d.name}{list(s)}" for d, s in zip(self.dtypes, self.shapes[0]))
        varying = "" if len(set(self.shapes)) == 1 else f" (shapes by rank {list(self.shapes)})"
        params = " ".join(f"{k}={v}" for k, v in self.params.items())
        return f"{self.op} {params} {self.tree}[{leaves}]{varying}" + (
            " with NaN/-0" if self.special else ""
        )


@dataclasses.dataclass
class Block:
    """Steps run together under one transformation (``batch``: the vmap or scan length)."""

    transform: str
    steps: list
    batch: int = 0

    def __str__(self):
        batch = f" batch={self.batch}" if self.batch else ""
        return f"{self.transform}{batch}: " + "; ".join(map(str, self.steps))


# Building programs ---------------------------------------------------------


def _shape(rng, min_ndim=0, max_ndim=3):
    """A small shape; a dimension is 0 now and then."""
    ndim = int(rng.integers(min_ndim, max_ndim + 1))
    return tuple(int(rng.choice([0, 1, 2, 3], p=[0.1, 0.3, 0.3, 0.3])) for _ in range(ndim))


def _make_step(rng, op, size, grad):
    """A random step of ``op``; with ``grad``, one that is linear in one float array."""
    params, rest = {}, _shape(rng, 0, 2)
    uniform = lambda *shapes: tuple(tuple(shapes) for _ in range(size))
    pick = lambda choices: choices[int(rng.integers(len(choices)))]
    dtype = pick(_GRAD_DTYPES) if grad else pick(DTYPES)
    if op in _REDUCING:
        params["op"] = "SUM" if grad else pick(list(REDUCTIONS))
        dtype = dtype if grad else pick(REDUCTIONS[params["op"]])
    if op in ("reduce", "bcast", "gather", "scatter", "gatherv", "scatterv"):
        params["root"] = int(rng.integers(size))
    if op in ("reduce_scatter", "allgather", "gather", "scatter", "alltoall"):
        params["tiled"] = bool(rng.integers(2))
    tiled = params.get("tiled", False)
    leading = size * int(rng.integers(3)) if tiled else size
    if op in ("reduce_scatter", "scatter", "alltoall"):
        shapes = uniform((leading, *rest))
    elif op in ("allgather", "gather") and tiled:
        shapes = uniform(_shape(rng, 1, 3))
    elif op in ("allgatherv", "gatherv", "scatterv"):
        params["counts"] = [int(c) for c in rng.integers(0, 4, size)]
        if op == "scatterv":
            shapes = uniform((sum(params["counts"]), *rest))
        else:
            shapes = tuple(((c, *rest),) for c in params["counts"])
    elif op == "alltoallv":
        params["counts"] = [[int(c) for c in row] for row in rng.integers(0, 3, (size, size))]
        shapes = tuple(((sum(row), *rest),) for row in params["counts"])
    else:
        shapes = uniform(_shape(rng))
    dtypes, tree = (dtype,), "array"
    if op in _TREES and not grad and rng.random() < 0.4:
        tree = pick(["dict", "tuple"])
        allowed = REDUCTIONS[params["op"]] if "op" in params else DTYPES
        more = int(rng.integers(1, 3))
        dtypes += tuple(pick(allowed) for _ in range(more))
        extra = [_shape(rng, 1 if tiled else 0, 3) for _ in range(more)]
        shapes = tuple((*s, *extra) for s in shapes)
    if op in ("sendrecv", "pair"):
        params["status"] = pick([None, None, "object", "return"]) if not grad else None
    if op == "sendrecv":
        params["direction"] = pick([1, -1])
        params["any_source"] = bool(rng.integers(2))
        # Both wildcards could match another step's message from another
        # rank; with two ranks there is no other rank.
        params["any_tag"] = bool(rng.integers(2)) and (size <= 2 or not params["any_source"])
    special = not grad and any(d in _FLOAT for d in dtypes) and rng.random() < 0.3
    return Step(op, dtypes, shapes, tree, params, special)


def build_program(seed, size):
    """The random program for ``seed`` on ``size`` ranks: a list of blocks."""
    rng = np.random.default_rng(seed)
    blocks = []
    for _ in range(int(rng.integers(3, 7))):
        transform = TRANSFORMS[int(rng.integers(len(TRANSFORMS)))]
        grad = "grad" in transform
        steps = []
        for _ in range(1 if grad else int(rng.integers(1, 4))):
            op = OPS[int(rng.integers(len(OPS)))]
            step = _make_step(rng, op, size, grad)
            if step.params.get("status") and transform not in ("eager", "jit"):
                step.params["status"] = None
            if step.params.get("status") == "object" and transform != "eager":
                step.params["status"] = "return"
            steps.append(step)
        batch = int(rng.integers(1, 4)) if "vmap" in transform or "scan" in transform else 0
        blocks.append(Block(transform, steps, batch))
    return blocks


def describe(program):
    return "\n".join(f"  block {i}: {block}" for i, block in enumerate(program))


# Inputs ----------------------------------------------------------------------


def _leaf(rng, shape, dtype, special):
    """Small integers, exact in every dtype and in every sum and product made of them."""
    if dtype == np.dtype(bool):
        return rng.integers(0, 2, shape).astype(bool)
    low = 0 if dtype.kind == "u" else -3
    values = rng.integers(low, 4, shape).astype(np.float64)
    if dtype.kind == "c":
        values = values + 1j * rng.integers(-3, 4, shape)
    if special and dtype in _FLOAT and values.size:
        values = np.where((values == 0) & (rng.random(shape) < 0.5), -0.0, values)
        values.flat[int(rng.integers(values.size))] = np.nan if rng.random() < 0.5 else -0.0
    return values.astype(dtype)


def inputs(seed, b, s, step, rank, batch):
    """Rank ``rank``'s input to step ``s`` of block ``b`` (with a leading batch axis if any)."""
    rng = np.random.default_rng([seed, b, s, rank])
    lead = (batch,) if batch else ()
    leaves = [
        _leaf(rng, lead + shape, dtype, step.special)
        for shape, dtype in zip(step.shapes[rank], step.dtypes)
    ]
    if step.tree == "array":
        return leaves[0]
    if step.tree == "tuple":
        return tuple(leaves)
    return {f"leaf{i}": leaf for i, leaf in enumerate(leaves)}


# Running steps with jaxcomm ----------------------------------------------------------


def _partner(rank, size):
    """The pair partner: (0, 1), (2, 3), ...; the last of an odd count has none."""
    return rank ^ 1 if rank ^ 1 < size else MPI.PROC_NULL


def call(jc, step, x, tag):
    """Make ``step``'s jaxcomm call on this rank's ``x`` (traceable)."""
    p, rank, size = step.params, jc.rank, jc.size
    op = getattr(MPI, p["op"]) if "op" in p else None
    if step.op in ("allreduce", "scan", "exscan"):
        return getattr(jc, step.op)(x, op=op)
    if step.op == "reduce":
        return jc.reduce(x, op=op, root=p["root"])
    if step.op == "reduce_scatter":
        return jc.reduce_scatter(x, op=op, tiled=p["tiled"])
    if step.op == "bcast":
        return jc.bcast(x, root=p["root"])
    if step.op in ("allgather", "alltoall"):
        return getattr(jc, step.op)(x, tiled=p["tiled"])
    if step.op in ("gather", "scatter"):
        return getattr(jc, step.op)(x, root=p["root"], tiled=p["tiled"])
    if step.op in ("allgatherv", "alltoallv"):
        return getattr(jc, step.op)(x, p["counts"])
    if step.op in ("gatherv", "scatterv"):
        return getattr(jc, step.op)(x, p["counts"], root=p["root"])
    if step.op == "barrier":
        jc.barrier()
        return x
    status = MPI.Status() if p["status"] == "object" else None
    kwargs = {"status": status, "return_status": p["status"] == "return"}
    if step.op == "sendrecv":
        dest, source = (rank + p["direction"]) % size, (rank - p["direction"]) % size
        result = jc.sendrecv(
            x,
            x,
            source=MPI.ANY_SOURCE if p["any_source"] else source,
            dest=dest,
            sendtag=tag,
            recvtag=MPI.ANY_TAG if p["any_tag"] else tag,
            **kwargs,
        )
    else:  # pair: the even rank sends first, its partner receives first
        partner = _partner(rank, size)
        if rank % 2 == 0:
            jc.send(x, partner, tag=tag)
        # The input as template keeps a vmapped receive batched like the send.
        result = jc.recv(x, source=partner, tag=tag, **kwargs)
        if rank % 2 == 1:
            jc.send(x, partner, tag=tag)
    if status is not None:
        return result, np.array([status.Get_source(), status.Get_tag(), status.Get_count(MPI.BYTE)])
    return result


def _tags(program):
    """A tag of its own for every step, so that a receive from MPI.ANY_SOURCE matches no other's."""
    return {
        (b, s): 1 + b * 10 + s for b, block in enumerate(program) for s in range(len(block.steps))
    }


def run_block(jc, block, xs, tags, cotangents):
    """Run ``block`` on this rank's inputs ``xs`` (one per step); returns its outputs."""

    def steps(xs):
        return tuple(call(jc, step, x, tag) for step, x, tag in zip(block.steps, xs, tags))

    transform = block.transform.removeprefix("jit-")
    if transform == "vmap":
        f = jax.vmap(steps)
    elif transform == "scan":
        f = lambda xs: lax.scan(lambda carry, x: (carry, steps(x)), None, xs)[1]
    elif transform == "grad":
        loss = lambda x: jnp.sum(jnp.asarray(cotangents[0]) * steps((x,))[0])
        f = lambda xs: (jax.grad(loss)(xs[0]),)
    else:
        f = steps
    if block.transform.startswith("jit"):
        f = jax.jit(f)
    return f(tuple(jax.tree_util.tree_map(jnp.asarray, x) for x in xs))


# NumPy reference -------------------------------------------------------------------


def _reduce(name, arrays, dtype):
    """The reduction ``name`` of ``arrays`` (one per rank), as MPI defines it for ``dtype``."""
    if not arrays:
        raise ValueError("nothing to reduce")
    if name in ("LAND", "LOR", "LXOR"):
        truth = np.stack([a != 0 for a in arrays])
        result = {"LAND": truth.all(0), "LOR": truth.any(0), "LXOR": truth.sum(0) % 2 == 1}[name]
        return result.astype(dtype)
    if name in ("BAND", "BOR", "BXOR"):
        ufunc = {"BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor}[name]
        return ufunc.reduce(np.stack(arrays), axis=0)
    wide = np.stack([a.astype(np.complex128 if dtype.kind == "c" else np.float64) for a in arrays])
    if name == "SUM":
        result = wide.sum(0)
    elif name == "PROD":
        result = wide.prod(0)
    else:
        # NaN on any rank gives NaN; -0 is below +0.
        result = (np.minimum if name == "MIN" else np.maximum).reduce(wide, axis=0)
        zeros = wide == 0
        negative = (
            (zeros & np.signbit(wide)).any(0)
            if name == "MIN"
            else ~(zeros & ~np.signbit(wide)).any(0)
        )
        result = np.where(result == 0, np.where(negative, -0.0, 0.0), result)
    return result.astype(dtype)


def _leaf_reference(step, xs, rank, size):
    """``step``'s result on ``rank`` for one leaf, from every rank's leaf ``xs``."""
    p, x = step.params, xs[rank]
    zeros_unless = lambda keep, y: y if keep else np.zeros_like(y)
    if step.op == "allreduce":
        return _reduce(p["op"], xs, x.dtype)
    if step.op == "reduce":
        return zeros_unless(rank == p["root"], _reduce(p["op"], xs, x.dtype))
    if step.op == "scan":
        return _reduce(p["op"], xs[: rank + 1], x.dtype)
    if step.op == "exscan":
        return _reduce(p["op"], xs[:rank], x.dtype) if rank else np.zeros_like(x)
    if step.op == "reduce_scatter":
        blocks = np.split(_reduce(p["op"], xs, x.dtype), size)
        return blocks[rank] if p["tiled"] else blocks[rank][0]
    if step.op == "bcast":
        return xs[p["root"]]
    if step.op in ("allgather", "gather"):
        stacked = np.concatenate(xs) if p["tiled"] else np.stack(xs)
        return zeros_unless(step.op == "allgather" or rank == p["root"], stacked)
    if step.op == "scatter":
        blocks = np.split(xs[p["root"]], size)
        return blocks[rank] if p["tiled"] else blocks[rank][0]
    if step.op == "alltoall":
        blocks = [np.split(y, size)[rank] for y in xs]
        return np.concatenate(blocks)
    if step.op in ("allgatherv", "gatherv"):
        return zeros_unless(step.op == "allgatherv" or rank == p["root"], np.concatenate(xs))
    if step.op == "scatterv":
        return np.split(xs[p["root"]], np.cumsum(p["counts"])[:-1])[rank]
    if step.op == "alltoallv":
        return np.concatenate(
            [np.split(y, np.cumsum(row)[:-1])[rank] for y, row in zip(xs, p["counts"])]
        )
    if step.op == "barrier":
        return x
    if step.op == "sendrecv":
        return xs[(rank - p["direction"]) % size]
    partner = _partner(rank, size)
    return np.zeros_like(x) if partner == MPI.PROC_NULL else xs[partner]


def reference(step, xs, rank, size, tag):
    """``step``'s result on ``rank`` from every rank's input ``xs``, with NumPy."""
    per_leaf = [jax.tree_util.tree_leaves(x) for x in xs]
    leaves = [
        _leaf_reference(step, [leaves[i] for leaves in per_leaf], rank, size)
        for i in range(len(per_leaf[0]))
    ]
    result = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(xs[0]), leaves)
    status = step.params.get("status")
    if not status:
        return result
    if step.op == "sendrecv":
        source = (rank - step.params["direction"]) % size
    else:
        source = _partner(rank, size)
    y = leaves[0]
    if source == MPI.PROC_NULL:
        envelope = [MPI.PROC_NULL, MPI.ANY_TAG, 0]
    else:
        envelope = [source, tag, y.nbytes if status == "object" else y.size]
    return result, np.array(
        envelope, dtype=np.int64 if status == "object" else jnp.asarray(0).dtype
    )


def reference_gradient(step, xs, rank, size, cotangents):
    """The gradient of ``sum(cotangent * step(x))`` on ``rank``: the transposed linear map.

    A replicated output's cotangent is the same on every rank and counts once,
    hence the division by ``size``.
    """
    gradient = np.zeros(xs[rank].shape, np.float64)
    for e in range(xs[rank].size):
        unit = [np.zeros(x.shape, np.float64) for x in xs]
        unit[rank].flat[e] = 1
        gradient.flat[e] = sum(
            np.sum(cotangents[j] * _leaf_reference(step, unit, j, size)) for j in range(size)
        )
    if step.op in _REPLICATED:
        gradient /= size
    return gradient.astype(xs[rank].dtype)


def expected_block(seed, b, block, rank, size, tags):
    """Every step's expected result in block ``b`` on ``rank``, and the cotangents used."""
    batch = block.batch
    all_inputs = [
        [inputs(seed, b, s, step, r, batch) for r in range(size)]
        for s, step in enumerate(block.steps)
    ]
    expected, cotangents = [], None
    for step, xs, tag in zip(block.steps, all_inputs, tags):
        if block.transform.endswith("grad"):
            # One cotangent for a replicated output, one per rank otherwise.
            salt = 0 if step.op in _REPLICATED else 1
            cotangents = [
                np.random.default_rng([seed, b, 99, salt * r])
                .integers(-3, 4, _leaf_reference(step, xs, r, size).shape)
                .astype(xs[r].dtype)
                for r in range(size)
            ]
            expected.append(reference_gradient(step, xs, rank, size, cotangents))
        elif batch:
            members = [
                reference(
                    step, [jax.tree_util.tree_map(lambda a: a[i], x) for x in xs], rank, size, tag
                )
                for i in range(batch)
            ]
            expected.append(jax.tree_util.tree_map(lambda *ys: np.stack(ys), *members))
        else:
            expected.append(reference(step, xs, rank, size, tag))
    return all_inputs, tuple(expected), cotangents


def mismatch(got, want, signed_zeros):
    """How ``got`` differs from ``want`` (dtype, shape, values, signs of zeros), or None.

    NumPy's sums and products do not give zeros IEEE's signs, so
    ``signed_zeros`` is off for them.
    """
    structures = [jax.tree_util.tree_structure(t) for t in (got, want)]
    if structures[0] != structures[1]:
        return f"structure {structures[0]}, expected {structures[1]}"
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        g = np.asarray(g)
        if g.dtype != w.dtype or g.shape != w.shape:
            return f"{g.dtype}{list(g.shape)}, expected {w.dtype}{list(w.shape)}"
        # Widened, as NumPy's NaN checks do not know bfloat16.
        wide = [a.astype(np.float64) if w.dtype in _FLOAT else a for a in (g, w)]
        if not np.array_equal(*wide, equal_nan=wide[1].dtype.kind in "fc"):
            return f"got\n{g!r}\nexpected\n{w!r}"
        zeros = wide[1] == 0
        if (
            signed_zeros
            and w.dtype in _FLOAT
            and not np.array_equal(*(np.signbit(a[zeros]) for a in wide))
        ):
            return f"signs of zeros differ: got\n{g!r}\nexpected\n{w!r}"
    return None


def run_program(jc, seed, program):
    """Run ``program`` on this rank; returns the problems found (empty when all is right)."""
    rank, size, tags = jc.rank, jc.size, _tags(program)
    problems = []
    try:
        for b, block in enumerate(program):
            block_tags = [tags[b, s] for s in range(len(block.steps))]
            all_inputs, expected, cotangents = expected_block(
                seed, b, block, rank, size, block_tags
            )
            mine = [xs[rank] for xs in all_inputs]
            got = run_block(jc, block, mine, block_tags, cotangents and [cotangents[rank]])
            for s, (g, w) in enumerate(zip(got, expected)):
                step = block.steps[s]
                problem = mismatch(g, w, step.params.get("op") not in ("SUM", "PROD"))
                if problem:
                    problems.append(f"block {b} step {s} ({step}): {problem}")
        jaxcomm.sync()
    except Exception:
        # Stop here: going on could leave this rank's calls out of step with the others'.
        problems.append(f"raised:\n{traceback.format_exc()}")
    return problems


@pytest.fixture(scope="module")
def world():
    """A duplicate of COMM_WORLD for agreeing on seeds and verdicts, apart from jaxcomm's."""
    comm = MPI.COMM_WORLD.Dup()
    yield comm
    comm.Free()


@pytest.mark.mpi
@settings(
    max_examples=EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)
@given(seed=st.integers(0, 2**63 - 1))
def test_random_program(jc, world, seed):
    seed = world.bcast(int(SEED) if SEED else seed, root=0)
    program = build_program(seed, jc.size)
    problems = world.allgather(run_program(jc, seed, program))
    if any(problems):
        report = "\n".join(f"rank {r}: {p}" for r, ps in enumerate(problems) for p in ps)
        pytest.fail(
            f"random program {seed} on {jc.size} rank(s) failed:\n{describe(program)}\n"
            f"{report}\nreplay: JAXCOMM_RANDOM_SEED={seed} mpiexec -n {jc.size} python -m "
            "pytest --with-mpi -p no:cacheprovider tests/test_random_programs.py",
            pytrace=False,
        )
