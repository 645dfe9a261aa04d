"""The one place that touches JAX internals (``jax._src``).

jaxcomm orders its MPI calls with a JAX ordered effect: JAX threads a token
through every primitive carrying it, in program order, through ``jit``,
control flow and successive calls. The effect machinery has no public API, so
it lives here, together with the other internal names jaxcomm needs.
"""

from jax._src import core as _core
from jax._src import dispatch as _dispatch
from jax._src import effects as _effects

abstract_token = _core.abstract_token
apply_primitive = _dispatch.apply_primitive


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


def device_count(axis_context):
    """The number of devices a program being lowered runs on, from its axis context."""
    mesh = getattr(axis_context, "mesh", None)
    if mesh is not None:
        return mesh.size
    axis_env = getattr(axis_context, "axis_env", None)
    if axis_env is not None:
        return axis_env.nreps
    return axis_context.num_devices
