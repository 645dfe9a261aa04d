"""Machinery shared by every jaxcomm primitive.

A jaxcomm primitive carries the ordered ``mpi_effect``: JAX then hands its
lowering a token, which the FFI call consumes and produces, so every MPI call
is data-dependent on the one before it in program order. Primitives always
have multiple results (possibly none), and take their MPI arguments as
integer parameters that become FFI attributes: ints, or tuples of ints (kept
hashable in the params) that become int64 array attributes.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, mlir
from mpi4py import MPI

from .. import _compat, _gpu, _runtime
from .._runtime import mpi_comm
from ._batching import batched_alike

# Reduction codes shared with kernels/reduce_ops.h (enum ReduceOp).
REDUCTION_OPS = (
    ("SUM", MPI.SUM),
    ("PROD", MPI.PROD),
    ("MIN", MPI.MIN),
    ("MAX", MPI.MAX),
    ("LAND", MPI.LAND),
    ("LOR", MPI.LOR),
    ("LXOR", MPI.LXOR),
    ("BAND", MPI.BAND),
    ("BOR", MPI.BOR),
    ("BXOR", MPI.BXOR),
)

SUM = [name for name, _ in REDUCTION_OPS].index("SUM")


def op_name(op):
    """The name (``"SUM"``, ``"MAX"``, ...) of the reduction code ``op``."""
    return REDUCTION_OPS[op][0]


_INTEGER = frozenset(
    np.dtype(t) for t in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
)
_FLOAT = frozenset(np.dtype(t) for t in ("float16", jax.numpy.bfloat16, "float32", "float64"))
_COMPLEX = frozenset(np.dtype(t) for t in ("complex64", "complex128"))
_BOOL = frozenset([np.dtype(bool)])

SUPPORTED_DTYPES = _INTEGER | _FLOAT | _COMPLEX | _BOOL

# The element types MPI defines each predefined reduction for (MPI 4.1,
# section 6.9.2); float16 and bfloat16 reduce through jaxcomm's own ops.
ALLOWED_DTYPES = {
    "SUM": _INTEGER | _FLOAT | _COMPLEX,
    "PROD": _INTEGER | _FLOAT | _COMPLEX,
    "MIN": _INTEGER | _FLOAT,
    "MAX": _INTEGER | _FLOAT,
    "LAND": _INTEGER | _BOOL,
    "LOR": _INTEGER | _BOOL,
    "LXOR": _INTEGER | _BOOL,
    "BAND": _INTEGER,
    "BOR": _INTEGER,
    "BXOR": _INTEGER,
}


# Every primitive's FFI target and the params it passes as attributes, by
# primitive name; a test compares them with the kernels' table (ops.def).
PRIMITIVES = {}


def comm_primitive(
    name, abstract_eval, target, attrs, *, in_place=False, aliases=None, root_only=None
):
    """Create the primitive ``<name>_p`` lowered to the FFI target ``target``.

    Args:
        name: the primitive's name.
        abstract_eval: maps input avals and params to the list of output avals.
        target: the FFI target name registered by the kernels module.
        attrs: names of the params passed to the kernel as int64 attributes
            (tuples as int64 arrays, read as ``Span<const int64_t>``).
        in_place: the single output, shaped like the single operand, takes the
            operand's buffer, and the kernel works in place there (the MPI
            call's in-place form). Where the operand is dead afterwards, as a
            loop's carry is, XLA then moves no data around the call; where it
            is still used (an argument of the jitted function, a value read
            later), XLA copies it first, so inputs are never modified.
        aliases: ``{operand: result}``, the operands (counted without the
            token) whose buffers results (likewise) take, where ``in_place``
            does not describe them.
        root_only: ``"output"`` or ``"input"`` for rooted ops whose last
            output (gather, igather's start) or single operand (scatter,
            iscatter's start) MPI writes or reads on the root only, and
            ``"wait"`` for the wait that takes that buffer again. Off root the
            kernel then gets an empty placeholder in its place
            (``_placeholder``), so that the call costs that rank memory of the
            size of what it sends or receives, not of the communicator's size.
            Off root, the op's documented zeros (``"output"``) are XLA's,
            made after the call only where the program uses them, and the
            operand (``"input"``) is not consumed, so XLA can drop the
            computation that made it.
    """
    PRIMITIVES[name] = (target, tuple(attrs))
    prim = Primitive(name)
    prim.multiple_results = True
    prim.def_impl(partial(_compat.apply_primitive, prim))
    _compat.def_effectful_abstract_eval(prim, partial(_typed, abstract_eval))
    if aliases is not None:
        # The token comes first on both sides of the FFI call.
        aliases = {operand + 1: result + 1 for operand, result in aliases.items()}
    lowering = partial(_ordered_ffi_lowering, target, attrs, in_place, aliases)
    if root_only is not None:
        lowering = partial(_ROOT_ONLY[root_only], lowering)
    _compat.register_uncached_lowering(prim, lowering, "cpu")
    _compat.register_uncached_lowering(prim, partial(_cuda_lowering, lowering), "cuda")
    _compat.communicating_primitives.add(prim)
    return prim


# Operand and result 0 are the ordering token; the array is 1 in both.
_ARRAY_IN_PLACE = {1: 1}


def _ordered_ffi_lowering(target, attrs, in_place, aliases, ctx, *args, **params):
    check_placement(ctx, params.get("handle"))
    token, token_ctx = _compat.ordered_token(ctx)
    if in_place and not _own_output_pays(ctx, args[0]):
        # Looked up here, not when the primitive is made: a test lowers
        # without the alias to check that the kernels do not depend on it.
        aliases = _ARRAY_IN_PLACE
    lowering = jax.ffi.ffi_lowering(target, has_side_effect=True, operand_output_aliases=aliases)
    token_out, *results = lowering(
        token_ctx,
        token,
        *args,
        site=_runtime.site_id(_compat.call_site(ctx)),
        **{k: _attribute(params[k]) for k in attrs},
    )
    _compat.set_ordered_token(ctx, token_out)
    return results


def _own_output_pays(ctx, operand):
    """Whether an in-place op's output gets a buffer of its own instead of ``operand``'s.

    Only for an argument of the jitted function that the caller keeps, which
    XLA would copy into an aliased output first, and only in a program lowered
    for the CPU alone. There that copy is a pass over the message in host
    memory that MPI's plain form does not need (`bcast`'s non-roots receive
    straight into the output) or makes itself. On a GPU the copy runs on the
    device, where it is cheap, and keeps the host staging in place: one pinned
    buffer instead of two, and no host copy inside MPI's plain form (measured
    on an H100, docs/gpu.md: a jitted `allreduce` of a kept argument took
    1.21x to 1.41x as long unaliased from 1 to 64 MiB, `scan` 1.07x to
    1.34x, `bcast` level).
    """
    return _platforms(ctx) == ("cpu",) and _compat.kept_argument(operand)


def _platforms(ctx):
    """The platforms ``ctx``'s module is lowered for."""
    return tuple(getattr(ctx.module_context, "platforms", ()) or ())


