"""The one place that touches JAX internals (``jax._src``).

jaxcomm orders its MPI calls with a JAX ordered effect: JAX threads a token
through every primitive carrying it, in program order, through ``jit``,
control flow and successive calls. The effect machinery has no public API, so
it lives here, together with the other internal names jaxcomm needs, and the
hook that makes every rank run the same differentiation rules
(:func:`_instantiate_tangents`).

Versions: jaxcomm supports jax 0.6 and newer and is tested up to
``NEWEST_TESTED_JAX``. On a newer jax, importing jaxcomm still works when the
internals its ordering rests on (JAX's ordered effects and their tokens) are
there, and raises an ImportError naming the jax version when they are not:
MPI calls are never run unordered. Every other internal is probed, and what
cannot be applied is skipped with one ``JaxVersionWarning`` at import that
names it; fast dispatch, which relies on the runtime's order between
computations, is applied only to the tested versions.
"""

import contextlib
import contextvars
import functools
import inspect
import os
import warnings
import weakref

import jax
import numpy as np
from jax import lax

# The jax versions jaxcomm is tested with (CI: the newest in full, the oldest
# and 0.11 in lean legs). On a newer jax, what jaxcomm cannot apply
# safely is skipped with one warning (``_skipped``); what its ordering
# guarantee rests on is required, and its absence is an ImportError.
OLDEST_JAX = (0, 6)
NEWEST_TESTED_JAX = (0, 12)


def _jax_version():
    return tuple(int(part) for part in jax.__version__.split(".")[:2])


def _version_text(version):
    return ".".join(map(str, version))


JAX_VERSION = _jax_version()

if JAX_VERSION < OLDEST_JAX:
    raise ImportError(
        f"jaxcomm needs jax {_version_text(OLDEST_JAX)} or newer; this is jax {jax.__version__}. "
        f"Upgrade jax (pip install 'jax>={_version_text(OLDEST_JAX)}')."
    )

try:
    from jax._src import config as _jax_config
    from jax._src import core as _core
    from jax._src import dispatch as _dispatch
    from jax._src import effects as _effects
    from jax._src import source_info_util as _source_info
    from jax._src import xla_bridge as _xla_bridge
    from jax._src.interpreters import ad as _ad
    from jax._src.interpreters import batching as _batching
    from jax._src.interpreters import mlir as _mlir
    from jax._src.interpreters import pxla as _pxla
    from jax._src.lib import version as _jaxlib_version
    from jax._src.lib.mlir.dialects import hlo as _hlo

    abstract_token = _core.abstract_token
    _apply_primitive = _dispatch.apply_primitive
    fancy_primitive_batchers = _batching.fancy_primitive_batchers
    _Effect = _effects.Effect
    _ordered_effects = _effects.ordered_effects
    _lowerable_effects = _effects.lowerable_effects
    _control_flow_allowed_effects = _effects.control_flow_allowed_effects
    _TokenSet = _mlir.TokenSet
except (ImportError, AttributeError) as _missing:
    # Without JAX's ordered effects jaxcomm cannot order its MPI calls, and
    # running them unordered could pair different collectives across ranks.
    raise ImportError(
        f"jaxcomm orders MPI calls with JAX internals that jax {jax.__version__} does not "
        f"have ({_missing}). jaxcomm is tested with jax {_version_text(OLDEST_JAX)} to "
        f"{_version_text(NEWEST_TESTED_JAX)}: install a jax in that range, or a newer "
        "jaxcomm."
    ) from _missing

# What could not be applied on this jax (only ever on one newer than the
# newest tested, or with a part missing): named in one warning at import.
_skipped = []


class JaxVersionWarning(UserWarning):
    """jaxcomm runs on a jax newer than the newest it was tested with, with something skipped."""


class MPIEffect(_Effect):
    """The effect of every jaxcomm primitive: one MPI call, in program order."""

    def __str__(self):
        return "jaxcomm.MPI"


mpi_effect = MPIEffect()

for _allowed in (_ordered_effects, _lowerable_effects, _control_flow_allowed_effects):
    _allowed.add_type(MPIEffect)

for _name, _lost in (
    ("custom_derivatives_allowed_effects", "jaxcomm calls inside custom_jvp/custom_vjp functions"),
    ("remat_allowed_effects", "jaxcomm calls inside jax.checkpoint"),
    # A send's tangent has no output; linearization must keep it anyway, so
    # that its transpose receives the cotangent its peer sends back.
    ("partial_eval_kept_effects", "the derivatives of send (reverse mode)"),
    # JAX refuses ordered effects in programs for several devices with a
    # message that cannot name the way out; letting them through to the
    # lowering lets jaxcomm refuse them itself (see ``device_count``).
    ("shardable_ordered_effects", "jaxcomm's own error for computations over several devices"),
):
    _allowed = getattr(_effects, _name, None)
    if _allowed is None:
        _skipped.append(f"{_lost} (jax has no effects.{_name})")
    else:
        _allowed.add_type(MPIEffect)


