"""The one place that touches JAX internals (``jax._src``).

jaxcomm orders its MPI calls with a JAX ordered effect: JAX threads a token
through every primitive carrying it, in program order, through ``jit``,
control flow and successive calls. The effect machinery has no public API, so
it lives here, together with the other internal names jaxcomm needs, and the
hook that makes every rank run the same differentiation rules
(:func:`_instantiate_tangents`).
"""

import weakref

import numpy as np
from jax import lax
from jax._src import core as _core
from jax._src import dispatch as _dispatch
from jax._src import effects as _effects
from jax._src import xla_bridge as _xla_bridge
from jax._src.interpreters import ad as _ad
from jax._src.interpreters import batching as _batching
from jax._src.interpreters import mlir as _mlir

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