# One device per process --------------------------------------------------------
#
# One MPI call per process and op, in program order, is what keeps every
# rank's collectives matched. A program over several devices keeps that when
# each device belongs to a process of its own (jax.distributed, one device per
# process) and the program hands each of them its own block: the body of a
# shard_map that is manual over every mesh axis. Copies of the call on several
# devices of one process would break it (docs/multidevice.md).

# The "handle" param of each JaxComm made by JaxComm.for_mesh (and of its
# derivative communicator) -> the MeshAxes it communicates along.
_mesh_comms = {}


class MeshAxes:
    """The mesh axes a ``JaxComm.for_mesh`` communicator spans, and its mesh's layout.

    Attributes:
        axes: the axis names, in the order that numbers the ranks.
        shape: every mesh axis name -> its size.
        device_ids: the ids of the mesh's devices, in the mesh's layout
            (nested lists).
    """

    def __init__(self, axes, shape, device_ids):
        self.axes = tuple(axes)
        self.shape = dict(shape)
        self.device_ids = device_ids


def register_mesh_comm(handles, mesh_axes):
    """Note that the communicators ``handles`` span ``mesh_axes`` (a :class:`MeshAxes`)."""
    for handle in handles:
        _mesh_comms[handle] = mesh_axes


def unregister_mesh_comm(handles):
    """Forget what :func:`register_mesh_comm` noted for ``handles``."""
    for handle in handles:
        _mesh_comms.pop(handle, None)