def tracing() -> bool:
    """Whether JAX is tracing (a jaxcomm call now belongs to a traced function)."""
    return not _core.trace_state_clean()


def eager_tracer(x) -> bool:
    """Whether ``x`` is a tracer of an eager transformation (``jvp``, ``vjp``) over a known value."""
    return isinstance(x, jax.core.Tracer) and _core.is_concrete(x)


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def call_site(ctx) -> str:
    """Where the user's code called the jaxcomm method an op being lowered comes from.

    The innermost frame of the op's traceback outside JAX, the standard
    library and jaxcomm, as ``"file:line (function)"``.
    """
    if hasattr(ctx, "traceback"):
        site = _site(ctx.traceback)
        if site == _UNKNOWN_SITE:
            # jax 0.9 gives a rule only its equation's traceback, which ends
            # where the enclosing function was traced (a jitted function that
            # an eager call goes through, _eager.py); jax 0.10 and newer
            # append the traceback the enclosing jaxpr is lowered under, where
            # this finds nothing more.
            site = _site(_outer_traceback.get())
        return site
    # jax 0.6 has no ``ctx.traceback``: it lowers each equation inside a user
    # context that holds the equation's traceback.
    return current_site()


def current_site() -> str:
    """Where the user's code is calling into jaxcomm now (outside a trace too)."""
    return _site(_source_info.current().traceback)


def eqn_site(eqn) -> str:
    """Where the user's code called the jaxcomm method behind a jaxpr equation."""
    return _site(getattr(eqn.source_info, "traceback", None))


def is_var(atom) -> bool:
    """Whether a jaxpr equation's operand is a variable (not a literal)."""
    return isinstance(atom, _core.Var)


def tracer_is_live(tracer) -> bool:
    """Whether the trace ``tracer`` belongs to is still running."""
    trace = getattr(tracer, "_trace", None)
    return trace is None or trace.is_valid()


def _site(traceback):
    for frame in getattr(traceback, "frames", ()):
        name = frame.file_name
        if name.startswith(_PACKAGE_DIR) or not _source_info.is_user_filename(name):
            continue
        return f"{name}:{frame.line_num} ({frame.function_name})"
    return _UNKNOWN_SITE


_UNKNOWN_SITE = "an unknown call site"

# The ``outer_traceback`` of the jaxpr being lowered (``_checked_jaxpr_subcomp``).
_outer_traceback = contextvars.ContextVar("jaxcomm_outer_traceback", default=None)


def def_effectful_abstract_eval(prim, abstract_eval):
    """Give ``prim`` the abstract evaluation ``abstract_eval`` and jaxcomm's effect."""
    prim.def_effectful_abstract_eval(
        lambda *avals, **params: (abstract_eval(*avals, **params), {mpi_effect})
    )


def ordered_token(ctx):
    """The token of jaxcomm's effect handed to a lowering, and the context to lower with it.

    Returns:
        ``(token, token_ctx)``: ``token_ctx`` is ``ctx`` with a token added in
        front of its inputs and outputs.
    """
    token = ctx.tokens_in.get(mpi_effect)
    token_ctx = ctx.replace(
        avals_in=[abstract_token, *ctx.avals_in],
        avals_out=[abstract_token, *ctx.avals_out],
    )
    return token, token_ctx


def set_ordered_token(ctx, token):
    """Hand the token a lowering produced on to the next jaxcomm call."""
    if _TOKEN_THROUGH_AFTER_ALL:
        token = _hlo.after_all([token, token])
    ctx.set_tokens_out(_TokenSet({mpi_effect: token}))


# XLA:CPU of jaxlib 0.6 emits a dot that it lowers to LLVM IR (a small product
# or a matrix-vector one) only after reading the backend config of its
# computation's root as a JSON proto, and aborts the process when that fails.
# The root is a jaxcomm call whenever a computation returns exactly the token
# and results of one (a jitted ``jc.allreduce(A @ x)``), and a typed FFI call's
# attributes are not JSON. Taking the token through an ``after_all`` keeps
# every jaxcomm call off the root at no cost at run time; jaxlib 0.7 and newer
# no longer read the root, so they get the token as it is.
_TOKEN_THROUGH_AFTER_ALL = _jaxlib_version < (0, 7)


