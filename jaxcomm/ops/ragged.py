"""Exchanges whose counts are data: ``ragged_all_to_all`` and ``alltoallv`` with this rank's counts.

Both primitives take the operand, the output (whose buffer the result takes:
rows no peer writes keep their values) and the index arrays, traced or not:
``input_offsets``, ``send_sizes``, ``output_offsets``, ``recv_sizes``
stacked as one ``(4, size)`` array (the GPU platform layer stages at most
four buffers of a call on the host). The kernel (``gather.cc``) first exchanges one header per
peer with ``MPI_Alltoall`` (where each block lands or is read, its rows and
the checks' flags), then moves the rows with one ``MPI_Alltoallv``. Besides
the output, each returns what it learned from its peers: a ``(2, size)``
array of the offsets and rows of their blocks in this rank's buffer.

``ragged_all_to_all_p`` places each block where its sender says
(``output_offsets``, as ``jax.lax.ragged_all_to_all``); ``alltoallv_counts_p``
packs the received blocks in rank order, and checks ``recv_sizes`` only with
``check_sizes``. ``reverse`` runs the exchange backwards, which is each one's
transpose: blocks go from where they landed back to where they were read.
"""

from functools import partial

import jax
import jax.numpy as jnp
from jax.interpreters import ad

from .. import _compat
from ._base import comm_primitive, derivative_comm
from ._batching import batched_alike, placed


def _abstract(operand, output, indices, **_):
    return [
        jax.core.ShapedArray(output.shape, output.dtype),
        jax.core.ShapedArray((2, indices.shape[1]), indices.dtype),
    ]


# The result takes the output's buffer: where the output is dead afterwards
# the kernel writes the received rows in place, else XLA copies it first.
ragged_all_to_all_p = comm_primitive(
    "ragged_all_to_all",
    _abstract,
    "jaxcomm_ragged_all_to_all",
    ("handle", "reverse"),
    aliases={1: 0},
)
alltoallv_counts_p = comm_primitive(
    "alltoallv_counts",
    _abstract,
    "jaxcomm_alltoallv_counts",
    ("handle", "reverse", "check_sizes"),
    aliases={1: 0},
)


def ragged_all_to_all(operand, output, indices, *, handle):
    """Bind ``ragged_all_to_all_p`` forwards; ``indices`` are the four index arrays."""
    y, _ = ragged_all_to_all_p.bind(operand, output, jnp.stack(indices), handle=handle, reverse=0)
    return y


def alltoallv_counts(x, output, sendcounts, recvcounts, *, handle):
    """Bind ``alltoallv_counts_p``: rows of ``x`` in blocks of ``sendcounts``, packed into ``output``.

    ``recvcounts`` (or None: learned) are checked against what arrives.

    Returns:
        The output and the rows received from each rank.
    """
    indices, check = counts_indices(sendcounts, recvcounts)
    y, info = alltoallv_counts_p.bind(
        x,
        output,
        indices,
        handle=handle,
        reverse=0,
        check_sizes=int(check),
    )
    return y, info[1]


def counts_indices(sendcounts, recvcounts):
    """The index arrays of ``alltoallv_counts_p`` for this rank's counts, and whether it checks ``recvcounts``.

    Each block starts where the one before ends; ``recvcounts`` (None:
    learned, not checked) are the rows expected from each rank.
    """
    starts = jnp.cumsum(sendcounts) - sendcounts
    check = recvcounts is not None
    if not check:
        recvcounts = jnp.zeros_like(sendcounts)
    return jnp.stack([starts, sendcounts, jnp.zeros_like(sendcounts), recvcounts]), check


# vmap -----------------------------------------------------------------------------
#
# With index arrays shared by the batch, every row holds the whole batch (its
# axis goes behind the rows) and one exchange moves it. Index arrays that
# differ between batch members make one exchange per member.


def exchange_batch(prim, axis_data, args, dims, **params):
    """Batching rule of an exchange of (operand, output, index arrays) to (output, learned)."""
    if all(d is None for d in dims):
        return prim.bind(*args, **params), [None, None]
    size = axis_data.size
    operand, output, indices = args
    if dims[2] is None:
        operand = placed(operand, dims[0], 1, size)
        output = placed(output, dims[1], 1, size)
        y, info = prim.bind(operand, output, indices, **params)
        return [y, info], [1, None]
    args = [placed(a, d, 0, size) for a, d in zip(args, dims)]
    members = [prim.bind(*(a[b] for a in args), **params) for b in range(size)]
    return [jnp.stack([m[i] for m in members]) for i in range(2)], [0, 0]


# Differentiation -----------------------------------------------------------------
#
# Linear in (operand, output); the index arrays are not differentiated. The
# transpose of an exchange is the same exchange reversed, on the derivative
# communicator: the operand's cotangent takes the rows of the result's
# cotangent that the blocks landed on, and the output's cotangent is the
# result's with those rows zeroed (they were overwritten). Rules always
# communicate, whether or not a rank's operand is linear, so that every rank
# makes the same calls.


def exchange_jvp(prim, primals, tangents, *, handle, **params):
    """JVP of an exchange linear in (operand, output): the same exchange of the tangents."""
    operand, output, indices = primals
    y, info = prim.bind(*primals, handle=handle, **params)
    d_operand, d_output = (ad.instantiate_zeros(t) for t in tangents[:2])
    dy, _ = prim.bind(d_operand, d_output, indices, handle=derivative_comm(handle), **params)
    return [y, info], [dy, ad.Zero(jax.typeof(info).to_tangent_aval())]


def _zero_rows(ct, offsets, rows):
    """``ct`` with rows ``[offsets[p], offsets[p] + rows[p])`` zeroed, for every ``p``."""
    n = ct.shape[0]
    edges = jnp.zeros(n + 1, jnp.int32).at[offsets].add(1).at[offsets + rows].add(-1)
    covered = jnp.cumsum(edges[:n]) > 0
    return jnp.where(covered.reshape((n,) + (1,) * (ct.ndim - 1)), jnp.zeros_like(ct), ct)


def output_cotangent(ct, indices, info, reverse):
    """The cotangent of an exchange's output: the result's ``ct`` with the rows it wrote zeroed.

    ``info`` is what the reversed exchange, run on the same ``indices``, learned.
    """
    if reverse:
        # The reversed exchange wrote this rank's own blocks.
        return _zero_rows(ct, indices[0], indices[1])
    # The forward exchange wrote where the reversed one read.
    return _zero_rows(ct, info[0], info[1])


def _transpose(prim, cts, operand, output, indices, *, handle, reverse, **params):
    ct = batched_alike(ad.instantiate_zeros(cts[0]))
    aval = operand.aval if ad.is_undefined_primal(operand) else jax.core.get_aval(operand)
    zeros = batched_alike(jnp.zeros(aval.shape, aval.dtype))
    operand_t, info = prim.bind(
        ct, zeros, indices, handle=derivative_comm(handle), reverse=1 - reverse, **params
    )
    output_t = None
    if ad.is_undefined_primal(output):
        output_t = output_cotangent(ct, indices, info, reverse)
    if not ad.is_undefined_primal(operand):
        operand_t = None
    return [operand_t, output_t, None]


for _prim in (ragged_all_to_all_p, alltoallv_counts_p):
    _compat.fancy_primitive_batchers[_prim] = partial(exchange_batch, _prim)
    ad.primitive_jvps[_prim] = partial(exchange_jvp, _prim)
    ad.primitive_transposes[_prim] = partial(_transpose, _prim)