def check_placement(ctx, handle):
    """Raise, on every rank alike (while lowering), for programs jaxcomm cannot run.

    Those are programs over several devices of one process, and programs over
    several processes' devices outside the body of a ``shard_map`` that is
    manual over every mesh axis. For a ``for_mesh`` communicator, the
    ``shard_map`` must also be over its mesh, manual over its axes.
    """
    module = ctx.module_context
    name = ctx.primitive.name
    devices = _compat.device_count(module.axis_context)
    if devices == 1:
        return
    if _compat.local_device_count(module) > 1:
        raise NotImplementedError(
            f"jaxcomm op {name!r} in a computation over {devices} devices: jaxcomm makes one "
            "MPI call per process, so a jitted, sharded, shard_map or pmap computation that "
            "calls it must have one device per process (docs/multidevice.md). Run one MPI "
            "process per device (mpiexec -n <devices>; on CPU, leave "
            "--xla_force_host_platform_device_count unset or pin the computation "
            "with jax.default_device), and combine the processes' results with jaxcomm."
        )
    placed = _compat.manual_mesh(module.axis_context)
    if placed is None:
        raise NotImplementedError(
            f"jaxcomm op {name!r} in a computation over {devices} devices (one per process) "
            "outside shard_map: there XLA would hand the op whole global arrays. Call it "
            "inside jax.shard_map, manual over every mesh axis, so that each process passes "
            "its own block (docs/shard-map.md)."
        )
    shape, manual = placed
    automatic = sorted(str(a) for a, n in shape.items() if n > 1 and a not in manual)
    if automatic:
        raise NotImplementedError(
            f"jaxcomm op {name!r} in a shard_map that leaves the mesh axes {automatic} "
            "automatic: XLA would run it on blocks it partitions itself. Make the shard_map "
            "manual over every mesh axis (leave axis_names unset)."
        )
    mesh_axes = _mesh_comms.get(handle)
    if mesh_axes is None:
        return
    device_ids = _compat.context_mesh_devices(module.axis_context)
    same = mesh_axes.shape == shape and device_ids in (None, mesh_axes.device_ids)
    if not same:
        raise ValueError(
            f"jaxcomm op {name!r} on a JaxComm made by JaxComm.for_mesh for the mesh axes "
            f"{mesh_axes.axes} of a mesh {mesh_axes.shape}, inside a shard_map over another "
            f"mesh ({shape}, or other devices): its ranks would not be the positions along "
            "the shard_map's axes. Make the JaxComm with for_mesh for the shard_map's mesh."
        )


def comm_axes(handle, manual):
    """The manual mesh axes the communicator ``handle`` spans, or ``None`` if unknown.

    A ``for_mesh`` communicator's axes; any other communicator spans every
    manual axis when it has as many ranks as they have positions (such as one
    over all processes, in a shard_map over all of them).
    """
    mesh_axes = _mesh_comms.get(handle)
    if mesh_axes is not None:
        return frozenset(mesh_axes.axes)
    if handle is not None and manual and size_of(handle) == int(np.prod(list(manual.values()))):
        return frozenset(manual)
    return None


def typed_outputs(outs, avals, handle, replicated):
    """``outs`` with the varying manual axes ``shard_map`` (``check_vma``) expects.

    A result the replicated-value convention makes one value (``replicated``)
    is the same on every rank of its communicator's axes: it varies over what
    its operands vary over, less those axes. Any other result may differ
    between those ranks. Outside shard_map, or with ``check_vma`` off, types
    carry no axes.
    """
    manual = _compat.context_manual_axes() if _compat.checking_vma() else {}
    like = next((a for a in avals if hasattr(a, "sharding")), None)
    if not manual or like is None:
        return outs
    varying = frozenset().union(*(_compat.varying(a) for a in avals))
    axes = comm_axes(handle, manual)
    if replicated and axes is not None:
        varying -= axes
    else:
        varying |= frozenset(manual) if axes is None else axes & frozenset(manual)
    return [_compat.with_varying(like, out, varying) for out in outs]


# The nonblocking starts whose wait returns a replicated result (iallreduce...):
# their waits are typed as the blocking collectives are.
replicated_starts = set()


def _typed(abstract_eval, *avals, **params):
    outs = abstract_eval(*avals, **params)
    replicated = params.get("replicated", False) or (
        params.get("start", ("",))[0] in replicated_starts
    )
    return typed_outputs(outs, avals, params.get("handle"), replicated)


def per_device_values():
    """Whether JAX takes values for per-device ones now: in a ``shard_map`` with ``check_vma`` off."""
    return bool(_compat.context_manual_axes()) and not _compat.checking_vma()


def replicated_operand(x, handle, replicated):
    """``x`` and the ``replicated`` param a replicated collective binds with.

    With ``replicated`` (a user's ``allreduce``, ``bcast``, ``allgather``...),
    the result is one value under jaxcomm's convention, typed inside a
    ``shard_map`` with ``check_vma`` on as :func:`vary_over_comm` says. Inside a
    ``shard_map`` with ``check_vma`` off, JAX takes every value for a
    per-device one: its collectives transpose exactly (``psum`` to ``psum``)
    and ``shard_map`` divides the cotangent of a replicated output by the
    number of devices, so a jaxcomm collective there transposes exactly too
    (``replicated=False``), and its gradients are JAX's.
    """
    if not replicated or per_device_values():
        return x, False
    return vary_over_comm(x, handle), True