def register_uncached_lowering(prim, rule, platform):
    """Register ``rule`` as ``prim``'s lowering on ``platform``, lowered at every call.

    JAX versions with the ``cacheable`` switch (0.8 has it, 0.6 not) cache
    lowerings: they would lower equal calls from different lines once, and all
    would then report the first one's call site. Versions without it lower
    every call.
    """
    if _REGISTER_LOWERING_CACHEABLE:
        _mlir.register_lowering(prim, rule, platform=platform, cacheable=False)
    else:
        _mlir.register_lowering(prim, rule, platform=platform)


_REGISTER_LOWERING_CACHEABLE = "cacheable" in inspect.signature(_mlir.register_lowering).parameters


# Attributes JAX puts on an argument of the entry function that is donated:
# ``tf.aliasing_output`` where it found an output for it, ``jax.buffer_donor``
# otherwise.
_DONATION_ATTRIBUTES = ("tf.aliasing_output", "jax.buffer_donor")


def kept_argument(value):
    """Whether ``value`` is an argument of the jitted function that its caller keeps.

    That is, a block argument of the module's entry function (``main``)
    without a donation attribute. XLA cannot hand such a buffer to an output
    aliased to it: it copies the argument first. False wherever the answer is
    not sure (an argument of a loop body or of an inner function, or a jax
    whose MLIR bindings differ), which keeps the alias.
    """
    try:
        from jax._src.lib.mlir import ir

        if not isinstance(value, ir.BlockArgument):
            return False
        function = value.owner.owner
        attributes = function.attributes
        if "sym_name" not in attributes or ir.StringAttr(attributes["sym_name"]).value != "main":
            return False
        if "arg_attrs" not in attributes:
            return True
        argument = ir.DictAttr(ir.ArrayAttr(attributes["arg_attrs"])[value.arg_number])
        return not any(name in argument for name in _DONATION_ATTRIBUTES)
    except Exception:  # noqa: BLE001 (an unsure answer keeps today's alias)
        return False


def backends_initialized():
    """Whether JAX has created its backends (after which its GPU set is fixed)."""
    return _xla_bridge.backends_are_initialized()


def device_count(axis_context):
    """The number of devices a program being lowered runs on, from its axis context."""
    mesh = getattr(axis_context, "mesh", None)
    if mesh is not None:
        return mesh.size
    # Before axis_env: jax 0.6's ShardingContext (a jit over sharded arrays)
    # has both, and its axis_env counts one replica whatever the devices.
    num_devices = getattr(axis_context, "num_devices", None)
    if num_devices is not None:
        return num_devices
    return axis_context.axis_env.nreps


def local_device_count(module_context):
    """The number of devices this process has on the backend a program is lowered for."""
    try:
        return len(module_context.get_backend().local_devices())
    except (NotImplementedError, ValueError, AttributeError):  # several platforms, or none
        return jax.local_device_count()


def manual_mesh(axis_context):
    """``(axis sizes, manual axes)`` of the ``shard_map`` a program is lowered in, or ``None``.

    ``axis sizes`` maps every axis name of the mesh to its size; outside
    ``shard_map`` (a ``jit`` over sharded arrays, ``pmap``) there is none.
    """
    mesh = getattr(axis_context, "mesh", None)
    manual = getattr(axis_context, "manual_axes", None)
    if mesh is None or manual is None:
        return None
    return dict(mesh.shape), frozenset(manual)


def context_mesh_devices(axis_context):
    """The ids of the devices of the concrete mesh of a ``shard_map`` being lowered, or ``None``.

    In the mesh's own layout (nested lists); ``None`` for an abstract mesh.
    """
    mesh = getattr(axis_context, "mesh", None)
    if not isinstance(mesh, jax.sharding.Mesh):  # an AbstractMesh has no devices
        return None
    return np.vectorize(lambda d: d.id, otypes=[np.int64])(mesh.devices).tolist()


# The user's mesh context ------------------------------------------------------
#
# Inside ``jax.set_mesh(mesh)`` every ``jit`` call takes the mesh's devices as
# its own: one over this process's arrays (jaxcomm's fence in ``sync``, an
# eager call's jitted function) then fails against a mesh of several
# processes' devices, or compiles for all of them. jaxcomm's own computations
# belong to this process alone, so they run with the mesh context cleared.
# jax 0.7 and newer clear it with ``jax.set_mesh(None)``; jax 0.6 sets it
# with the context manager ``jax.sharding.use_mesh`` (its
# ``jax.sharding.set_mesh`` is a global setter), which takes an empty mesh.

