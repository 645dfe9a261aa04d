"""Eager calls of ``JaxComm``'s methods, through cached jitted functions.

An eager method call binds its primitive through JAX's Python dispatch,
about 40 us. Instead, each JaxComm keeps one jitted function per method and
static arguments, and an eager call goes through it: JAX's C++ dispatch then
keys its compiled programs on the arrays' shapes and dtypes, at the cost of a
plain jitted call. Arguments that cannot key such a cache (tracers, an
MPI.Status to fill, values JAX cannot pass) take the ordinary path, which
also raises jaxcomm's errors for invalid ones.
"""

from __future__ import annotations

import collections
import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from mpi4py import MPI

from . import _compat
from ._runtime import monitoring
from .ops._base import SUPPORTED_DTYPES

# Compiled programs each JaxComm keeps for eager calls. Every distinct set of
# static arguments (a tag, a root, counts) is a program of its own, about
# 1.4 MiB with XLA:CPU, so a program that sends with tag=step would otherwise
# grow without bound; the least recently used are dropped beyond this many.
EAGER_CACHE_SIZE = 256


def new_cache() -> collections.OrderedDict:
    """An empty cache of a communicator's eager programs, for :func:`eager_cached`."""
    return collections.OrderedDict()


# Types of concrete jax.Arrays met so far (jaxlib's ArrayImpl). Whether a value
# is a jax.Array and not a tracer depends on its type alone, and an exact type
# lookup costs far less than isinstance against jax.Array, which every eager
# call would otherwise pay for each of its arrays.
_ARRAY_TYPES: set[type] = set()


def _is_concrete_leaf(leaf: Any) -> bool:
    if type(leaf) in _ARRAY_TYPES:
        return True
    if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
        _ARRAY_TYPES.add(type(leaf))
        return True
    return isinstance(leaf, (int, float, complex)) or (
        # JAX cannot pass NumPy values of other dtypes, and its error would not name them.
        isinstance(leaf, (np.ndarray, np.generic)) and leaf.dtype in SUPPORTED_DTYPES
    )


def _is_concrete(x: Any) -> bool:
    """Whether ``x`` is a non-empty pytree of concrete arrays or scalars."""
    if type(x) in _ARRAY_TYPES:
        return True
    leaves = jax.tree_util.tree_leaves(x)
    return bool(leaves) and all(map(_is_concrete_leaf, leaves))


# Static arguments of these types are their own key. Tested first, by exact
# type: an isinstance test against jax.Array costs microseconds per value,
# which every eager call would pay for each of its keywords.
_PLAIN_STATIC = frozenset({int, float, complex, bool, str, type(None)})


def _static_key(value: Any) -> Any:
    """A hashable stand-in for a static argument; raises TypeError for one that has none."""
    if type(value) in _PLAIN_STATIC:
        return (type(value), value)
    if isinstance(value, MPI.Op):
        return ("MPI.Op", value.py2f())
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, *map(_static_key, value))
    if isinstance(value, (jax.Array, np.ndarray, MPI.Status)):
        raise TypeError("not a static argument")
    hash(value)
    # Typed, because 0 == 0.0 == False would share an entry (and skip a type check).
    return (type(value), value)


def _call_key(name, static, kwargs):
    """The cache key of a call's static arguments, or None if they cannot make one."""
    try:
        return (name, _static_key(static), _static_key(sorted(kwargs.items())))
    except TypeError:
        return None


def eager_cached(*, arrays: tuple[str, ...]) -> Callable:
    """Send eager calls of a method through a cached jitted function.

    The decorated ``method(self, *arrays, **static)`` takes its arrays
    (pytrees) as the leading positional parameters after ``self``, named in
    ``arrays``, and everything else as static values. Its instances keep the
    cache made by :func:`new_cache` in ``_eager``, or None once they cannot
    communicate (then every call goes to the method, which raises).

    Args:
        arrays: the names of the method's array parameters, in order.

    Raises:
        TypeError: when decorating, if ``arrays`` are not the method's leading
            parameters after ``self``.
    """

    def decorate(method):
        leading = tuple(inspect.signature(method).parameters)[1 : 1 + len(arrays)]
        if leading != tuple(arrays):
            raise TypeError(
                f"{method.__name__}'s leading parameters are {leading}, not the arrays {arrays}"
            )
        count = len(arrays)
        # The common eager call's (jc.allreduce(x)) key, made once.
        plain_key = _call_key(method.__name__, (), {})

        # One wrapper, not two: every layer of Python an eager call passes
        # through costs about as much as a check of its own.
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            if _compat.tracing():
                # Inside a trace, concrete arrays (constants, or none: barrier)
                # still make a call of the traced function; a jitted function
                # nested there would also hide the user's frames from the call
                # site the checker and the watchdog report.
                return method(self, *args, **kwargs)
            # An eager call works on this process's arrays, whatever mesh the
            # program set (jax.set_mesh) for its own computations.
            if _compat.in_mesh_context():
                with _compat.outside_mesh():
                    return eager(self, args, kwargs)
            return eager(self, args, kwargs)

        def eager(self, args, kwargs):
            cache = self._eager
            given = args[:count]
            if cache is None or not all(map(_is_concrete, given)):
                return method(self, *args, **kwargs)
            if len(args) == count and not kwargs:
                key = plain_key
            else:
                key = _call_key(method.__name__, args[count:], kwargs)
                if key is None:
                    return method(self, *args, **kwargs)
            if monitoring():
                # The checker, the watchdog and the recorder name each call's own site, which
                # the compiled function keeps from its first call.
                caller = sys._getframe(2)  # the user's, above call
                key = (key, caller.f_code.co_filename, caller.f_lineno)
            jitted = cache.get(key)
            if jitted is None:
                static = args[count:]
                jitted = jax.jit(
                    lambda *a, _static=static, _kwargs=kwargs: method(self, *a, *_static, **_kwargs)
                )
                cache[key] = jitted
                if len(cache) > EAGER_CACHE_SIZE:
                    cache.popitem(last=False)
            else:
                cache.move_to_end(key)
            return jitted(*given)

        return call

    return decorate
