"""What every route gives the measurement: :class:`Impl`, and :class:`JaxImpl` for JAX functions."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..operations import MODES, Op, fori

AGAIN = "again"  # the name's suffix of a route timed twice (Impl.again)


class Impl:
    """A way of doing the benchmarked ops: mpi4py, jaxcomm, or another library.

    Subclasses give :meth:`runner`; those whose ops are JAX functions derive
    from :class:`JaxImpl` and give only the function.

    Attributes:
        name: the column name.
        modes: the modes it can run.
        checked: whether its results are compared with the reference's
            (False for a reference that does no MPI).
    """

    name = ""
    modes: tuple[str, ...] = MODES
    checked = True

    def supports(self, op: Op, mode: str) -> bool:
        """Whether this implementation has ``op`` in ``mode``."""
        return mode in self.modes

    def runner(self, op: Op, mode: str, x: np.ndarray) -> Callable[[int], Any]:
        """A callable doing ``n`` ops on (a copy of) ``x`` and returning the last result.

        It returns once the work is complete (results ready, MPI calls done).
        In ``loop`` mode the result is the carry after ``n`` iterations; in the
        others, each op reads ``x`` and the result is the last op's.
        """
        raise NotImplementedError

    def to_numpy(self, out: Any) -> np.ndarray | None:
        """This rank's part of a result, as NumPy (None for no result)."""
        return None if out is None else np.asarray(out)

    def again(self) -> Impl:
        """The same route as a column of its own, ``"<name> again"``.

        It makes its own buffers and compilations, and takes its turns with
        the others, so its time over this route's is what the run itself
        varies by (``--again``).
        """
        twin = copy.copy(self)
        twin.name = f"{self.name} {AGAIN}"
        return twin


class JaxImpl(Impl):
    """An implementation whose ops are JAX-traceable functions of one array.

    Subclasses give :meth:`function`; this class runs it eagerly, jitted, or
    in a jitted ``fori_loop``, waiting for each call.
    """

    def function(self, op: Op) -> Callable[[jax.Array], Any]:
        """``x -> y`` doing ``op`` (``None`` output for barrier)."""
        raise NotImplementedError

    def wait(self, out: Any, op: Op, mode: str) -> None:
        """Block until a call's work is complete."""
        jax.block_until_ready(out)

    @functools.cache  # noqa: B019 (one instance per benchmark run, kept to the end anyway)
    def _callable(self, op: Op, mode: str) -> Callable[..., Any]:
        # One jitted function per op and mode, so that the check's call and
        # the timed calls share its compilations.
        fn = self.function(op)
        return {"eager": fn, "jit": jax.jit(fn), "loop": jax.jit(fori(fn))}[mode]

    def runner(self, op, mode, x):
        call = self._callable(op, mode)
        x = jnp.asarray(x)
        wait = functools.partial(self.wait, op=op, mode=mode)
        if mode == "loop":

            def run(n):
                out = call(x, n)
                wait(out)
                return out

            return run

        def run(n):
            out = None
            for _ in range(n):
                out = call(x)
                wait(out)
            return out

        return run