_set_mesh = getattr(jax, "set_mesh", None)
_use_mesh = getattr(jax.sharding, "use_mesh", None)
_device_context = getattr(_jax_config, "device_context", None)


def _empty_mesh():
    return jax.sharding.Mesh(np.empty((), dtype=object), ())


def in_mesh_context() -> bool:
    """Whether a mesh context (``jax.set_mesh``) is in force on this thread now."""
    if _device_context is not None:
        # One config read (about 1 us; the public getter takes 3): every eager
        # call asks.
        mesh = _device_context.value
        return mesh is not None and not mesh.empty
    return not getattr(jax.sharding.get_abstract_mesh(), "empty", True)


def outside_mesh():
    """A context in which ``jit`` sees no mesh context (nothing to do when none is set)."""
    if tracing() or not in_mesh_context():
        # Inside a trace the mesh belongs to the traced program (shard_map's).
        return contextlib.nullcontext()
    if _set_mesh is not None:
        return _set_mesh(None)
    if _use_mesh is not None:
        return _use_mesh(_empty_mesh())
    return contextlib.nullcontext()


def eager_outside_mesh(function):
    """``function``, run outside any mesh context when it is called eagerly (see ``outside_mesh``)."""

    @functools.wraps(function)
    def call(*args, **kwargs):
        if in_mesh_context() and not tracing():
            with outside_mesh():
                return function(*args, **kwargs)
        return function(*args, **kwargs)

    return call


def apply_primitive(prim, *args, **params):
    """Run ``prim`` eagerly (JAX's ``apply_primitive``), on this process's arrays."""
    with outside_mesh():
        return _apply_primitive(prim, *args, **params)


# Varying manual axes (shard_map's check_vma) ------------------------------------
#
# Inside ``shard_map`` with ``check_vma`` on, every value's type says over
# which manual mesh axes it varies; JAX inserts ``pvary`` where values of
# different types meet, and transposes it to a ``psum``. So a jaxcomm result
# must say truthfully whether it is the same on every rank of its
# communicator's mesh axes: that is what makes its gradients JAX's.


def checking_vma() -> bool:
    """Whether values inside ``shard_map`` carry their varying manual axes now."""
    state = getattr(_jax_config, "_check_vma", None)
    return bool(state is not None and state.value)


def context_manual_axes():
    """The manual mesh axes (name -> size) of the ``shard_map`` being traced; empty outside."""
    mesh = jax.sharding.get_abstract_mesh()
    if getattr(mesh, "empty", True):
        return {}
    manual = getattr(mesh, "manual_axes", ())
    # Axes of size 1 vary nothing (JAX leaves them out of types).
    return {name: size for name, size in mesh.shape.items() if name in manual and size > 1}


def varying(aval) -> frozenset:
    """The manual mesh axes ``aval`` varies over (empty outside ``shard_map``)."""
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def pvary(x, axes):
    """``x`` typed as varying over the manual axes ``axes`` too (no data moves)."""
    return _core.pvary(x, tuple(axes))


def with_varying(like, aval, axes):
    """``aval`` typed as varying over ``axes``, with the mesh of the input aval ``like``."""
    if getattr(getattr(like.sharding, "mesh", None), "empty", True):
        return aval  # a value outside any mesh (a constant) types nothing
    if hasattr(like, "manual_axis_type"):
        extra = {"manual_axis_type": like.manual_axis_type.update(varying=frozenset(axes))}
    else:
        extra = {"vma": frozenset(axes)}
    return like.update(shape=aval.shape, dtype=aval.dtype, weak_type=False, **extra)


# Differentiation on every rank alike ------------------------------------------
#
# JAX skips a primitive's differentiation rule when all its tangents are
# symbolic zeros, and whether they are can differ between ranks (``y = x if
# rank == 0 else ones``): a rank that skipped a jaxcomm rule would skip the
# derivative messages its peers send. So whenever an AD trace processes a
# primitive that makes MPI calls (a jaxcomm primitive, or jit, scan, cond,
# while, checkpoint... around one) with only zero tangents, jaxcomm hands it
# explicit zero tangents instead, and JAX runs the rules on every rank.
#
# Those zeros are computed from a tangent the trace already has (an input's),
# as a linear function of it that is exactly zero. Plain constant zeros would
# not do in reverse mode: JAX evaluates computations that depend on no tangent
# input in the forward sweep, so the derivative call would run at a different
# place in the program than its peers' transposed calls.

_AD_TRACES = {_ad.JVPTrace: _ad.JVPTracer, _ad.LinearizeTrace: _ad.LinearizeTracer}

# One floating-point tangent per live AD trace: the first one it was handed.
_tangents = weakref.WeakKeyDictionary()

