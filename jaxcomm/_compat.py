"""The one place that touches JAX internals (``jax._src``).

jaxcomm orders its MPI calls with a JAX ordered effect: JAX threads a token
through every primitive carrying it, in program order, through ``jit``,
control flow and successive calls. The effect machinery has no public API, so
it lives here, together with the other internal names jaxcomm needs, and the
hook that makes every rank run the same differentiation rules
(:func:`_instantiate_tangents`).
"""

import contextvars
import inspect
import os
import weakref

import jax
import numpy as np
from jax import lax
from jax._src import core as _core
from jax._src import dispatch as _dispatch
from jax._src import effects as _effects
from jax._src import source_info_util as _source_info
from jax._src import xla_bridge as _xla_bridge
from jax._src.interpreters import ad as _ad
from jax._src.interpreters import batching as _batching
from jax._src.interpreters import mlir as _mlir
from jax._src.interpreters import pxla as _pxla

abstract_token = _core.abstract_token
apply_primitive = _dispatch.apply_primitive
fancy_primitive_batchers = _batching.fancy_primitive_batchers


class MPIEffect(_effects.Effect):
    """The effect of every jaxcomm primitive: one MPI call, in program order."""

    def __str__(self):
        return "jaxcomm.MPI"


mpi_effect = MPIEffect()

for _allowed in (
    _effects.ordered_effects,
    _effects.lowerable_effects,
    _effects.control_flow_allowed_effects,
    _effects.custom_derivatives_allowed_effects,
    _effects.remat_allowed_effects,
    # A send's tangent has no output; linearization must keep it anyway, so
    # that its transpose receives the cotangent its peer sends back.
    _effects.partial_eval_kept_effects,
    # JAX refuses ordered effects in programs for several devices with a
    # message that cannot name the way out; letting them through to the
    # lowering lets jaxcomm refuse them itself (see ``device_count``).
    _effects.shardable_ordered_effects,
):
    _allowed.add_type(MPIEffect)


def tracing() -> bool:
    """Whether JAX is tracing (a jaxcomm call now belongs to a traced function)."""
    return not _core.trace_state_clean()


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def call_site(ctx) -> str:
    """Where the user's code called the jaxcomm method an op being lowered comes from.

    The innermost frame of the op's traceback outside JAX, the standard
    library and jaxcomm, as ``"file:line (function)"``.
    """
    return _site(getattr(ctx, "traceback", None))


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
    return "an unknown call site"


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
    ctx.set_tokens_out(_mlir.TokenSet({mpi_effect: token}))


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


def backends_initialized():
    """Whether JAX has created its backends (after which its GPU set is fixed)."""
    return _xla_bridge.backends_are_initialized()


def device_count(axis_context):
    """The number of devices a program being lowered runs on, from its axis context."""
    mesh = getattr(axis_context, "mesh", None)
    if mesh is not None:
        return mesh.size
    axis_env = getattr(axis_context, "axis_env", None)
    if axis_env is not None:
        return axis_env.nreps
    return axis_context.num_devices


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


def _zero_tangent(trace, aval):
    """An exact zero of ``aval``'s tangent type, linear in a tangent ``trace`` has."""
    tangent_aval = aval.to_tangent_aval()
    with _core.set_current_trace(_tangent_trace(trace)):
        seed = _tangents.get(trace)
        if seed is None:
            return _ad.zeros_like_aval(tangent_aval)
        first = lax.slice(lax.reshape(seed, (seed.size,)), (0,), (min(seed.size, 1),))
        scalar = lax.reduce_sum(first, (0,))
        scalar = lax.select(True, lax.full_like(scalar, 0), scalar)
        scalar = lax.convert_element_type(scalar, tangent_aval.dtype)
        return lax.broadcast(scalar, tangent_aval.shape)


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


for _trace_type, _tracer_type in _AD_TRACES.items():
    _tracer_type.__init__ = _remembering(_tracer_type.__init__)
    _trace_type.process_primitive = _instantiating(_trace_type.process_primitive)


def _structured_residuals():
    # jax 0.12 passes structured residuals between a linearize rule and its
    # linear function; earlier versions do not.
    # (process_primitive is wrapped above; __init__ is not.)
    return "structured_residuals" in inspect.getsource(_ad.LinearizeTrace.__init__)


_STRUCTURED_RESIDUALS = _structured_residuals()


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

    _ad.primitive_linearizations[primitive] = linearization


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

_FAST_DISPATCH_JAX = ((0, 10), (0, 12))  # the jax versions whose internals this patches


def _jax_version():
    return tuple(int(part) for part in jax.__version__.split(".")[:2])


fast_dispatch_enabled = (
    os.environ.get("JAXCOMM_FAST_DISPATCH", "1") != "0"
    and _FAST_DISPATCH_JAX[0] <= _jax_version() <= _FAST_DISPATCH_JAX[1]
    and hasattr(_pxla, "_cached_lowering_to_hlo")
    and hasattr(_mlir, "jaxpr_subcomp")
    and hasattr(_dispatch, "RuntimeTokenSet")
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


_lowering_to_hlo = _pxla._cached_lowering_to_hlo


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


_jaxpr_subcomp = _mlir.jaxpr_subcomp


def _jaxpr_subcomp_with_token(ctx, jaxpr, name_stack, tokens, *args, **kwargs):
    if jaxpr is _token_inside.get() and mpi_effect not in tokens.effects():
        tokens = _mlir.TokenSet({**dict(tokens.items()), mpi_effect: _mlir.create_token()})
    return _jaxpr_subcomp(ctx, jaxpr, name_stack, tokens, *args, **kwargs)


# Set by _runtime: blocks until the fast device has run everything dispatched to it.
wait_for_fast_device = None

_get_token_input = _dispatch.RuntimeTokenSet.get_token_input
_set_token_result = _dispatch.RuntimeTokenSet.set_token_result


def _get_token_input_after_fast_device(self, effect, devices):
    if effect is mpi_effect and fast_device is not None:
        wait_for_fast_device()
    return _get_token_input(self, effect, devices)


def _set_token_result_when_done(self, effect, token):
    _set_token_result(self, effect, token)
    if effect is mpi_effect and fast_device is not None:
        try:
            token.block_until_ready()
        except Exception:  # noqa: BLE001  (the token's next user raises it)
            pass


if fast_dispatch_enabled:
    _pxla._cached_lowering_to_hlo = _cached_lowering_to_hlo
    _mlir.jaxpr_subcomp = _jaxpr_subcomp_with_token
    _dispatch.RuntimeTokenSet.get_token_input = _get_token_input_after_fast_device
    _dispatch.RuntimeTokenSet.set_token_result = _set_token_result_when_done


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
    return _lower_jaxpr(ctx, jaxpr, *args, **kwargs)


# Without it (a jax that lowers otherwise) the checks run only where Python
# sees the mistake (ops/nonblocking.py).
if _lower_jaxpr is not None:
    _mlir.jaxpr_subcomp = _checked_jaxpr_subcomp