def vary_over_comm(x, handle):
    """``x``, typed as varying over the manual axes of ``handle`` (shard_map's ``pvary``).

    A replicated collective of a value already the same on every rank of its
    communicator (``allreduce`` of an invariant value) then differentiates
    as JAX's collectives do: the cotangent of such an operand is the sum over
    those ranks, which ``pvary``'s transpose computes.
    """
    manual = _compat.context_manual_axes() if _compat.checking_vma() else {}
    axes = comm_axes(handle, manual) if manual else None
    if not axes:
        return x
    missing = tuple(a for a in manual if a in axes and a not in _compat.varying(jax.typeof(x)))
    return _compat.pvary(x, missing) if missing else x


def vary_like(ct, aval):
    """The cotangent ``ct`` typed as varying over what ``aval``, its primal's, varies over."""
    if type(ct) is ad.Zero:
        return ct
    missing = _compat.varying(aval) - _compat.varying(jax.typeof(ct))
    return _compat.pvary(ct, sorted(missing)) if missing else ct


def _placeholder(aval):
    """What stands in for a buffer MPI ignores: ``aval`` behind a leading axis of length 0.

    It holds nothing, and its dimensions still tell the kernel the shape of
    the buffer it stands for, so that every rank checks that shape alike.
    (XLA:CPU's compiler spends memory of the whole shape on a trailing axis
    of length 0, not on a leading one.)
    """
    return jax.core.ShapedArray((0, *aval.shape), aval.dtype)


def _off_root(params):
    return rank_of(params["handle"]) != params["root"]


def _zeros_after(ctx, aval):
    """The op's documented zeros off root, made after the call ``ctx`` lowered.

    They are XLA's, a broadcast it materialises only where the program uses
    them. On the CPU they are broadcast from the zero of ``jaxcomm_zero_after``,
    a custom call that takes the call's token, so that XLA orders them after
    the call. As a constant they were ordered neither before nor after it:
    in a loop whose next carry is these zeros, XLA then copied the carry for
    the call to read and copied the zeros into the next carry, two passes
    over the message per iteration on the ranks off root (docs/benchmarks.md,
    `gather` in a loop).
    """
    scalar = jax.core.ShapedArray((), aval.dtype)
    if _platforms(ctx) == ("cpu",):
        token = ctx.tokens_out.get(_compat.mpi_effect)
        zero_after = jax.ffi.ffi_lowering("jaxcomm_zero_after")
        (zero,) = zero_after(
            ctx.replace(avals_in=[_compat.abstract_token], avals_out=[scalar], tokens_out=None),
            token,
        )
    else:
        zero = mlir.ir_constant(np.zeros((), aval.dtype))
    broadcast = mlir.lower_fun(lambda z: [jnp.broadcast_to(z, aval.shape)], multiple_results=True)
    return broadcast(ctx.replace(avals_in=[scalar], avals_out=[aval], tokens_out=None), zero)


def _empty(aval):
    """The placeholder of ``aval`` as an operand."""
    placeholder = _placeholder(aval)
    return placeholder, mlir.ir_constant(np.zeros(placeholder.shape, placeholder.dtype))


def _output_on_root_only(lowering, ctx, x, **params):
    # The last result is the buffer MPI fills on root only (a nonblocking
    # start's first result is its request id).
    if not _off_root(params):
        return lowering(ctx, x, **params)
    *kept, aval = ctx.avals_out
    outs = _lower_replaced(lowering, ctx, [x], params, avals_out=[*kept, _placeholder(aval)])
    return [*outs[:-1], *_zeros_after(ctx, aval)]


def _input_on_root_only(lowering, ctx, x, **params):
    if not _off_root(params):
        return lowering(ctx, x, **params)
    placeholder, empty = _empty(ctx.avals_in[0])
    return _lower_replaced(lowering, ctx, [empty], params, avals_in=[placeholder])


def _wait_on_root_only(lowering, ctx, request_id, x, y, **params):
    # The wait of a nonblocking igather or iscatter takes again the buffer its
    # start held: off root that is the placeholder the start lowered with.
    name, started = params["start"]
    root = dict(started).get("root")
    if name not in ("igather", "iscatter") or rank_of(params["handle"]) == root:
        return lowering(ctx, request_id, x, y, **params)
    id_aval, x_aval, y_aval = ctx.avals_in
    if name == "iscatter":
        placeholder, empty = _empty(x_aval)
        args = [request_id, empty, y]
        return _lower_replaced(lowering, ctx, args, params, avals_in=[id_aval, placeholder, y_aval])
    placeholder, empty = _empty(y_aval)
    avals = {"avals_in": [id_aval, x_aval, placeholder], "avals_out": [placeholder]}
    _lower_replaced(lowering, ctx, [request_id, x, empty], params, **avals)
    return _zeros_after(ctx, ctx.avals_out[0])