# jaxcomm primitives, registered by ops/_base.py.
communicating_primitives = set()


def _is_inexact(value):
    return np.issubdtype(_core.typeof(value).dtype, np.inexact)


def _remembering(init):
    def __init__(self, trace, primal, tangent):
        init(self, trace, primal, tangent)
        if type(tangent) is not _ad.Zero and trace not in _tangents and _is_inexact(tangent):
            _tangents[trace] = tangent

    return __init__


def _tangent_trace(trace):
    """The trace the tangents of ``trace``'s tracers belong to."""
    return trace.parent_trace if isinstance(trace, _ad.JVPTrace) else trace.tangent_trace


def _zeros_from(seed, aval):
    """Zeros of ``aval``, computed as an exactly zero linear function of ``seed``."""
    first = lax.slice(lax.reshape(seed, (seed.size,)), (0,), (min(seed.size, 1),))
    scalar = lax.reduce_sum(first, (0,))
    scalar = lax.select(True, lax.full_like(scalar, 0), scalar)
    scalar = lax.convert_element_type(scalar, aval.dtype)
    return lax.broadcast(scalar, aval.shape)


def _zero_tangent(trace, aval):
    """An exact zero of ``aval``'s tangent type, linear in a tangent ``trace`` has."""
    tangent_aval = aval.to_tangent_aval()
    with _core.set_current_trace(_tangent_trace(trace)):
        seed = _tangents.get(trace)
        if seed is None:
            return _ad.zeros_like_aval(tangent_aval)
        return _zeros_from(seed, tangent_aval)


def _carries_mpi(primitive, params):
    if primitive in communicating_primitives:
        return True
    for value in params.values():
        for item in value if isinstance(value, tuple) else (value,):
            effects = getattr(item, "effects", None)
            if effects and any(isinstance(e, MPIEffect) for e in effects):
                return True
    return False


def _instantiate_tangents(trace, tracers):
    """``tracers`` with explicit zero tangents where every tangent was a symbolic zero."""
    pairs = [trace.to_primal_tangent_pair(t) for t in tracers]
    if any(type(tangent) is not _ad.Zero for _, tangent in pairs):
        return tracers
    tracer_type = _AD_TRACES[type(trace)]
    return [
        tracer_type(trace, primal, _zero_tangent(trace, _core.typeof(primal)))
        if _is_inexact(primal)
        else tracer
        for tracer, (primal, _) in zip(tracers, pairs)
    ]


def _instantiating(process_primitive):
    def wrapper(self, primitive, tracers, params, /):
        if _carries_mpi(primitive, params):
            tracers = _instantiate_tangents(self, tracers)
        return process_primitive(self, primitive, tracers, params)

    return wrapper


def _ad_hook_applies():
    for trace_type, tracer_type in _AD_TRACES.items():
        if (
            not hasattr(trace_type, "process_primitive")
            or "tangent" not in inspect.signature(tracer_type.__init__).parameters
        ):
            return False
    return all(hasattr(_ad, name) for name in ("Zero", "zeros_like_aval")) and hasattr(
        _core, "set_current_trace"
    )


if _ad_hook_applies():
    for _trace_type, _tracer_type in _AD_TRACES.items():
        _tracer_type.__init__ = _remembering(_tracer_type.__init__)
        _trace_type.process_primitive = _instantiating(_trace_type.process_primitive)
else:
    _skipped.append(
        "derivatives on every rank alike: a rank whose operand does not depend on the "
        "differentiated input may skip the derivative messages its peers send (and hang)"
    )


# A transposed message's receive (a send's transpose receives the cotangent
# its peer sends back) has no cotangent of its own to start from: received
# into constant zeros, it would depend on nothing linear, and transposing the
# transposed program again (jax.linear_transpose twice) would evaluate it in
# the forward sweep, before the peer's matching send. So each backward pass
# keeps its first cotangent, and such a receive takes its template as an
# exact zero linear in it (:func:`transpose_zeros`), which keeps it in the
# linear part of the program, in its place.

_transpose_seed = contextvars.ContextVar("jaxcomm_transpose_seed", default=None)


def _seeding(backward_pass):
    def wrapper(jaxpr, transform_stack, consts, primals_in, cotangents_in, *args, **kwargs):
        seed = next(
            (
                ct
                for ct in cotangents_in
                if type(ct) is not _ad.Zero and hasattr(ct, "dtype") and _is_inexact(ct)
            ),
            None,
        )
        token = _transpose_seed.set(seed)
        try:
            return backward_pass(
                jaxpr, transform_stack, consts, primals_in, cotangents_in, *args, **kwargs
            )
        finally:
            _transpose_seed.reset(token)

    return wrapper


