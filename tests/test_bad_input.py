"""Bad arguments: every public entry point x every kind of bad argument.

Each case must raise ``TypeError`` (wrong type, or a traced value where a
static one is needed) or ``ValueError`` (wrong value) naming the argument,
before any MPI call: a rank that raises after starting a collective or a
message would leave its peers waiting. Methods of a freed ``JaxComm`` raise
``RuntimeError``, as ``JaxComm.free`` documents. Every rank passes the same
bad argument here, where a late check would go unnoticed, so the test checks
"before any MPI call" directly: with MPI call logging on, no kernel may log a
call, and a collective afterwards must still match up on every rank.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import mpi_debug
from mpi4py import MPI

import jaxcomm
from jaxcomm import JaxComm


class Comms(NamedTuple):
    """What the cases call: communicators in each state, and a user-defined op."""

    jc: JaxComm  # over COMM_WORLD, without a Cartesian topology
    grid: JaxComm  # a periodic one-dimensional Cartesian grid
    freed: JaxComm
    freed_grid: JaxComm
    null: MPI.Intracomm  # an mpi4py communicator after Free(): MPI.COMM_NULL
    user_op: MPI.Op

    @property
    def size(self) -> int:
        return self.jc.size


@pytest.fixture(scope="module")
def comms(jc):
    grid = JaxComm.from_cart([0], periods=[True])
    freed = JaxComm()
    freed.free()
    freed_grid = JaxComm.from_cart([0])
    freed_grid.free()
    null = MPI.COMM_WORLD.Dup()
    null.Free()
    user_op = MPI.Op.Create(lambda a, b, datatype: None, commute=True)
    yield Comms(jc, grid, freed, freed_grid, null, user_op)
    user_op.Free()
    grid.free()


TAG_UB = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
# A negative number that is no special rank or tag.
NEGATIVE = min(MPI.PROC_NULL, MPI.ANY_SOURCE, MPI.ANY_TAG, MPI.ROOT) - 1


def ones(*shape: int, dtype: Any = jnp.float32) -> jax.Array:
    return jnp.ones(shape, dtype)


def traced(f, value: Any = 0) -> Any:
    """Call ``f`` on ``value`` turned into a tracer by ``jax.jit``."""
    return jax.jit(f)(value)


def cases(method: str, rows: list[tuple]) -> list:
    """``pytest.param(method, call, error, match, id=method-name)`` for each row."""
    return [
        pytest.param(method, call, error, match, id=f"{method}-{name}")
        for name, call, error, match in rows
    ]


FREED = r"this JaxComm has been freed"
NOT_AN_ARRAY = r"^x must be an array or a scalar, got str"


def x_cases(call) -> list[tuple]:
    """Bad ``x`` for a method ``call(c, x)`` that takes any array or pytree."""
    return [
        ("x-str", lambda c: call(c, "abc"), TypeError, NOT_AN_ARRAY),
        (
            "x-None",
            lambda c: call(c, None),
            TypeError,
            r"^x must be an array or a scalar, got NoneType",
        ),
        (
            "x-str-dtype",
            lambda c: call(c, np.array(["a", "b"])),
            TypeError,
            r"^x has dtype <U1, which jaxcomm cannot send",
        ),
        (
            "x-float8",
            lambda c: call(c, ones(2, dtype=jnp.float8_e4m3fn)),
            TypeError,
            r"^x has dtype float8_e4m3fn, which jaxcomm cannot send",
        ),
    ]


def op_cases(call) -> list[tuple]:
    """Bad ``op`` for a reduction ``call(c, x, op)``."""
    return [
        (
            "op-str",
            lambda c: call(c, ones(2), "sum"),
            TypeError,
            r"^op must be a predefined mpi4py MPI.Op",
        ),
        (
            "op-BAND-float",
            lambda c: call(c, ones(2), MPI.BAND),
            TypeError,
            r"^op MPI.BAND is not defined for dtype float32",
        ),
        (
            "op-SUM-bool",
            lambda c: call(c, ones(2, dtype=bool), MPI.SUM),
            TypeError,
            r"^op MPI.SUM is not defined for dtype bool",
        ),
        (
            "op-MAX-complex",
            lambda c: call(c, ones(2, dtype=jnp.complex64), MPI.MAX),
            TypeError,
            r"^op MPI.MAX is not defined for dtype complex64",
        ),
        (
            "op-user-defined",
            lambda c: call(c, ones(2), c.user_op),
            ValueError,
            r"^op .* is not supported: a user-defined MPI.Op \(MPI.Op.Create\) calls a Python function",
        ),
        (
            "op-MAXLOC",
            lambda c: call(c, ones(2), MPI.MAXLOC),
            ValueError,
            r"^op MPI.MAXLOC is not supported: MPI defines it only for \(value, index\) pair",
        ),
    ]


def rank_cases(name: str, call, *, special: tuple = ()) -> list[tuple]:
    """Bad ranks for ``call(c, rank)``; ``special`` names the negative ranks it accepts."""
    rows = [
        (f"{name}-str", lambda c: call(c, "0"), TypeError, rf"^{name} must be an int, got str"),
        (f"{name}-float", lambda c: call(c, 0.0), TypeError, rf"^{name} must be an int, got float"),
        (f"{name}-bool", lambda c: call(c, True), TypeError, rf"^{name} must be an int, got bool"),
        (
            f"{name}-traced",
            lambda c: traced(lambda t: call(c, t)),
            TypeError,
            rf"^{name} must be a static Python int, but got a traced value",
        ),
        (
            f"{name}-size",
            lambda c: call(c, c.size),
            ValueError,
            rf"^{name}=\d+ is not a rank of this \d+-process communicator",
        ),
        (
            f"{name}-negative",
            lambda c: call(c, NEGATIVE),
            ValueError,
            rf"^{name}={NEGATIVE} is not a rank",
        ),
    ]
    if "PROC_NULL" not in special:
        rows.append(
            (
                f"{name}-PROC_NULL",
                lambda c: call(c, MPI.PROC_NULL),
                ValueError,
                rf"^{name}={MPI.PROC_NULL} is not a rank",
            )
        )
    if "ANY_SOURCE" not in special:
        rows.append(
            (
                f"{name}-ANY_SOURCE",
                lambda c: call(c, MPI.ANY_SOURCE),
                ValueError,
                rf"^{name}={MPI.ANY_SOURCE} is not a rank",
            )
        )
    return rows


def tag_cases(name: str, call, *, any_tag: bool = False) -> list[tuple]:
    """Bad tags for ``call(c, tag)``; ``any_tag`` when ``MPI.ANY_TAG`` is accepted."""
    rows = [
        (f"{name}-str", lambda c: call(c, "0"), TypeError, rf"^{name} must be an int, got str"),
        (f"{name}-float", lambda c: call(c, 1.0), TypeError, rf"^{name} must be an int, got float"),
        (
            f"{name}-traced",
            lambda c: traced(lambda t: call(c, t)),
            TypeError,
            rf"^{name} must be a static Python int, but got a traced value",
        ),
        (
            f"{name}-above-TAG_UB",
            lambda c: call(c, TAG_UB + 1),
            ValueError,
            rf"^{name}={TAG_UB + 1} is outside the valid tag range 0\.\.{TAG_UB}",
        ),
        (
            f"{name}-negative",
            lambda c: call(c, NEGATIVE),
            ValueError,
            rf"^{name}={NEGATIVE} is outside the valid tag range",
        ),
    ]
    if not any_tag:
        rows.append(
            (
                f"{name}-ANY_TAG",
                lambda c: call(c, MPI.ANY_TAG),
                ValueError,
                rf"^{name}={MPI.ANY_TAG} is outside the valid tag range",
            )
        )
    return rows


def tiled_cases(call) -> list[tuple]:
    """Bad ``tiled`` for ``call(c, tiled)``."""
    return [
        (
            "tiled-str",
            lambda c: call(c, "yes"),
            TypeError,
            r"^tiled must be a static bool, got str",
        ),
        ("tiled-int", lambda c: call(c, 1), TypeError, r"^tiled must be a static bool, got int"),
        (
            "tiled-traced",
            lambda c: traced(lambda t: call(c, t), True),
            TypeError,
            r"^tiled must be a static bool, but got a traced value",
        ),
    ]


def counts_cases(call, rows, name="counts") -> list[tuple]:
    """Bad one-per-rank counts (the argument ``name``) for ``call(c, x, counts)``.

    ``x`` has ``rows(c)`` rows, which fit counts of one row per rank.
    """

    def with_counts(counts_of):
        return lambda c: call(c, ones(rows(c)), counts_of(c))

    return [
        (
            f"{name}-int",
            with_counts(lambda c: 1),
            TypeError,
            rf"^{name} must be a sequence, got int",
        ),
        (
            f"{name}-str",
            with_counts(lambda c: "1" * c.size),
            TypeError,
            rf"^{name} must be a sequence, got str",
        ),
        (
            f"{name}-dict",
            with_counts(lambda c: dict.fromkeys(range(c.size), 1)),
            TypeError,
            rf"^{name} must be a sequence, got dict",
        ),
        (
            f"{name}-float",
            with_counts(lambda c: [1.0] * c.size),
            TypeError,
            rf"^{name}\[0\] must be an int, got float",
        ),
        (
            f"{name}-traced",
            lambda c: traced(lambda t: call(c, ones(rows(c)), t), jnp.ones(c.size, int)),
            TypeError,
            rf"^{name} must be a static sequence, but got a traced value",
        ),
        (
            f"{name}-entry-traced",
            lambda c: traced(lambda t: call(c, ones(rows(c)), [t] * c.size), 1),
            TypeError,
            rf"^{name}\[0\] must be a static Python int, but got a traced value",
        ),
        (
            f"{name}-too-long",
            with_counts(lambda c: [1] * (c.size + 1)),
            ValueError,
            rf"^{name} has \d+ entries; it needs one per rank",
        ),
        (
            f"{name}-negative",
            with_counts(lambda c: [-1] * c.size),
            ValueError,
            rf"^{name}\[0\]=-1 is negative",
        ),
    ]


CASES = [
    # Construction and communicator management.
    *cases(
        "JaxComm",
        [
            (
                "comm-str",
                lambda c: JaxComm("world"),
                TypeError,
                r"^comm must be an mpi4py Intracomm",
            ),
            (
                "comm-Comm",
                lambda c: JaxComm(MPI.Comm(MPI.COMM_WORLD)),
                TypeError,
                r"^comm must be an mpi4py Intracomm, got Comm",
            ),
            (
                "comm-freed",
                lambda c: JaxComm(c.null),
                ValueError,
                r"^comm must be a live communicator, got MPI.COMM_NULL",
            ),
        ],
    ),
    *cases("comm", [("freed", lambda c: c.freed.comm, RuntimeError, FREED)]),
    *cases(
        "split",
        [
            (
                "color-str",
                lambda c: c.jc.split("red"),
                TypeError,
                r"^color must be an int, got str",
            ),
            (
                "color-float",
                lambda c: c.jc.split(1.0),
                TypeError,
                r"^color must be an int, got float",
            ),
            (
                "color-traced",
                lambda c: traced(c.jc.split),
                TypeError,
                r"^color must be a static Python int",
            ),
            (
                "color-negative",
                lambda c: c.jc.split(NEGATIVE),
                ValueError,
                rf"^color={NEGATIVE} must be non-negative or MPI.UNDEFINED",
            ),
            (
                "key-str",
                lambda c: c.jc.split(0, key="a"),
                TypeError,
                r"^key must be an int, got str",
            ),
            (
                "key-traced",
                lambda c: traced(lambda t: c.jc.split(0, key=t)),
                TypeError,
                r"^key must be a static Python int",
            ),
            ("freed", lambda c: c.freed.split(0), RuntimeError, FREED),
        ],
    ),
    *cases(
        "from_cart",
        [
            (
                "dims-int",
                lambda c: JaxComm.from_cart(c.size),
                TypeError,
                r"^dims must be a sequence, got int",
            ),
            (
                "dims-str",
                lambda c: JaxComm.from_cart("1"),
                TypeError,
                r"^dims must be a sequence, got str",
            ),
            (
                "dims-entry-str",
                lambda c: JaxComm.from_cart(["1"]),
                TypeError,
                r"^dims\[0\] must be an int, got str",
            ),
            (
                "dims-entry-traced",
                lambda c: traced(lambda t: JaxComm.from_cart([t])),
                TypeError,
                r"^dims\[0\] must be a static Python int",
            ),
            (
                "dims-negative",
                lambda c: JaxComm.from_cart([-1]),
                ValueError,
                r"^dims=\[-1\] must be a non-empty list of non-negative ints",
            ),
            (
                "dims-empty",
                lambda c: JaxComm.from_cart([]),
                ValueError,
                r"^dims=\[\] must be a non-empty list",
            ),
            (
                "dims-too-many",
                lambda c: JaxComm.from_cart([c.size + 1]),
                ValueError,
                r"^dims=\[\d+\] is a grid that does not hold the \d+ processes of comm",
            ),
            (
                "periods-bool",
                lambda c: JaxComm.from_cart([0], periods=True),
                TypeError,
                r"^periods must be a sequence, got bool",
            ),
            (
                "periods-entry-str",
                lambda c: JaxComm.from_cart([0], periods=["no"]),
                TypeError,
                r"^periods\[0\] must be a static bool, got str",
            ),
            (
                "periods-too-long",
                lambda c: JaxComm.from_cart([0], periods=[True, True]),
                ValueError,
                r"^periods has 2 entries for 1 dims",
            ),
            (
                "reorder-str",
                lambda c: JaxComm.from_cart([0], reorder="no"),
                TypeError,
                r"^reorder must be a static bool, got str",
            ),
            (
                "comm-str",
                lambda c: JaxComm.from_cart([0], comm="world"),
                TypeError,
                r"^comm must be an mpi4py Intracomm, got str",
            ),
            (
                "comm-freed",
                lambda c: JaxComm.from_cart([0], comm=c.null),
                ValueError,
                r"^comm must be a live communicator, got MPI.COMM_NULL",
            ),
        ],
    ),
    *cases(
        "cart_shift",
        [
            (
                "direction-str",
                lambda c: c.grid.cart_shift("0"),
                TypeError,
                r"^direction must be an int, got str",
            ),
            (
                "direction-traced",
                lambda c: traced(c.grid.cart_shift),
                TypeError,
                r"^direction must be a static Python int",
            ),
            (
                "direction-not-an-axis",
                lambda c: c.grid.cart_shift(1),
                ValueError,
                r"^direction=1 is not an axis of a 1-d grid",
            ),
            (
                "direction-negative",
                lambda c: c.grid.cart_shift(-1),
                ValueError,
                r"^direction=-1 is not an axis",
            ),
            (
                "disp-float",
                lambda c: c.grid.cart_shift(0, 1.5),
                TypeError,
                r"^disp must be an int, got float",
            ),
            (
                "disp-traced",
                lambda c: traced(lambda t: c.grid.cart_shift(0, t)),
                TypeError,
                r"^disp must be a static Python int",
            ),
            (
                "not-Cartesian",
                lambda c: c.jc.cart_shift(0),
                TypeError,
                r"this JaxComm has no Cartesian topology",
            ),
            ("freed", lambda c: c.freed_grid.cart_shift(0), RuntimeError, FREED),
        ],
    ),
    *cases(
        "shift",
        [
            ("x-str", lambda c: c.grid.shift("abc", 0), TypeError, NOT_AN_ARRAY),
            (
                "direction-str",
                lambda c: c.grid.shift(ones(2), "0"),
                TypeError,
                r"^direction must be an int, got str",
            ),
            (
                "direction-traced",
                lambda c: traced(lambda t: c.grid.shift(ones(2), t)),
                TypeError,
                r"^direction must be a static Python int",
            ),
            (
                "direction-not-an-axis",
                lambda c: c.grid.shift(ones(2), 1),
                ValueError,
                r"^direction=1 is not an axis",
            ),
            (
                "disp-str",
                lambda c: c.grid.shift(ones(2), 0, "1"),
                TypeError,
                r"^disp must be an int, got str",
            ),
            (
                "disp-traced",
                lambda c: traced(lambda t: c.grid.shift(ones(2), 0, t)),
                TypeError,
                r"^disp must be a static Python int",
            ),
            *tag_cases("tag", lambda c, tag: c.grid.shift(ones(2), 0, tag=tag)),
            (
                "not-Cartesian",
                lambda c: c.jc.shift(ones(2), 0),
                TypeError,
                r"this JaxComm has no Cartesian topology",
            ),
            ("freed", lambda c: c.freed_grid.shift(ones(2), 0), RuntimeError, FREED),
        ],
    ),
    # Reductions.
    *cases(
        "allreduce",
        [
            *x_cases(lambda c, x: c.jc.allreduce(x)),
            (
                "x-empty-pytree",
                lambda c: c.jc.allreduce({}),
                ValueError,
                r"^x is a pytree with no arrays",
            ),
            (
                "x-leaf-str",
                lambda c: c.jc.allreduce({"a": ones(2), "b": "abc"}),
                TypeError,
                NOT_AN_ARRAY,
            ),
            *op_cases(lambda c, x, op: c.jc.allreduce(x, op=op)),
            ("freed", lambda c: c.freed.allreduce(ones(2)), RuntimeError, FREED),
        ],
    ),
    *cases(
        "reduce",
        [
            *x_cases(lambda c, x: c.jc.reduce(x)),
            *op_cases(lambda c, x, op: c.jc.reduce(x, op=op)),
            *rank_cases("root", lambda c, root: c.jc.reduce(ones(2), root=root)),
            ("freed", lambda c: c.freed.reduce(ones(2)), RuntimeError, FREED),
        ],
    ),
    *cases(
        "scan",
        [
            *x_cases(lambda c, x: c.jc.scan(x)),
            *op_cases(lambda c, x, op: c.jc.scan(x, op=op)),
            ("freed", lambda c: c.freed.scan(ones(2)), RuntimeError, FREED),
        ],
    ),
    *cases(
        "exscan",
        [
            *x_cases(lambda c, x: c.jc.exscan(x)),
            *op_cases(lambda c, x, op: c.jc.exscan(x, op=op)),
            ("freed", lambda c: c.freed.exscan(ones(2)), RuntimeError, FREED),
        ],
    ),
    *cases(
        "reduce_scatter",
        [
            *x_cases(lambda c, x: c.jc.reduce_scatter(x)),
            *op_cases(lambda c, x, op: c.jc.reduce_scatter(jnp.stack([x] * c.size), op=op)),
            *tiled_cases(lambda c, tiled: c.jc.reduce_scatter(ones(c.size), tiled=tiled)),
            (
                "x-leading-axis",
                lambda c: c.jc.reduce_scatter(ones(c.size + 1)),
                ValueError,
                r"^x must have a leading axis of length \d+ \(the communicator size\)",
            ),
            (
                "x-0-d",
                lambda c: c.jc.reduce_scatter(ones()),
                ValueError,
                r"^x must have a leading axis of length",
            ),
            (
                "x-0-d-tiled",
                lambda c: c.jc.reduce_scatter(ones(), tiled=True),
                ValueError,
                r"^x must have a leading axis that is a multiple of the communicator size",
            ),
            ("freed", lambda c: c.freed.reduce_scatter(ones(c.size)), RuntimeError, FREED),
        ],
    ),
    # Data movement.
    *cases(
        "bcast",
        [
            *x_cases(lambda c, x: c.jc.bcast(x)),
            (
                "x-empty-pytree",
                lambda c: c.jc.bcast([]),
                ValueError,
                r"^x is a pytree with no arrays",
            ),
            *rank_cases("root", lambda c, root: c.jc.bcast(ones(2), root=root)),
            ("freed", lambda c: c.freed.bcast(ones(2)), RuntimeError, FREED),
        ],
    ),
    *cases("barrier", [("freed", lambda c: c.freed.barrier(), RuntimeError, FREED)]),
    *cases(
        "allgather",
        [
            *x_cases(lambda c, x: c.jc.allgather(x)),
            *tiled_cases(lambda c, tiled: c.jc.allgather(ones(2), tiled=tiled)),
            (
                "x-0-d-tiled",
                lambda c: c.jc.allgather(ones(), tiled=True),
                ValueError,
                r"^x must have a leading axis to concatenate along",
            ),
            ("freed", lambda c: c.freed.allgather(ones(2)), RuntimeError, FREED),
        ],
    ),
    *cases(
        "gather",
        [
            *x_cases(lambda c, x: c.jc.gather(x)),
            *rank_cases("root", lambda c, root: c.jc.gather(ones(2), root=root)),
            *tiled_cases(lambda c, tiled: c.jc.gather(ones(2), tiled=tiled)),
            (
                "x-0-d-tiled",
                lambda c: c.jc.gather(ones(), tiled=True),
                ValueError,
                r"^x must have a leading axis to concatenate along",
            ),
            ("freed", lambda c: c.freed.gather(ones(2)), RuntimeError, FREED),
        ],
    ),
    *cases(
        "scatter",
        [
            *x_cases(lambda c, x: c.jc.scatter(x)),
            *rank_cases("root", lambda c, root: c.jc.scatter(ones(c.size), root=root)),
            *tiled_cases(lambda c, tiled: c.jc.scatter(ones(c.size), tiled=tiled)),
            (
                "x-leading-axis",
                lambda c: c.jc.scatter(ones(c.size + 1)),
                ValueError,
                r"^x has leading axis \d+; with tiled=False it needs one entry per rank",
            ),
            (
                "x-0-d",
                lambda c: c.jc.scatter(ones()),
                ValueError,
                r"^x must have a leading axis to split among the ranks",
            ),
            (
                "x-0-d-tiled",
                lambda c: c.jc.scatter(ones(), tiled=True),
                ValueError,
                r"^x must have a leading axis to split among the ranks",
            ),
            ("freed", lambda c: c.freed.scatter(ones(c.size)), RuntimeError, FREED),
        ],
    ),
    *cases(
        "alltoall",
        [
            *x_cases(lambda c, x: c.jc.alltoall(x)),
            *tiled_cases(lambda c, tiled: c.jc.alltoall(ones(c.size), tiled=tiled)),
            (
                "x-leading-axis",
                lambda c: c.jc.alltoall(ones(c.size + 1)),
                ValueError,
                r"^x has leading axis \d+; with tiled=False it needs one entry per rank",
            ),
            (
                "x-0-d-tiled",
                lambda c: c.jc.alltoall(ones(), tiled=True),
                ValueError,
                r"^x must have a leading axis to split among the ranks",
            ),
            ("freed", lambda c: c.freed.alltoall(ones(c.size)), RuntimeError, FREED),
        ],
    ),
    *cases(
        "allgatherv",
        [
            *x_cases(lambda c, x: c.jc.allgatherv(x, [1] * c.size)),
            *counts_cases(lambda c, x, counts: c.jc.allgatherv(x, counts), lambda c: 1),
            (
                "x-rows",
                lambda c: c.jc.allgatherv(ones(2), [1] * c.size),
                ValueError,
                r"^x has 2 rows on rank \d+, but counts\[\d+\] is 1",
            ),
            (
                "x-0-d",
                lambda c: c.jc.allgatherv(ones(), [1] * c.size),
                ValueError,
                r"^x must have a leading axis of counts\[rank\] rows",
            ),
            ("freed", lambda c: c.freed.allgatherv(ones(1), [1] * c.size), RuntimeError, FREED),
        ],
    ),
    *cases(
        "gatherv",
        [
            *x_cases(lambda c, x: c.jc.gatherv(x, [1] * c.size)),
            *counts_cases(lambda c, x, counts: c.jc.gatherv(x, counts), lambda c: 1),
            (
                "x-rows",
                lambda c: c.jc.gatherv(ones(2), [1] * c.size),
                ValueError,
                r"^x has 2 rows on rank \d+, but counts\[\d+\] is 1",
            ),
            *rank_cases("root", lambda c, root: c.jc.gatherv(ones(1), [1] * c.size, root=root)),
            ("freed", lambda c: c.freed.gatherv(ones(1), [1] * c.size), RuntimeError, FREED),
        ],
    ),
    *cases(
        "scatterv",
        [
            *x_cases(lambda c, x: c.jc.scatterv(x, [1] * c.size)),
            *counts_cases(lambda c, x, counts: c.jc.scatterv(x, counts), lambda c: c.size),
            (
                "x-rows",
                lambda c: c.jc.scatterv(ones(c.size + 1), [1] * c.size),
                ValueError,
                r"^x has \d+ rows, but counts add up to \d+",
            ),
            (
                "x-0-d",
                lambda c: c.jc.scatterv(ones(), [1] * c.size),
                ValueError,
                r"^x must have a leading axis to split among the ranks",
            ),
            *rank_cases(
                "root", lambda c, root: c.jc.scatterv(ones(c.size), [1] * c.size, root=root)
            ),
            ("freed", lambda c: c.freed.scatterv(ones(c.size), [1] * c.size), RuntimeError, FREED),
        ],
    ),
    *(
        case
        for name in ("ragged_all_to_all", "iragged_all_to_all")
        for case in cases(
            name,
            [
                (
                    "operand-str",
                    lambda c, name=name: getattr(c.jc, name)("abc", ones(2), *[[0] * c.size] * 4),
                    TypeError,
                    r"^operand must be an array or a scalar, got str",
                ),
                (
                    "rows-differ",
                    lambda c, name=name: getattr(c.jc, name)(
                        ones(2, 3), ones(2), *[[0] * c.size] * 4
                    ),
                    ValueError,
                    r"^operand rows have shape \(3,\), output rows \(\)",
                ),
                (
                    "index-length",
                    lambda c, name=name: getattr(c.jc, name)(
                        ones(2), ones(2), *[[0] * (c.size + 1)] * 4
                    ),
                    ValueError,
                    r"^input_offsets has shape \(\d+,\); it needs one entry per rank",
                ),
                (
                    "index-float",
                    lambda c, name=name: getattr(c.jc, name)(
                        ones(2), ones(2), [0] * c.size, [0.5] * c.size, [0] * c.size, [0] * c.size
                    ),
                    TypeError,
                    r"^send_sizes must be an integer array",
                ),
                (
                    "freed",
                    lambda c, name=name: getattr(c.freed, name)(
                        ones(2), ones(2), *[[0] * c.size] * 4
                    ),
                    RuntimeError,
                    FREED,
                ),
            ],
        )
    ),
    *cases(
        "alltoallv",
        [
            *x_cases(lambda c, x: c.jc.alltoallv(x, [[1] * c.size] * c.size)),
            (
                "counts-int",
                lambda c: c.jc.alltoallv(ones(c.size), 1),
                ValueError,
                r"^sendcounts has shape \(\); it needs one entry per rank",
            ),
            (
                "counts-flat-overrun",
                lambda c: c.jc.alltoallv(ones(c.size), [2] * c.size),
                ValueError,
                r"^sendcounts add up to \d+ rows, more than x's rows",
            ),
            (
                "counts-row-str",
                lambda c: c.jc.alltoallv(ones(c.size), ["1" * c.size] * c.size),
                TypeError,
                r"^sendcounts must be an integer array",
            ),
            (
                "counts-float",
                lambda c: c.jc.alltoallv(ones(c.size), [[1.0] * c.size] * c.size),
                TypeError,
                r"^counts\[0\]\[0\] must be an int, got float",
            ),
            (
                "counts-traced",
                lambda c: traced(
                    lambda t: c.jc.alltoallv(ones(c.size), t), jnp.ones((c.size, c.size), int)
                ),
                TypeError,
                r"^counts must be a static sequence, but got a traced value",
            ),
            (
                "counts-too-long",
                lambda c: c.jc.alltoallv(ones(c.size), [[1] * c.size] * (c.size + 1)),
                ValueError,
                r"^counts has \d+ entries; it needs one per rank",
            ),
            (
                "counts-row-too-long",
                lambda c: c.jc.alltoallv(ones(c.size), [[1] * (c.size + 1)] * c.size),
                ValueError,
                r"^counts\[0\] has \d+ entries; it needs one per rank",
            ),
            (
                "counts-negative",
                lambda c: c.jc.alltoallv(ones(c.size), [[-1] * c.size] * c.size),
                ValueError,
                r"^counts\[0\]\[0\]=-1 is negative",
            ),
            (
                "x-rows",
                lambda c: c.jc.alltoallv(ones(c.size + 1), [[1] * c.size] * c.size),
                ValueError,
                r"^x has \d+ rows on rank \d+, but counts\[\d+\] adds up to \d+",
            ),
            (
                "freed",
                lambda c: c.freed.alltoallv(ones(c.size), [[1] * c.size] * c.size),
                RuntimeError,
                FREED,
            ),
        ],
    ),
    # Point to point: MPI.PROC_NULL as the peer makes every valid call a no-op.
    *cases(
        "send",
        [
            *x_cases(lambda c, x: c.jc.send(x, MPI.PROC_NULL)),
            *rank_cases("dest", lambda c, dest: c.jc.send(ones(2), dest), special=("PROC_NULL",)),
            *tag_cases("tag", lambda c, tag: c.jc.send(ones(2), MPI.PROC_NULL, tag=tag)),
            ("freed", lambda c: c.freed.send(ones(2), MPI.PROC_NULL), RuntimeError, FREED),
        ],
    ),
    # Nonblocking starts validate as their blocking forms do, and take one array.
    *cases(
        "isend",
        [
            *x_cases(lambda c, x: c.jc.isend(x, MPI.PROC_NULL)),
            *rank_cases("dest", lambda c, dest: c.jc.isend(ones(2), dest), special=("PROC_NULL",)),
            *tag_cases("tag", lambda c, tag: c.jc.isend(ones(2), MPI.PROC_NULL, tag=tag)),
            ("freed", lambda c: c.freed.isend(ones(2), MPI.PROC_NULL), RuntimeError, FREED),
        ],
    ),
    *cases(
        "irecv",
        [
            ("x-str", lambda c: c.jc.irecv("abc", MPI.PROC_NULL), TypeError, NOT_AN_ARRAY),
            *rank_cases(
                "source",
                lambda c, source: c.jc.irecv(ones(2), source),
                special=("PROC_NULL", "ANY_SOURCE"),
            ),
            *tag_cases(
                "tag", lambda c, tag: c.jc.irecv(ones(2), MPI.PROC_NULL, tag=tag), any_tag=True
            ),
            ("freed", lambda c: c.freed.irecv(ones(2), MPI.PROC_NULL), RuntimeError, FREED),
        ],
    ),
    *cases(
        "iallreduce",
        [
            *x_cases(lambda c, x: c.jc.iallreduce(x)),
            *op_cases(lambda c, x, op: c.jc.iallreduce(x, op=op)),
            ("freed", lambda c: c.freed.iallreduce(ones(2)), RuntimeError, FREED),
        ],
    ),
    *cases(
        "ibcast",
        [
            *x_cases(lambda c, x: c.jc.ibcast(x)),
            *rank_cases("root", lambda c, root: c.jc.ibcast(ones(2), root=root)),
            ("freed", lambda c: c.freed.ibcast(ones(2)), RuntimeError, FREED),
        ],
    ),
    *cases(
        "iallgather",
        [
            *x_cases(lambda c, x: c.jc.iallgather(x)),
            *tiled_cases(lambda c, tiled: c.jc.iallgather(ones(2), tiled=tiled)),
            (
                "x-0-d-tiled",
                lambda c: c.jc.iallgather(ones(), tiled=True),
                ValueError,
                r"^x must have a leading axis to concatenate along",
            ),
            ("freed", lambda c: c.freed.iallgather(ones(2)), RuntimeError, FREED),
        ],
    ),
    *cases(
        "ireduce",
        [
            *x_cases(lambda c, x: c.jc.ireduce(x)),
            *op_cases(lambda c, x, op: c.jc.ireduce(x, op=op)),
            *rank_cases("root", lambda c, root: c.jc.ireduce(ones(2), root=root)),
            ("freed", lambda c: c.freed.ireduce(ones(2)), RuntimeError, FREED),
        ],
    ),
    *cases(
        "iscan",
        [
            *x_cases(lambda c, x: c.jc.iscan(x)),
            *op_cases(lambda c, x, op: c.jc.iscan(x, op=op)),
            ("freed", lambda c: c.freed.iscan(ones(2)), RuntimeError, FREED),
        ],
    ),
    *cases(
        "igather",
        [
            *x_cases(lambda c, x: c.jc.igather(x)),
            *rank_cases("root", lambda c, root: c.jc.igather(ones(2), root=root)),
            *tiled_cases(lambda c, tiled: c.jc.igather(ones(2), tiled=tiled)),
            (
                "x-0-d-tiled",
                lambda c: c.jc.igather(ones(), tiled=True),
                ValueError,
                r"^x must have a leading axis to concatenate along",
            ),
            ("freed", lambda c: c.freed.igather(ones(2)), RuntimeError, FREED),
        ],
    ),
    *cases(
        "iscatter",
        [
            *x_cases(lambda c, x: c.jc.iscatter(x)),
            *rank_cases("root", lambda c, root: c.jc.iscatter(ones(c.size), root=root)),
            *tiled_cases(lambda c, tiled: c.jc.iscatter(ones(c.size), tiled=tiled)),
            (
                "x-leading-axis",
                lambda c: c.jc.iscatter(ones(c.size + 1)),
                ValueError,
                r"^x has leading axis \d+; with tiled=False it needs one entry per rank",
            ),
            (
                "x-0-d",
                lambda c: c.jc.iscatter(ones()),
                ValueError,
                r"^x must have a leading axis to split among the ranks",
            ),
            (
                "x-0-d-tiled",
                lambda c: c.jc.iscatter(ones(), tiled=True),
                ValueError,
                r"^x must have a leading axis to split among the ranks",
            ),
            ("freed", lambda c: c.freed.iscatter(ones(c.size)), RuntimeError, FREED),
        ],
    ),
    *cases(
        "ialltoall",
        [
            *x_cases(lambda c, x: c.jc.ialltoall(x)),
            *tiled_cases(lambda c, tiled: c.jc.ialltoall(ones(c.size), tiled=tiled)),
            (
                "x-leading-axis",
                lambda c: c.jc.ialltoall(ones(c.size + 1)),
                ValueError,
                r"^x has leading axis \d+; with tiled=False it needs one entry per rank",
            ),
            ("freed", lambda c: c.freed.ialltoall(ones(c.size)), RuntimeError, FREED),
        ],
    ),
    *cases(
        "ialltoallv",
        [
            *x_cases(lambda c, x: c.jc.ialltoallv(x, [1] * c.size, [1] * c.size)),
            # Traced counts take the form that exchanges them (cases below).
            *(
                case
                for case in counts_cases(
                    lambda c, x, counts: c.jc.ialltoallv(x, counts, [1] * c.size),
                    lambda c: c.size,
                    name="sendcounts",
                )
                if "traced" not in case[0]
            ),
            *(
                case
                for case in counts_cases(
                    lambda c, x, counts: c.jc.ialltoallv(x, [1] * c.size, counts),
                    lambda c: c.size,
                    name="recvcounts",
                )
                if "traced" not in case[0]
            ),
            (
                "learned-counts-overrun",
                lambda c: c.jc.ialltoallv(ones(c.size), [2] * c.size),
                ValueError,
                r"^sendcounts add up to \d+ rows, more than x's rows",
            ),
            (
                "learned-counts-negative",
                lambda c: c.jc.ialltoallv(ones(c.size), [-1] * c.size),
                ValueError,
                r"^sendcounts\[0\]=-1 is negative",
            ),
            (
                "learned-counts-float",
                lambda c: c.jc.ialltoallv(ones(c.size), jnp.ones(c.size)),
                TypeError,
                r"^sendcounts must be an integer array",
            ),
            (
                "learned-counts-length",
                lambda c: c.jc.ialltoallv(ones(c.size), [0] * (c.size + 1)),
                ValueError,
                r"^sendcounts has shape \(\d+,\); it needs one entry per rank",
            ),
            (
                "capacity-negative",
                lambda c: c.jc.ialltoallv(ones(c.size), [1] * c.size, capacity=-1),
                ValueError,
                r"^capacity=-1 is negative",
            ),
            (
                "capacity-str",
                lambda c: c.jc.ialltoallv(ones(c.size), [1] * c.size, capacity="1"),
                TypeError,
                r"^capacity must be",
            ),
            (
                "recvcounts-over-capacity",
                lambda c: c.jc.ialltoallv(ones(c.size), [1] * c.size, [2] * c.size, capacity=1),
                ValueError,
                r"^recvcounts add up to \d+ rows, more than the capacity",
            ),
            (
                "x-rows",
                lambda c: c.jc.ialltoallv(ones(c.size + 1), [1] * c.size, [1] * c.size),
                ValueError,
                r"^x has \d+ rows on rank \d+, but sendcounts adds up to \d+",
            ),
            (
                "x-0-d",
                lambda c: c.jc.ialltoallv(ones(), [1] * c.size, [1] * c.size),
                ValueError,
                r"^x must have a leading axis of sum\(sendcounts\) rows",
            ),
            (
                "freed",
                lambda c: c.freed.ialltoallv(ones(c.size), [1] * c.size, [1] * c.size),
                RuntimeError,
                FREED,
            ),
        ],
    ),
    *cases(
        "for_mesh",
        [
            (
                "mesh-str",
                lambda c: JaxComm.for_mesh("mesh", "x"),
                TypeError,
                r"^mesh must be a jax.sharding.Mesh \(with devices\), got str",
            ),
            (
                "axes-int",
                lambda c: JaxComm.for_mesh(jax.make_mesh((1,), ("x",)), 3),
                TypeError,
                r"^axes must be a sequence, got int",
            ),
            (
                "axis-not-of-the-mesh",
                lambda c: JaxComm.for_mesh(jax.make_mesh((1,), ("x",)), "y"),
                ValueError,
                r"^axes='y' must be one or more distinct axis names of the mesh",
            ),
            (
                "axes-repeated",
                lambda c: JaxComm.for_mesh(jax.make_mesh((1,), ("x",)), ("x", "x")),
                ValueError,
                r"must be one or more distinct axis names of the mesh",
            ),
            (
                "comm-str",
                lambda c: JaxComm.for_mesh(jax.make_mesh((1,), ("x",)), "x", comm="c"),
                TypeError,
                r"^comm must be an mpi4py Intracomm, got str",
            ),
        ],
    ),
    *cases(
        "from_graph",
        [
            (
                "sources-str",
                lambda c: JaxComm.from_graph("0", []),
                TypeError,
                r"^sources must be a sequence, got str",
            ),
            (
                "destinations-float",
                lambda c: JaxComm.from_graph([], [0.0]),
                TypeError,
                r"^destinations\[0\] must be an int, got float",
            ),
            (
                "sources-traced",
                lambda c: traced(lambda t: JaxComm.from_graph(t, []), jnp.zeros(1, int)),
                TypeError,
                r"^sources must be a static sequence",
            ),
            (
                "rank-out-of-range",
                lambda c: JaxComm.from_graph([], [c.size]),
                ValueError,
                r"do not describe one graph: on rank 0, rank \d+ is not a rank of comm",
            ),
            (
                "lists-disagree",
                lambda c: JaxComm.from_graph([0], []),
                ValueError,
                r"do not describe one graph: on rank 0, rank 0 lists rank 0 0 times",
            ),
            (
                "reorder-str",
                lambda c: JaxComm.from_graph([], [], reorder="no"),
                TypeError,
                r"^reorder must be a static bool, got str",
            ),
        ],
    ),
    *(
        case
        for name in ("sources", "destinations")
        for case in cases(
            name,
            [
                (
                    "no-topology",
                    lambda c, name=name: getattr(c.jc, name),
                    TypeError,
                    r"^this JaxComm has no neighbours",
                ),
                ("freed", lambda c, name=name: getattr(c.freed_grid, name), RuntimeError, FREED),
            ],
        )
    ),
    *cases(
        "neighbor_alltoall",
        [
            *x_cases(lambda c, x: c.grid.neighbor_alltoall(x)),
            (
                "x-leading-axis",
                lambda c: c.grid.neighbor_alltoall(ones(3, 2)),
                ValueError,
                r"^x has 3 blocks on rank \d+; it needs one per destination: 2",
            ),
            (
                "x-0-d",
                lambda c: c.grid.neighbor_alltoall(ones()),
                ValueError,
                r"^x must have a leading axis of one block per destination \(2\)",
            ),
            (
                "no-topology",
                lambda c: c.jc.neighbor_alltoall(ones(1)),
                TypeError,
                r"^this JaxComm has no neighbours",
            ),
            ("freed", lambda c: c.freed_grid.neighbor_alltoall(ones(2)), RuntimeError, FREED),
        ],
    ),
    *cases(
        "neighbor_allgather",
        [
            *x_cases(lambda c, x: c.grid.neighbor_allgather(x)),
            (
                "no-topology",
                lambda c: c.jc.neighbor_allgather(ones(1)),
                TypeError,
                r"^this JaxComm has no neighbours",
            ),
            ("freed", lambda c: c.freed_grid.neighbor_allgather(ones(2)), RuntimeError, FREED),
        ],
    ),
    *(
        case
        for name in ("neighbor_alltoallv", "ineighbor_alltoallv")
        for case in cases(
            name,
            [
                *x_cases(lambda c, x, name=name: getattr(c.grid, name)(x, [0, 0])),
                (
                    "sendcounts-length",
                    lambda c, name=name: getattr(c.grid, name)(ones(4), [1, 1, 1]),
                    ValueError,
                    r"^sendcounts has shape \(3,\); it needs one entry per neighbour, shape \(2,\)",
                ),
                (
                    "recvcounts-length",
                    lambda c, name=name: getattr(c.grid, name)(ones(4), [1, 1], [1]),
                    ValueError,
                    r"^recvcounts has shape \(1,\); it needs one entry per neighbour, shape \(2,\)",
                ),
                (
                    "sendcounts-float",
                    lambda c, name=name: getattr(c.grid, name)(ones(4), [1.0, 1.0]),
                    TypeError,
                    r"^sendcounts must be an integer array, got float",
                ),
                (
                    "sendcounts-negative",
                    lambda c, name=name: getattr(c.grid, name)(ones(4), [-1, 1]),
                    ValueError,
                    r"^sendcounts\[0\]=-1 is negative",
                ),
                (
                    "sendcounts-overrun-x",
                    lambda c, name=name: getattr(c.grid, name)(ones(4), [3, 2]),
                    ValueError,
                    r"^sendcounts add up to 5 rows, more than x's rows \(4\)",
                ),
                (
                    "recvcounts-over-capacity",
                    lambda c, name=name: getattr(c.grid, name)(ones(4), [1, 1], [2, 2], capacity=3),
                    ValueError,
                    r"^recvcounts add up to 4 rows, more than the capacity \(3\)",
                ),
                (
                    "capacity-negative",
                    lambda c, name=name: getattr(c.grid, name)(ones(4), [1, 1], capacity=-1),
                    ValueError,
                    r"^capacity=-1 is negative",
                ),
                (
                    "x-0-d",
                    lambda c, name=name: getattr(c.grid, name)(ones(), [0, 0]),
                    ValueError,
                    r"^x must have a leading axis of rows",
                ),
                (
                    "no-topology",
                    lambda c, name=name: getattr(c.jc, name)(ones(1), []),
                    TypeError,
                    r"^this JaxComm has no neighbours",
                ),
                (
                    "freed",
                    lambda c, name=name: getattr(c.freed_grid, name)(ones(2), [1, 1]),
                    RuntimeError,
                    FREED,
                ),
            ],
        )
    ),
    *(
        case
        for name in ("neighbor_allgatherv", "ineighbor_allgatherv")
        for case in cases(
            name,
            [
                *x_cases(lambda c, x, name=name: getattr(c.grid, name)(x)),
                (
                    "recvcounts-length",
                    lambda c, name=name: getattr(c.grid, name)(ones(4), [1]),
                    ValueError,
                    r"^recvcounts has shape \(1,\); it needs one entry per neighbour, shape \(2,\)",
                ),
                (
                    "recvcounts-float",
                    lambda c, name=name: getattr(c.grid, name)(ones(4), [1.0, 1.0]),
                    TypeError,
                    r"^recvcounts must be an integer array, got float",
                ),
                (
                    "recvcounts-negative",
                    lambda c, name=name: getattr(c.grid, name)(ones(4), [-1, 1]),
                    ValueError,
                    r"^recvcounts\[0\]=-1 is negative",
                ),
                (
                    "recvcounts-over-capacity",
                    lambda c, name=name: getattr(c.grid, name)(ones(4), [2, 2], capacity=3),
                    ValueError,
                    r"^recvcounts add up to 4 rows, more than the capacity \(3\)",
                ),
                (
                    "sendcount-float",
                    lambda c, name=name: getattr(c.grid, name)(ones(4), sendcount=1.0),
                    TypeError,
                    r"^sendcount must be an integer, got float",
                ),
                (
                    "sendcount-negative",
                    lambda c, name=name: getattr(c.grid, name)(ones(4), sendcount=-1),
                    ValueError,
                    r"^sendcount=-1 is negative",
                ),
                (
                    "sendcount-overrun-x",
                    lambda c, name=name: getattr(c.grid, name)(ones(4), sendcount=5),
                    ValueError,
                    r"^sendcount=5 is more than x's rows \(4\)",
                ),
                (
                    "capacity-negative",
                    lambda c, name=name: getattr(c.grid, name)(ones(4), capacity=-1),
                    ValueError,
                    r"^capacity=-1 is negative",
                ),
                (
                    "x-0-d",
                    lambda c, name=name: getattr(c.grid, name)(ones()),
                    ValueError,
                    r"^x must have a leading axis of rows",
                ),
                (
                    "no-topology",
                    lambda c, name=name: getattr(c.jc, name)(ones(1)),
                    TypeError,
                    r"^this JaxComm has no neighbours",
                ),
                (
                    "freed",
                    lambda c, name=name: getattr(c.freed_grid, name)(ones(2)),
                    RuntimeError,
                    FREED,
                ),
            ],
        )
    ),
    *(
        case
        for name in ("ineighbor_alltoall", "ineighbor_allgather")
        for case in cases(
            name,
            [
                *x_cases(lambda c, x, name=name: getattr(c.grid, name)(x)),
                (
                    "no-topology",
                    lambda c, name=name: getattr(c.jc, name)(ones(1)),
                    TypeError,
                    r"^this JaxComm has no neighbours",
                ),
                (
                    "freed",
                    lambda c, name=name: getattr(c.freed_grid, name)(ones(2)),
                    RuntimeError,
                    FREED,
                ),
            ],
        )
    ),
    *cases(
        "ineighbor_alltoall",
        [
            (
                "x-leading-axis",
                lambda c: c.grid.ineighbor_alltoall(ones(3, 2)),
                ValueError,
                r"^x has 3 blocks on rank \d+; it needs one per destination: 2",
            ),
        ],
    ),
    *cases(
        "wait",
        [
            (
                "request-array",
                lambda c: c.jc.wait(ones(2)),
                TypeError,
                r"^wait takes a jaxcomm Request, got ArrayImpl",
            ),
            (
                "request-None",
                lambda c: c.jc.wait(None),
                TypeError,
                r"^wait takes a jaxcomm Request, got NoneType",
            ),
        ],
    ),
    *cases(
        "waitall",
        [
            (
                "requests-str",
                lambda c: c.jc.waitall(["abc"]),
                TypeError,
                r"^waitall takes jaxcomm Requests, got str",
            ),
        ],
    ),
    *cases(
        "during",
        [
            (
                "requests-str",
                lambda c: c.jc.during(["abc"], lambda: None),
                TypeError,
                r"^during takes jaxcomm Requests, got str",
            ),
        ],
    ),
    *cases(
        "recv",
        [
            ("x-str", lambda c: c.jc.recv("abc", MPI.PROC_NULL), TypeError, NOT_AN_ARRAY),
            (
                "x-float8-template",
                lambda c: c.jc.recv(jax.ShapeDtypeStruct((2,), jnp.float8_e4m3fn), MPI.PROC_NULL),
                TypeError,
                r"^x has dtype float8_e4m3fn, which jaxcomm cannot send",
            ),
            *rank_cases(
                "source",
                lambda c, source: c.jc.recv(ones(2), source),
                special=("PROC_NULL", "ANY_SOURCE"),
            ),
            *tag_cases(
                "tag", lambda c, tag: c.jc.recv(ones(2), MPI.PROC_NULL, tag=tag), any_tag=True
            ),
            (
                "status-str",
                lambda c: c.jc.recv(ones(2), MPI.PROC_NULL, status="status"),
                TypeError,
                r"^status must be an MPI.Status or None, got str",
            ),
            (
                "status-Request",
                lambda c: c.jc.recv(ones(2), MPI.PROC_NULL, status=MPI.Request()),
                TypeError,
                r"^status must be an MPI.Status or None, got Request",
            ),
            (
                "return_status-str",
                lambda c: c.jc.recv(ones(2), MPI.PROC_NULL, return_status="yes"),
                TypeError,
                r"^return_status must be a static bool, got str",
            ),
            (
                "return_status-str-with-status",
                lambda c: c.jc.recv(
                    ones(2), MPI.PROC_NULL, status=MPI.Status(), return_status="yes"
                ),
                TypeError,
                r"^return_status must be a static bool, got str",
            ),
            (
                "return_status-traced",
                lambda c: traced(
                    lambda t: c.jc.recv(ones(2), MPI.PROC_NULL, return_status=t), True
                ),
                TypeError,
                r"^return_status must be a static bool, but got a traced value",
            ),
            ("freed", lambda c: c.freed.recv(ones(2), MPI.PROC_NULL), RuntimeError, FREED),
        ],
    ),
    *cases(
        "sendrecv",
        [
            (
                "sendbuf-str",
                lambda c: c.jc.sendrecv("abc", ones(2), MPI.PROC_NULL, MPI.PROC_NULL),
                TypeError,
                r"^sendbuf must be an array or a scalar, got str",
            ),
            (
                "recvbuf-str",
                lambda c: c.jc.sendrecv(ones(2), "abc", MPI.PROC_NULL, MPI.PROC_NULL),
                TypeError,
                r"^recvbuf must be an array or a scalar, got str",
            ),
            (
                "recvbuf-shape",
                lambda c: c.jc.sendrecv(ones(2), ones(3), MPI.PROC_NULL, MPI.PROC_NULL),
                ValueError,
                r"^sendbuf \(float32\[2\]\) and recvbuf \(float32\[3\]\) must have the "
                "same shape and dtype",
            ),
            (
                "recvbuf-dtype",
                lambda c: c.jc.sendrecv(
                    ones(2), ones(2, dtype=jnp.int32), MPI.PROC_NULL, MPI.PROC_NULL
                ),
                ValueError,
                r"^sendbuf \(float32\[2\]\) and recvbuf \(int32\[2\]\) must have the same",
            ),
            *rank_cases(
                "source",
                lambda c, source: c.jc.sendrecv(ones(2), ones(2), source, MPI.PROC_NULL),
                special=("PROC_NULL", "ANY_SOURCE"),
            ),
            *rank_cases(
                "dest",
                lambda c, dest: c.jc.sendrecv(ones(2), ones(2), MPI.PROC_NULL, dest),
                special=("PROC_NULL",),
            ),
            *tag_cases(
                "sendtag",
                lambda c, tag: c.jc.sendrecv(
                    ones(2), ones(2), MPI.PROC_NULL, MPI.PROC_NULL, sendtag=tag
                ),
            ),
            *tag_cases(
                "recvtag",
                lambda c, tag: c.jc.sendrecv(
                    ones(2), ones(2), MPI.PROC_NULL, MPI.PROC_NULL, recvtag=tag
                ),
                any_tag=True,
            ),
            (
                "status-str",
                lambda c: c.jc.sendrecv(
                    ones(2), ones(2), MPI.PROC_NULL, MPI.PROC_NULL, status="status"
                ),
                TypeError,
                r"^status must be an MPI.Status or None, got str",
            ),
            (
                "return_status-str",
                lambda c: c.jc.sendrecv(
                    ones(2), ones(2), MPI.PROC_NULL, MPI.PROC_NULL, return_status="yes"
                ),
                TypeError,
                r"^return_status must be a static bool, got str",
            ),
            (
                "return_status-str-with-status",
                lambda c: c.jc.sendrecv(
                    ones(2),
                    ones(2),
                    MPI.PROC_NULL,
                    MPI.PROC_NULL,
                    status=MPI.Status(),
                    return_status="yes",
                ),
                TypeError,
                r"^return_status must be a static bool, got str",
            ),
            (
                "return_status-traced",
                lambda c: traced(
                    lambda t: c.jc.sendrecv(
                        ones(2), ones(2), MPI.PROC_NULL, MPI.PROC_NULL, return_status=t
                    ),
                    True,
                ),
                TypeError,
                r"^return_status must be a static bool, but got a traced value",
            ),
            (
                "freed",
                lambda c: c.freed.sendrecv(ones(2), ones(2), MPI.PROC_NULL, MPI.PROC_NULL),
                RuntimeError,
                FREED,
            ),
        ],
    ),
    # Module functions.
    *cases(
        "set_debug",
        [
            (
                "enabled-str",
                lambda c: jaxcomm.set_debug("no"),
                TypeError,
                r"^enabled must be a bool, got str",
            ),
            (
                "enabled-int",
                lambda c: jaxcomm.set_debug(0),
                TypeError,
                r"^enabled must be a bool, got int",
            ),
        ],
    ),
    *cases(
        "set_cuda_aware",
        [
            (
                "enabled-str",
                lambda c: jaxcomm.set_cuda_aware("yes"),
                TypeError,
                r"^enabled must be True, False or None, got 'yes'",
            ),
            (
                "enabled-int",
                lambda c: jaxcomm.set_cuda_aware(1),
                TypeError,
                r"^enabled must be True, False or None, got 1",
            ),
        ],
    ),
    *cases(
        "bind_local_gpu",
        [
            (
                "comm-str",
                lambda c: jaxcomm.bind_local_gpu("world"),
                TypeError,
                r"^comm must be an mpi4py communicator, got str",
            ),
            (
                "comm-freed",
                lambda c: jaxcomm.bind_local_gpu(c.null),
                ValueError,
                r"^comm must be a live communicator, got MPI.COMM_NULL",
            ),
        ],
    ),
]

# Methods that work inside jax.jit: their cases also run inside a jitted
# function, where their arrays are tracers and eager calls' own caching of
# jitted functions is bypassed.
TRACEABLE = frozenset(
    [
        "allreduce",
        "reduce",
        "scan",
        "exscan",
        "reduce_scatter",
        "bcast",
        "barrier",
        "allgather",
        "gather",
        "scatter",
        "alltoall",
        "allgatherv",
        "gatherv",
        "scatterv",
        "alltoallv",
        "send",
        "recv",
        "sendrecv",
        "shift",
        "isend",
        "irecv",
        "iallreduce",
        "ireduce",
        "iscan",
        "ibcast",
        "iallgather",
        "igather",
        "iscatter",
        "ialltoall",
        "ialltoallv",
        "neighbor_alltoall",
        "neighbor_allgather",
        "neighbor_alltoallv",
        "ineighbor_alltoall",
        "ineighbor_allgather",
        "ineighbor_alltoallv",
        "neighbor_allgatherv",
        "ineighbor_allgatherv",
    ]
)


def _with_modes(cases):
    for case in cases:
        method = case.values[0]
        # A traced case makes its own jitted function; a status only works eagerly.
        jit_too = method in TRACEABLE and not case.id.endswith(("-traced", "-with-status"))
        for mode in ("eager", "jit") if jit_too else ("eager",):
            yield pytest.param(*case.values, mode, id=f"{case.id}-{mode}")


def test_cases_cover_every_public_method():
    public = {name for name in dir(JaxComm) if not name.startswith("_")}
    without_arguments = {
        *("rank", "size", "freed", "free", "sync", "dims", "periods", "coords", "mesh_axes")
    }
    covered = {case.values[0] for case in CASES}
    assert public - without_arguments <= covered
    assert {"JaxComm", "set_debug", "set_cuda_aware", "bind_local_gpu"} <= covered


@pytest.mark.mpi
@pytest.mark.parametrize("method,call,error,match,mode", list(_with_modes(CASES)))
def test_bad_argument_raises_before_any_mpi_call(comms, capfd, method, call, error, match, mode):
    jaxcomm.sync()
    capfd.readouterr()
    with mpi_debug():
        with pytest.raises(error, match=match):
            if mode == "jit":
                jax.jit(lambda: call(comms))()
            else:
                call(comms)
        jaxcomm.sync()
    assert " | MPI_" not in capfd.readouterr().err, f"{method} made an MPI call"
    # Every rank is still in step: nothing was left half-started.
    assert int(comms.jc.allreduce(1)) == comms.size