def _lower_replaced(lowering, ctx, args, params, **avals):
    """``lowering`` with ``ctx``'s avals replaced; the token it makes is ``ctx``'s."""
    replaced = ctx.replace(**avals)
    results = lowering(replaced, *args, **params)
    ctx.set_tokens_out(replaced.tokens_out)
    return results


_ROOT_ONLY = {
    "output": _output_on_root_only,
    "input": _input_on_root_only,
    "wait": _wait_on_root_only,
}


def _cuda_lowering(lowering, ctx, *args, **params):
    if _runtime.load_cuda_kernels() is None:
        raise RuntimeError(
            f"jaxcomm op {ctx.primitive.name!r} on a GPU: {_gpu.NO_CUDA_KERNELS}. "
            "Or keep the arrays it communicates on the CPU (jax.device_put(x, "
            "jax.devices('cpu')[0])) and jaxcomm's CPU kernels move them."
        )
    return lowering(ctx, *args, **params)


def _attribute(value):
    return np.asarray(value, np.int64) if isinstance(value, tuple) else value


def same_as_input(aval, **_):
    """Abstract evaluation of ops whose single output matches their input."""
    return [jax.core.ShapedArray(aval.shape, aval.dtype)]


def no_output(*avals, **_):
    """Abstract evaluation of ops that only have an effect."""
    return []


# Differentiation -------------------------------------------------------------
#
# Rules always instantiate symbolic zeros and communicate: whether a tangent or
# cotangent is symbolically zero can differ between ranks, and a rank that
# skipped the MPI call would leave the others waiting. (_compat.py makes JAX
# call the rules on every rank in the first place.)
#
# Derivative traffic (tangents, cotangents, and the extra calls of MAX, MIN
# and PROD rules) travels on a second private communicator of each JaxComm,
# so that a derivative message can never match one of the program's own.

# The "handle" param of each JaxComm's communicator (from _runtime.register_comm)
# -> its derivative communicator's; derivative communicators map to
# themselves, so higher-order derivative traffic stays on them.
_derivative_comms = {}


def register_derivative_comm(handle, derivative):
    """Route the derivative traffic of communicator ``handle`` to ``derivative`` (handles)."""
    _derivative_comms[handle] = derivative
    _derivative_comms[derivative] = derivative


def unregister_derivative_comm(handle):
    """Forget ``handle``'s derivative communicator (before it is freed) and return its handle."""
    derivative = _derivative_comms.pop(handle)
    _derivative_comms.pop(derivative, None)
    return derivative


def derivative_comm(handle):
    """The communicator (handle) that derivative traffic of ``handle`` travels on."""
    return _derivative_comms.get(handle, handle)


def rank_of(handle):
    """This process's rank in the communicator of a primitive's ``handle`` param."""
    return mpi_comm(handle).Get_rank()


def size_of(handle):
    """The number of processes in the communicator of a primitive's ``handle`` param."""
    return mpi_comm(handle).Get_size()


def linear_jvp(prim, primals, tangents, *, handle, **params):
    """JVP of a primitive linear in its operands: the tangents take the same op."""
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    return (
        prim.bind(*primals, handle=handle, **params),
        prim.bind(*tangents, handle=derivative_comm(handle), **params),
    )


def _transpose_with(transposed, cts, x, *, handle, **params):
    ct = batched_alike(ad.instantiate_zeros(cts[0]))
    return [transposed(ct, x.aval, handle=derivative_comm(handle), **params)]


def def_linear(prim, transposed):
    """Register the rules of a one-operand primitive that is linear in its operand.

    Args:
        prim: the primitive.
        transposed: ``transposed(ct, aval, **params)`` maps the cotangent of
            the single output to the cotangent of the operand, whose abstract
            value is ``aval``; it runs on every rank and may communicate (on
            the derivative communicator it is passed as ``handle``).
    """
    ad.primitive_jvps[prim] = partial(linear_jvp, prim)
    def_transpose(prim, transposed)


def def_transpose(prim, transposed):
    """Register the transpose rule of :func:`def_linear` alone, for a primitive with its own JVP."""
    ad.primitive_transposes[prim] = partial(_transpose_with, transposed)


def not_differentiable(what):
    """The error for differentiating an op that has no derivative rule."""
    return NotImplementedError(f"jaxcomm cannot differentiate {what}")