def transpose_zeros(aval):
    """Zeros of ``aval`` for a transpose rule to receive into, linear in the pass's cotangent."""
    seed = _transpose_seed.get()
    if seed is None or not np.issubdtype(aval.dtype, np.inexact):
        return lax.full(aval.shape, 0, aval.dtype)
    return _zeros_from(seed, aval)


# jax 0.8 and newer run every backward pass in ``backward_pass3``
# (``backward_pass`` calls it); jax 0.6 has only ``backward_pass``; jax 0.7
# has both, separate, and ``jax.linear_transpose`` runs ``backward_pass``.
_BACKWARD_PASSES = [name for name in ("backward_pass3", "backward_pass") if hasattr(_ad, name)]
if len(_BACKWARD_PASSES) == 2 and "backward_pass3" in _ad.backward_pass.__code__.co_names:
    _BACKWARD_PASSES.remove("backward_pass")
for _name in _BACKWARD_PASSES:
    setattr(_ad, _name, _seeding(getattr(_ad, _name)))


def _structured_residuals():
    # jax 0.12 passes structured residuals between a linearize rule and its
    # linear function; earlier versions do not.
    # (process_primitive is wrapped above; __init__ is not.)
    try:
        return "structured_residuals" in inspect.getsource(_ad.LinearizeTrace.__init__)
    except (OSError, TypeError):  # no source: read the signature instead
        return "structured_residuals" in str(inspect.signature(_ad.LinearizeTrace.__init__))


_STRUCTURED_RESIDUALS = _structured_residuals()

# jax 0.9 and newer tell a linearize rule whether it serves a VJP (its first
# argument); jax 0.6 to 0.8 call it with the tangents' nonzero flags first.
_LINEARIZATION_TAKES_IS_VJP = "is_vjp" in inspect.signature(_ad.LinearizeTrace.__init__).parameters


def def_linearization(primitive, rule):
    """Register ``rule`` as ``primitive``'s linearize rule (``jax.linearize``, ``vjp``).

    Args:
        primitive: the primitive.
        rule: ``rule(nonzeros, *primals, **params)`` binds the primitive on the
            primals and returns ``(outs, out_nonzeros, residuals, linear)``;
            ``linear(residuals, *tangents)`` returns the output tangents
            (symbolic zeros where ``out_nonzeros`` is false).
    """

    def linearization(is_vjp, nonzeros, *primals, **params):
        outs, out_nonzeros, residuals, linear = rule(nonzeros, *primals, **params)
        if _STRUCTURED_RESIDUALS:
            return (
                outs,
                out_nonzeros,
                residuals,
                None,
                (lambda residuals, _, *tangents: linear(residuals, *tangents)),
            )
        return outs, out_nonzeros, residuals, linear

    _ad.primitive_linearizations[primitive] = (
        linearization if _LINEARIZATION_TAKES_IS_VJP else functools.partial(linearization, False)
    )


# Runtime errors the program is given ------------------------------------------
#
# A kernel that fails on one of XLA's threads reaches the program, if at all,
# as the JaxRuntimeError JAX raises from the computation's results (read, or
# waited with block_until_ready). jaxcomm keeps each such failure for sync()
# and the exit hook, which must not raise it again once the program had it.
# JAX offers no hook for an error it hands out, so the exception type's
# __init__ shows every one created outside jaxcomm's own waits to
# ``runtime_error_seen`` (set by _runtime), which forgets the kept failure
# when it is that one.

# Set by _runtime: called with the text of each runtime error the program is given.
runtime_error_seen = None

_own_wait = contextvars.ContextVar("jaxcomm_own_wait", default=False)


@contextlib.contextmanager
def own_wait():
    """A block where the runtime errors JAX raises are jaxcomm's to handle, not the program's."""
    token = _own_wait.set(True)
    try:
        yield
    finally:
        _own_wait.reset(token)


def _noting(init):
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if runtime_error_seen is not None and not _own_wait.get():
            runtime_error_seen(str(self))

    return __init__


_JaxRuntimeError = getattr(jax.errors, "JaxRuntimeError", None)
try:
    _JaxRuntimeError.__init__ = _noting(_JaxRuntimeError.__init__)
except (AttributeError, TypeError):
    _skipped.append(
        "forgetting a failure the program caught from its results: sync() and the exit "
        "hook raise it again"
    )


# Fast dispatch -----------------------------------------------------------------
#
# An executable whose jaxpr has an ordered effect takes JAX's Python dispatch
# path, which threads a runtime token from one computation to the next: about
# 30x the cost of a plain jitted call. jaxcomm keeps its effect while tracing
# (JAX then threads the token through control flow, autodiff and vmap), but
# lowers a top-level computation with the token created inside it. The
# executable then has no effects at the dispatch level and takes JAX's C++
# fast path; the order between computations comes from the runtime, which
# runs the computations of one device one after another in dispatch order
# (PjRt's CPU client; one stream per GPU). tests/test_dispatch.py checks that
# on every supported jax.
#
# Computations on different devices have no such order. So the scheme applies
# to the backend jaxcomm first lowers for, when it has one local device ("the
# fast device"). Computations of any other backend (CPU arrays in a process
# that uses its GPU) keep runtime tokens, and are ordered with the fast
# device's by waiting for its work before each of them is dispatched, and for
# each of them to finish before the call returns. A backend with several
# devices keeps runtime tokens throughout: jaxcomm's lowering cannot tell
# which of them a computation will run on.

_FAST_DISPATCH_JAX = ((0, 10), NEWEST_TESTED_JAX)  # the jax versions whose internals this patches

_fast_dispatch_internals = (
    hasattr(_pxla, "_cached_lowering_to_hlo")
    and hasattr(_mlir, "jaxpr_subcomp")
    and hasattr(_mlir, "create_token")
    and hasattr(getattr(_dispatch, "RuntimeTokenSet", None), "get_token_input")
    and hasattr(getattr(_dispatch, "RuntimeTokenSet", None), "set_token_result")
)
# On a jax it was not tested with, jaxcomm keeps JAX's runtime tokens: the
# order between computations then does not rest on the runtime's behaviour.
fast_dispatch_enabled = (
    os.environ.get("JAXCOMM_FAST_DISPATCH", "1") != "0"
    and _FAST_DISPATCH_JAX[0] <= JAX_VERSION <= _FAST_DISPATCH_JAX[1]
    and _fast_dispatch_internals
)
if JAX_VERSION > NEWEST_TESTED_JAX or not _fast_dispatch_internals:
    _skipped.append(
        "fast dispatch: jitted calls keep JAX's runtime tokens (ordered, about 30x the "
        "dispatch cost)"
    )

# The device whose jaxcomm computations are dispatched without tokens; set by
# the first one lowered.
fast_device = None

# Test switch: fast dispatch on every device, which breaks ordering between
# devices (the negative control of tests/dispatch_ahead.py).
fast_dispatch_any_device = False

# Set while a computation is lowered with its token created inside: the
# jaxpr whose lowering gets the token.
_token_inside = contextvars.ContextVar("jaxcomm_token_inside", default=None)


# jax 0.12 lowers a ``Jaxpr`` that holds its constants; earlier versions a
# ``ClosedJaxpr``. In jax 0.11 ``ClosedJaxpr`` is already another name for
# ``Jaxpr`` (whose ``.jaxpr`` is itself): one kind of jaxpr, as in 0.12.
_ClosedJaxpr = getattr(_core, "ClosedJaxpr", ())
if _ClosedJaxpr is _core.Jaxpr:
    _ClosedJaxpr = ()


def _without_mpi_effect(jaxpr):
    """``jaxpr`` (a ``Jaxpr`` or ``ClosedJaxpr``) minus jaxcomm's effect at its top level."""
    if isinstance(jaxpr, _ClosedJaxpr):
        return jaxpr.replace(jaxpr=_without_mpi_effect(jaxpr.jaxpr))
    return jaxpr.replace(effects=frozenset(e for e in jaxpr.effects if e is not mpi_effect))


def _fast_dispatch_applies(backend):
    # The lowering is for a backend, not yet for one of its devices.
    global fast_device
    if fast_dispatch_any_device:
        return True
    devices = backend.local_devices()
    if len(devices) != 1:
        return False
    if fast_device is None:
        fast_device = devices[0]
    return devices[0] == fast_device


def runtime_token_effects(compiled):
    """Whether a ``jax.stages.Compiled`` takes runtime tokens (and JAX's Python dispatch)."""
    call = compiled._executable.unsafe_call
    return bool(call.ordered_effects) or call.has_unordered_effects


_lowering_to_hlo = getattr(_pxla, "_cached_lowering_to_hlo", None)


def _cached_lowering_to_hlo(jaxpr, module_name, backend, *args, **kwargs):
    if mpi_effect not in jaxpr.effects or not _fast_dispatch_applies(backend):
        return _lowering_to_hlo(jaxpr, module_name, backend, *args, **kwargs)
    stripped = _without_mpi_effect(jaxpr)
    inner = stripped.jaxpr if isinstance(stripped, _ClosedJaxpr) else stripped
    reset = _token_inside.set(inner)
    try:
        return _lowering_to_hlo(stripped, module_name, backend, *args, **kwargs)
    finally:
        _token_inside.reset(reset)


_jaxpr_subcomp = getattr(_mlir, "jaxpr_subcomp", None)


def _jaxpr_subcomp_with_token(ctx, jaxpr, name_stack, tokens, *args, **kwargs):
    if jaxpr is _token_inside.get() and mpi_effect not in tokens.effects():
        tokens = _mlir.TokenSet({**dict(tokens.items()), mpi_effect: _mlir.create_token()})
    return _jaxpr_subcomp(ctx, jaxpr, name_stack, tokens, *args, **kwargs)


# Set by _runtime: blocks until the fast device has run everything dispatched to it.
wait_for_fast_device = None

_RuntimeTokenSet = getattr(_dispatch, "RuntimeTokenSet", None)
_get_token_input = getattr(_RuntimeTokenSet, "get_token_input", None)
_set_token_result = getattr(_RuntimeTokenSet, "set_token_result", None)


def _drop_failed_token(tokens, effect):
    # A failed computation leaves its failure in the runtime token it
    # returns, which JAX hands to the next one: every later jaxcomm call would
    # fail with it. The failure was the program's (from the results) or is
    # kept for sync(); the failed computation has ended, so the next one may
    # start from a fresh token without losing the order.
    token = tokens.current_tokens.get(effect)
    buffer = getattr(token, "_buf", None)
    if buffer is None or not buffer.is_ready():
        return
    try:
        with own_wait():
            token.block_until_ready()
    except Exception:  # noqa: BLE001  (a failed token: dropped)
        del tokens.current_tokens[effect]


def effects_barrier():
    """``jax.effects_barrier()``, past a failed jaxcomm computation's runtime token.

    That failure was the program's, or is kept for ``sync()``: the barrier
    raises only for others.
    """
    with own_wait():
        try:
            jax.effects_barrier()
            return
        except Exception:  # noqa: BLE001  (raised again below unless it was jaxcomm's)
            if _RuntimeTokenSet is None:
                raise
            _drop_failed_token(_dispatch.runtime_tokens, mpi_effect)
        jax.effects_barrier()


def _get_token_input_after_fast_device(self, effect, devices):
    if effect is mpi_effect:
        if fast_device is not None:
            wait_for_fast_device()
        _drop_failed_token(self, effect)
    return _get_token_input(self, effect, devices)


def _set_token_result_when_done(self, effect, token):
    _set_token_result(self, effect, token)
    if effect is mpi_effect and fast_device is not None:
        try:
            with own_wait():
                token.block_until_ready()
        except Exception:  # noqa: BLE001  (dropped by its next user)
            pass


if fast_dispatch_enabled:
    _pxla._cached_lowering_to_hlo = _cached_lowering_to_hlo
    _mlir.jaxpr_subcomp = _jaxpr_subcomp_with_token
    _RuntimeTokenSet.set_token_result = _set_token_result_when_done
if _fast_dispatch_internals:
    _RuntimeTokenSet.get_token_input = _get_token_input_after_fast_device


# Checks on every jaxpr jaxcomm lowers ------------------------------------------
#
# Functions of a ``jax.core.Jaxpr``, called before it is lowered (a jitted
# function's, and each loop body's, branch's and nested function's): they
# raise for programs jaxcomm cannot run, such as a nonblocking request not
# waited in the function that started it (ops/nonblocking.py).

jaxpr_checks = []

_lower_jaxpr = getattr(_mlir, "jaxpr_subcomp", None)


def _checked_jaxpr_subcomp(ctx, jaxpr, *args, **kwargs):
    for check in jaxpr_checks:
        check(jaxpr)
    token = _outer_traceback.set(kwargs.get("outer_traceback"))
    try:
        return _lower_jaxpr(ctx, jaxpr, *args, **kwargs)
    finally:
        _outer_traceback.reset(token)


# Without it (a jax that lowers otherwise) the checks run only where Python
# sees the mistake (ops/nonblocking.py).
if _lower_jaxpr is not None:
    _mlir.jaxpr_subcomp = _checked_jaxpr_subcomp
else:
    _skipped.append("the compile-time check that every nonblocking request is waited")

if _skipped:
    warnings.warn(
        f"jaxcomm on jax {jax.__version__} (tested with {_version_text(OLDEST_JAX)} to "
        f"{_version_text(NEWEST_TESTED_JAX)}): MPI calls stay in program order, but these "
        f"parts are skipped: {'; '.join(_skipped)}.",
        JaxVersionWarning,
        stacklevel=2,
    )
