"""``JaxComm``: the communicator object users call MPI through.

Every method validates its arguments (``jaxcomm._arguments``), turns them
into plain parameters and delegates to a primitive in ``jaxcomm.ops``.
Eager calls go through cached jitted functions (``jaxcomm._eager``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from . import ops
from ._arguments import (
    ArrayLike,
    as_array,
    call_on_tree,
    check_own_rows,
    check_split_rows,
    check_status,
    held,
    index_arrays,
    intracomm,
    is_matrix,
    leading_axis,
    mesh_axis_name,
    per_rank,
    pytree_leaves,
    received,
    reduction_leaves,
    reduction_operand,
    rows_arrays,
    sequence,
    shape_dtype,
    stackable_leaves,
    static_bool,
    static_counts,
    static_int,
    static_rank,
    static_tag,
    template,
)
from ._eager import eager_cached, new_cache
from ._runtime import (
    before_mpi_from_python,
    check_thread_level,
    clone,
    register_comm,
    set_check_comm,
    sync,
    track_comm,
    unregister_comm,
    wait_for_dispatched,
)
from .ops import nonblocking
from .ops._base import (
    MeshAxes,
    derivative_comm,
    register_derivative_comm,
    register_mesh_comm,
    unregister_derivative_comm,
    unregister_mesh_comm,
)
from .ops.neighbor import register_topology, reverse_comm, unregister_topology
from .ops.nonblocking import Request


class JaxComm:
    """An MPI communicator for JAX arrays, usable eagerly and inside ``jax.jit``.

    ``JaxComm(comm)`` clones ``comm``, so jaxcomm's messages can never match
    receives posted by plain mpi4py code on the original communicator. Every
    method call is an MPI call made in program order on every rank, also from
    compiled code, loops and conditionals; there are no tokens to manage.

    A ``comm`` with a topology keeps it, for the neighbourhood collectives:
    a Cartesian grid, a distributed graph (with or without weights, which
    jaxcomm ignores) or an ``MPI_GRAPH`` graph (``comm.Create_graph``), whose
    neighbours are both its sources and its destinations, in the order of
    ``MPI_Graph_neighbors`` (MPI 4.1, section 8.6). Made collectively on
    every rank: for a distributed graph, its reverse too.

    Args:
        comm: any mpi4py ``Intracomm`` (``COMM_WORLD``, a split, a Cartesian
            or a graph communicator). Defaults to ``MPI.COMM_WORLD``.

    Raises:
        TypeError: if ``comm`` is not an mpi4py ``Intracomm``.
        ValueError: if ``comm`` is ``MPI.COMM_NULL`` (such as a freed one).
        RuntimeError: if MPI runs below ``MPI_THREAD_MULTIPLE``.

    Example:
        >>> from mpi4py import MPI
        >>> from jaxcomm import JaxComm
        >>> jc = JaxComm(MPI.COMM_WORLD)
        >>> total = jax.jit(jc.allreduce)(jnp.ones(3))
    """

    def __init__(self, comm: MPI.Intracomm | None = None) -> None:
        comm = intracomm(comm)
        check_thread_level()
        before_mpi_from_python()
        self._own(clone(comm))

    @classmethod
    def _adopt(cls, comm: MPI.Intracomm) -> JaxComm:
        """Wrap a communicator jaxcomm just created, without another clone."""
        jc = cls.__new__(cls)
        jc._own(comm)
        return jc

    def _own(self, comm: MPI.Intracomm) -> None:
        self._comm: MPI.Intracomm | None = comm
        self._eager = new_cache()
        # Derivative messages travel apart from the program's own (ops/_base.py).
        self._derivative = clone(comm)
        self._neighbors = _neighbor_lists(comm)
        # The transposes of neighbourhood exchanges on a graph run on its
        # reverse (ops/neighbor.py), made now, collectively, on every rank.
        self._reverse = None
        if self._neighbors is not None and comm.Get_topology() == MPI.DIST_GRAPH:
            sources, destinations = self._neighbors
            self._reverse = comm.Create_dist_graph_adjacent(destinations, sources, reorder=False)
        for owned in (self._comm, self._derivative, self._reverse):
            # Failures come back to jaxcomm's kernels, which raise them in Python.
            if owned is not None:
                owned.Set_errhandler(MPI.ERRORS_RETURN)
        self._handle = register_comm(self._comm)
        derivative = register_comm(self._derivative)
        register_derivative_comm(self._handle, derivative)
        if self._neighbors is not None:
            sources, destinations = self._neighbors
            # A Cartesian grid is its own reverse.
            reverse = derivative
            if self._reverse is not None:
                reverse = register_comm(self._reverse)
                register_derivative_comm(reverse, reverse)
                register_topology(reverse, destinations, sources, derivative)
            for handle in (self._handle, derivative):
                register_topology(handle, sources, destinations, reverse)
        self._rank = self._comm.Get_rank()
        self._size = self._comm.Get_size()
        # MPI only guarantees TAG_UB on MPI_COMM_WORLD (Open MPI leaves it unset
        # on split and Cartesian communicators); the bound is the same for all.
        tag_ub = self._comm.Get_attr(MPI.TAG_UB)
        self._tag_ub = tag_ub if tag_ub is not None else MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
        self._check: MPI.Intracomm | None = None
        self._mesh_axes = None
        track_comm(self)

    def _make_check_comm(self) -> None:
        """Create the mismatch checker's private communicator (collective), once."""
        if self._check is None:
            self._check = clone(self._comm)
            self._check.Set_errhandler(MPI.ERRORS_RETURN)
            # Derivative traffic runs in program order with the program's own,
            # so both are checked on the same communicator.
            for handle in self._handles():
                set_check_comm(handle, self._check)

    def _handles(self) -> list[int]:
        """The handles of every communicator this object owns, its own first."""
        handles = [self._handle, derivative_comm(self._handle)]
        if self._reverse is not None:
            handles.append(reverse_comm(self._handle))
        return handles

    # Communicator management -------------------------------------------------

    @property
    def comm(self) -> MPI.Intracomm:
        """The private mpi4py duplicate this object communicates on."""
        self._live()
        return self._comm

    @property
    def rank(self) -> int:
        """This process's rank in the communicator."""
        return self._rank

    @property
    def size(self) -> int:
        """The number of processes in the communicator."""
        return self._size

    @property
    def freed(self) -> bool:
        """Whether :meth:`free` has been called."""
        return self._comm is None

    def free(self) -> None:
        """Wait for pending jaxcomm work, then free the duplicate communicators.

        Collective (``MPI_Comm_free``): call it on every rank. Calling it twice
        is harmless. Methods called afterwards raise ``RuntimeError``, and so
        do compiled functions that captured this communicator, even if MPI
        hands its handle to a new communicator.
        """
        if self._comm is not None:
            wait_for_dispatched()
            handles = self._handles()
            unregister_mesh_comm(handles)
            for handle in handles:
                unregister_topology(handle)
                unregister_comm(handle)
            for handle in handles[::-1]:
                unregister_derivative_comm(handle)
            if self._check is not None:
                for handle in handles:
                    set_check_comm(handle, None)
                self._check.Free()
                self._check = None
            if self._reverse is not None:
                self._reverse.Free()
            self._derivative.Free()
            self._comm.Free()
            self._comm = None
            # Eager calls then go straight to the method, which raises.
            self._eager = None

    def split(self, color: int, key: int = 0) -> JaxComm | None:
        """Split into disjoint communicators, one per ``color``.

        Wraps ``MPI_Comm_split`` on this object's private communicator and
        waits for pending jaxcomm work first (a split is collective). Calls on
        the new communicator are ordered together with this one's, also in
        the same jitted function.

        Args:
            color: ranks passing the same non-negative color share a new
                communicator; ``MPI.UNDEFINED`` joins none.
            key: orders ranks within the new communicator (ties keep this
                communicator's order).

        Returns:
            A new ``JaxComm``, or ``None`` on ranks that passed ``MPI.UNDEFINED``.

        Raises:
            TypeError: if ``color`` or ``key`` is not a static int.
            ValueError: for a negative color other than ``MPI.UNDEFINED``.

        Example:
            >>> rows = jc.split(color=jc.rank // 2, key=jc.rank)
        """
        self._live()
        color = static_int(color, "color")
        key = static_int(key, "key")
        if color < 0 and color != MPI.UNDEFINED:
            raise ValueError(f"color={color} must be non-negative or MPI.UNDEFINED")
        wait_for_dispatched()
        comm = self._comm.Split(color, key)
        return None if comm == MPI.COMM_NULL else JaxComm._adopt(comm)

    @classmethod
    def for_mesh(
        cls,
        mesh: jax.sharding.Mesh,
        axes: str | Sequence[str],
        *,
        comm: MPI.Intracomm | None = None,
    ) -> JaxComm:
        """Create a ``JaxComm`` along mesh axes, for use inside ``shard_map`` over ``mesh``.

        For programs that run one process per device with ``jax.distributed``
        (docs/shard-map.md): the new communicator holds the processes whose
        devices differ only in their positions along ``axes``, and each one's
        rank is its device's position along them, as ``jax.lax.axis_index(axes)``
        numbers it (row-major over ``axes`` in the order given). So
        ``allreduce`` on it sums what ``jax.lax.psum(x, axes)`` sums,
        ``allgather`` stacks in ``jax.lax.all_gather``'s order, and ``sendrecv``
        moves what ``jax.lax.ppermute`` moves (which takes several axes in
        the mesh's order only: pass them in that order).
        Inside a ``shard_map`` with ``check_vma`` on (the default), results
        carry the same varying axes as JAX's collectives', and their gradients
        equal JAX's; with ``check_vma=False`` they transpose as JAX's
        collectives do there (an ``allreduce`` to an ``allreduce``), so
        gradients equal JAX's too.

        Processes are matched to mesh devices through ``jax.process_index()``,
        which needs not equal the MPI rank (an ``MPI_Allgather`` of it over
        ``comm`` finds every rank's device). Wraps ``MPI_Comm_split`` of
        ``comm``; collective: call it on every rank of ``comm``.

        Args:
            mesh: a ``jax.sharding.Mesh`` with exactly one device of each
                process of ``comm`` (``jax.distributed`` initialised).
            axes: an axis name of ``mesh``, or a sequence of them.
            comm: the communicator whose processes own the mesh's devices
                (default ``MPI.COMM_WORLD``).

        Returns:
            A ``JaxComm`` whose :attr:`mesh_axes` are ``axes``.

        Raises:
            TypeError: if ``mesh`` is not a ``Mesh``, ``axes`` not axis names or
                ``comm`` not an ``Intracomm``.
            ValueError: if ``axes`` are not distinct axes of ``mesh``, or the
                mesh does not have exactly one device of each process of
                ``comm`` (raised on every rank; only the last check needs
                the ``MPI_Allgather``).

        Example:
            >>> mesh = jax.make_mesh((jax.process_count(),), ("x",))
            >>> jx = JaxComm.for_mesh(mesh, "x")
            >>> f = jax.shard_map(lambda v: jx.allreduce(v), mesh=mesh,
            ...                   in_specs=P("x"), out_specs=P())
        """
        comm = intracomm(comm)
        check_thread_level()
        if not isinstance(mesh, jax.sharding.Mesh):
            raise TypeError(
                f"mesh must be a jax.sharding.Mesh (with devices), got {type(mesh).__name__}"
            )
        names = (axes,) if isinstance(axes, str) else tuple(sequence(axes, "axes"))
        if not names or len(set(names)) != len(names) or any(a not in mesh.shape for a in names):
            raise ValueError(
                f"axes={axes!r} must be one or more distinct axis names of the mesh, "
                f"whose axes are {tuple(mesh.axis_names)}"
            )
        processes = np.vectorize(lambda d: d.process_index, otypes=[np.int64])(mesh.devices)
        owners, counts = np.unique(processes, return_counts=True)
        if counts.max() > 1 or processes.size != comm.Get_size():
            raise ValueError(
                f"JaxComm.for_mesh needs a mesh with one device of each of the {comm.Get_size()} "
                f"processes of comm; this one has {processes.size} devices of {owners.size} "
                "process(es). Initialise jax.distributed (one device per process) and build "
                "the mesh from jax.devices(); several devices per process are not supported "
                "(docs/multidevice.md)."
            )
        before_mpi_from_python()
        wait_for_dispatched()
        ranks_processes = comm.allgather(jax.process_index())
        if sorted(ranks_processes) != sorted(owners.tolist()):
            raise ValueError(
                "JaxComm.for_mesh: the processes of comm (jax.process_index() "
                f"{sorted(ranks_processes)}) are not those of the mesh's devices "
                f"({sorted(owners.tolist())}). Pass the communicator of the processes that "
                "own the mesh (comm=...), and build the mesh from jax.devices()."
            )
        position = np.argwhere(processes == jax.process_index())[0]
        coordinates = dict(zip(mesh.axis_names, position.tolist()))
        others = [a for a in mesh.axis_names if a not in names]
        color = _row_major([coordinates[a] for a in others], [mesh.shape[a] for a in others])
        key = _row_major([coordinates[a] for a in names], [mesh.shape[a] for a in names])
        jc = cls._adopt(comm.Split(color, key))
        ids = np.vectorize(lambda d: d.id, otypes=[np.int64])(mesh.devices).tolist()
        jc._mesh_axes = MeshAxes(names, mesh.shape, ids)
        register_mesh_comm(jc._handles(), jc._mesh_axes)
        return jc

    @property
    def mesh_axes(self) -> tuple[str, ...] | None:
        """The mesh axes this communicator spans (:meth:`for_mesh`), or ``None``."""
        return None if self._mesh_axes is None else self._mesh_axes.axes

    @classmethod
    def from_cart(
        cls,
        dims: Sequence[int],
        periods: Sequence[bool] | None = None,
        *,
        comm: MPI.Intracomm | None = None,
        reorder: bool = False,
    ) -> JaxComm:
        """Create a ``JaxComm`` over a Cartesian process grid.

        Wraps ``MPI_Cart_create`` (and ``MPI_Dims_create`` for zero entries of
        ``dims``). Use :meth:`cart_shift` for neighbour ranks and :meth:`shift`
        to move data between neighbours, as in a halo exchange.

        Args:
            dims: processes along each axis; a 0 lets MPI choose. The product
                must equal the size of ``comm``.
            periods: whether each axis wraps around (default: none does).
            comm: the communicator to arrange (default ``MPI.COMM_WORLD``).
            reorder: let MPI renumber ranks to fit the hardware.

        Returns:
            A ``JaxComm`` whose ``comm`` is an ``MPI.Cartcomm``.

        Raises:
            TypeError: if ``comm`` is not an ``Intracomm``, ``dims`` is not a
                sequence of ints, ``periods`` not a sequence of bools, or
                ``reorder`` not a bool.
            ValueError: if ``comm`` is ``MPI.COMM_NULL``, the grid does not
                cover ``comm`` exactly or ``periods`` has the wrong length.

        Example:
            >>> grid = JaxComm.from_cart([0, 0], periods=[True, True])
            >>> up, down = grid.cart_shift(0)
        """
        comm = intracomm(comm)
        check_thread_level()
        dims = [static_int(d, f"dims[{i}]") for i, d in enumerate(sequence(dims, "dims"))]
        if not dims or any(d < 0 for d in dims):
            raise ValueError(f"dims={dims} must be a non-empty list of non-negative ints")
        size = comm.Get_size()
        fixed = int(np.prod([d for d in dims if d > 0]))
        if 0 in dims and size % fixed == 0:
            dims = MPI.Compute_dims(size, dims)
        if int(np.prod(dims)) != size:
            raise ValueError(
                f"dims={dims} is a grid that does not hold the {size} processes of comm"
            )
        if periods is None:
            periods = [False] * len(dims)
        else:
            periods = [
                static_bool(p, f"periods[{i}]") for i, p in enumerate(sequence(periods, "periods"))
            ]
        if len(periods) != len(dims):
            raise ValueError(f"periods has {len(periods)} entries for {len(dims)} dims")
        reorder = static_bool(reorder, "reorder")
        before_mpi_from_python()
        return cls._adopt(comm.Create_cart(dims, periods=periods, reorder=reorder))

    @classmethod
    def from_graph(
        cls,
        sources: Sequence[int],
        destinations: Sequence[int],
        *,
        comm: MPI.Intracomm | None = None,
        reorder: bool = False,
    ) -> JaxComm:
        """Create a ``JaxComm`` over a distributed graph of neighbours.

        Wraps ``MPI_Dist_graph_create_adjacent``: this rank receives from
        ``sources`` and sends to ``destinations``, in that order, in the
        neighbourhood collectives (:meth:`neighbor_alltoall`,
        :meth:`neighbor_allgather`, :meth:`neighbor_alltoallv`). Either list
        may be empty, name this rank (a self-loop) or name a rank more than
        once (the k-th edge from a rank to another matches the k-th time the
        receiver lists the sender). Every edge must be in both lists: the
        sender's ``destinations`` and the receiver's ``sources``; this is
        checked (one ``MPI_Alltoall`` of edge counts) and every rank raises
        if it is not. Collective: also creates the reverse graph, on which
        the transposes of neighbourhood exchanges run.

        Wrapping a communicator that already has a topology with
        ``JaxComm(comm)`` keeps it too: a distributed graph, a Cartesian grid
        or an ``MPI_GRAPH`` graph (``comm.Create_graph``), whose neighbours
        are both the sources and the destinations. MPI defines neighbourhood
        collectives on an ``MPI_GRAPH`` only where every two ranks list each
        other equally often; on one that is not symmetric they raise
        ``ValueError`` on every rank.

        Args:
            sources: ranks of ``comm`` this rank receives from.
            destinations: ranks of ``comm`` this rank sends to.
            comm: the communicator to arrange (default ``MPI.COMM_WORLD``).
            reorder: let MPI renumber ranks to fit the hardware.

        Returns:
            A ``JaxComm`` whose ``comm`` is an ``MPI.Distgraphcomm``.

        Raises:
            TypeError: if ``comm`` is not an ``Intracomm``, ``sources`` or
                ``destinations`` is not a sequence of ints, or ``reorder`` not
                a bool.
            ValueError: on every rank, if a rank is out of range or the
                lists of two ranks disagree about the edges between them.

        Example:
            A ring, each rank receiving from the rank before and sending to
            the one after it:

            >>> ring = JaxComm.from_graph([(jc.rank - 1) % jc.size], [(jc.rank + 1) % jc.size])
            >>> ring.neighbor_alltoall(jnp.full((1, 3), ring.rank))  # the rank before's row
        """
        comm = intracomm(comm)
        check_thread_level()
        sources = [
            static_int(r, f"sources[{i}]") for i, r in enumerate(sequence(sources, "sources"))
        ]
        destinations = [
            static_int(r, f"destinations[{i}]")
            for i, r in enumerate(sequence(destinations, "destinations"))
        ]
        reorder = static_bool(reorder, "reorder")
        before_mpi_from_python()
        _check_graph(comm, sources, destinations)
        return cls._adopt(comm.Create_dist_graph_adjacent(sources, destinations, reorder=reorder))

    def _topology(self) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
        handle = self._live()
        if self._neighbors is None:
            if self._comm.Get_topology() == MPI.GRAPH:
                raise ValueError(
                    "MPI defines neighbourhood collectives on an MPI_GRAPH communicator "
                    "only where every two ranks list each other equally often (MPI 4.1, "
                    f"8.6): {_asymmetric_graph(self._comm)}"
                )
            raise TypeError(
                "this JaxComm has no neighbours: create it with from_graph or from_cart, "
                "or wrap a communicator with a graph or Cartesian topology"
            )
        sources, destinations = self._neighbors
        return handle, tuple(sources), tuple(destinations)

    @property
    def sources(self) -> tuple[int, ...]:
        """The ranks neighbourhood collectives receive from, in order (``MPI.PROC_NULL`` off a grid's edge)."""
        return self._topology()[1]

    @property
    def destinations(self) -> tuple[int, ...]:
        """The ranks neighbourhood collectives send to, in order (``MPI.PROC_NULL`` off a grid's edge)."""
        return self._topology()[2]

    def _cart(self) -> MPI.Cartcomm:
        self._live()
        if not isinstance(self._comm, MPI.Cartcomm):
            raise TypeError("this JaxComm has no Cartesian topology; create it with from_cart")
        return self._comm

    @property
    def dims(self) -> tuple[int, ...]:
        """Processes along each axis of the Cartesian grid."""
        return tuple(self._cart().dims)

    @property
    def periods(self) -> tuple[bool, ...]:
        """Whether each axis of the Cartesian grid wraps around."""
        return tuple(bool(p) for p in self._cart().periods)

    @property
    def coords(self) -> tuple[int, ...]:
        """This rank's coordinates in the Cartesian grid."""
        return tuple(self._cart().coords)

    def cart_shift(self, direction: int, disp: int = 1) -> tuple[int, int]:
        """Ranks ``disp`` steps behind and ahead of this one along ``direction``.

        Wraps ``MPI_Cart_shift``. Off the edge of a non-periodic axis the rank
        is ``MPI.PROC_NULL``.

        Args:
            direction: the grid axis.
            disp: the number of steps.

        Returns:
            ``(source, dest)``: the rank at ``coords - disp`` and the rank at
            ``coords + disp`` along ``direction``.

        Raises:
            TypeError: if the communicator is not Cartesian, or ``direction``
                or ``disp`` is not a static int.
            ValueError: if ``direction`` is not an axis of the grid.
        """
        cart = self._cart()
        direction = static_int(direction, "direction")
        if not 0 <= direction < cart.ndim:
            raise ValueError(f"direction={direction} is not an axis of a {cart.ndim}-d grid")
        return cart.Shift(direction, static_int(disp, "disp"))

    @eager_cached(arrays=("x",))
    def shift(self, x: ArrayLike, direction: int, disp: int = 1, tag: int = 0) -> jax.Array:
        """Send ``x`` ``disp`` steps along a grid axis; receive the same from behind.

        Wraps ``MPI_Sendrecv`` with the ranks of :meth:`cart_shift`: the result
        is the ``x`` of the rank at ``coords - disp`` (zeros off the edge of a
        non-periodic axis). One call per side is a halo exchange.

        Args:
            x: array or scalar, the same shape and dtype on every rank.
            direction: the grid axis.
            disp: the number of steps (negative moves data the other way).
            tag: message tag.

        Returns:
            A new array shaped like ``x``.

        Raises:
            TypeError: if the communicator is not Cartesian, for bad arrays, or
                for a non-int or traced ``direction``, ``disp`` or ``tag``.
            ValueError: if ``direction`` is not an axis of the grid or ``tag``
                is out of range.

        Example:
            >>> halo_above = grid.shift(block[-1], direction=0, disp=1)
            >>> halo_below = grid.shift(block[0], direction=0, disp=-1)
        """
        source, dest = self.cart_shift(direction, disp)
        # Checked here, so that errors name shift's arguments, not sendrecv's.
        x = as_array(x, "x")
        tag = static_tag(tag, "tag", self._tag_ub)
        return self.sendrecv(x, x, source=source, dest=dest, sendtag=tag, recvtag=tag)

    def __enter__(self) -> JaxComm:
        return self

    def __exit__(self, *exc_info) -> None:
        self.free()

    def __repr__(self) -> str:
        state = "freed" if self.freed else f"rank {self._rank} of {self._size}"
        return f"<JaxComm {state}>"

    def _live(self) -> int:
        if self._comm is None:
            raise RuntimeError("this JaxComm has been freed")
        return self._handle

    # Collectives -------------------------------------------------------------

    @eager_cached(arrays=("x",))
    def allreduce(self, x: Any, op: MPI.Op = MPI.SUM) -> Any:
        """Combine ``x`` from every rank with ``op``; every rank gets the result.

        Wraps ``MPI_Allreduce``. Works eagerly and under ``jit``, in loops and
        conditionals. float16 and bfloat16 reduce through jaxcomm's own MPI ops
        (accumulating each pair in float32).

        Args:
            x: array or scalar, or a pytree of them, the same shapes and
                dtypes on every rank. A pytree's leaves are packed by dtype and
                reduced in one MPI call per dtype.
            op: a predefined ``MPI.Op``: SUM, PROD, MIN, MAX (numbers), LAND,
                LOR, LXOR (integers and bool; integers count as true when
                nonzero and the result is 0 or 1), BAND, BOR, BXOR (integers).

        Returns:
            New arrays of ``x``'s shapes and dtypes, in ``x``'s structure.

        Raises:
            TypeError: for a non-array leaf, an unsupported dtype, or an op
                MPI does not define for a dtype (such as SUM on bool).
            ValueError: for a user-defined ``MPI.Op`` or an empty pytree.

        Example:
            >>> grads = jc.allreduce({"w": gw, "b": gb})  # one MPI call for float32
        """
        handle = self._live()
        leaves, treedef, code = reduction_leaves(x, op)
        return call_on_tree(leaves, treedef, "allreduce", op=code, handle=handle)

    @eager_cached(arrays=("x",))
    def reduce(self, x: Any, op: MPI.Op = MPI.SUM, root: int = 0) -> Any:
        """Combine ``x`` from every rank with ``op`` onto rank ``root``.

        Wraps ``MPI_Reduce``. Every rank gets arrays of ``x``'s shapes and
        dtypes back: root the reduction, every other rank zeros. Works eagerly
        and under ``jit``, in loops and conditionals.

        Args:
            x: array or scalar, or a pytree of them (one MPI call per dtype),
                the same shapes and dtypes on every rank.
            op: a predefined ``MPI.Op``, as for :meth:`allreduce`.
            root: the rank that gets the result (a static int).

        Returns:
            A new array of ``x``'s shape and dtype: the reduction on root,
            zeros elsewhere.

        Raises:
            TypeError: for a non-array ``x``, an unsupported dtype, an op MPI
                does not define for the dtype, or a non-int or traced ``root``.
            ValueError: for a user-defined ``MPI.Op`` or a ``root`` that is not
                a rank of the communicator.
        """
        handle = self._live()
        leaves, treedef, code = reduction_leaves(x, op)
        root = static_rank(root, "root", self._size)
        return call_on_tree(leaves, treedef, "reduce", op=code, root=root, handle=handle)

    @eager_cached(arrays=("x",))
    def scan(self, x: ArrayLike, op: MPI.Op = MPI.SUM) -> jax.Array:
        """Combine ``x`` from ranks ``0..rank`` with ``op`` (inclusive prefix reduction).

        Wraps ``MPI_Scan``: rank ``r`` gets ``x_0 op x_1 op ... op x_r``.
        Works eagerly and under ``jit``, in loops and conditionals.

        Args:
            x: array or scalar, the same shape and dtype on every rank.
            op: a predefined ``MPI.Op``, as for :meth:`allreduce`.

        Returns:
            A new array of ``x``'s shape and dtype.

        Raises:
            TypeError: for a non-array ``x``, an unsupported dtype, or an op
                MPI does not define for the dtype.
            ValueError: for a user-defined ``MPI.Op``.
        """
        handle = self._live()
        x, code = reduction_operand(x, op)
        return ops.scan(x, op=code, handle=handle)

    @eager_cached(arrays=("x",))
    def exscan(self, x: ArrayLike, op: MPI.Op = MPI.SUM) -> jax.Array:
        """Combine ``x`` from ranks ``0..rank-1`` with ``op`` (exclusive prefix reduction).

        Wraps ``MPI_Exscan``: rank ``r > 0`` gets ``x_0 op ... op x_{r-1}``.
        MPI leaves rank 0's result undefined; jaxcomm returns zeros there.
        Works eagerly and under ``jit``, in loops and conditionals.

        Args:
            x: array or scalar, the same shape and dtype on every rank.
            op: a predefined ``MPI.Op``, as for :meth:`allreduce`.

        Returns:
            A new array of ``x``'s shape and dtype (zeros on rank 0).

        Raises:
            TypeError: for a non-array ``x``, an unsupported dtype, or an op
                MPI does not define for the dtype.
            ValueError: for a user-defined ``MPI.Op``.
        """
        handle = self._live()
        x, code = reduction_operand(x, op)
        return ops.exscan(x, op=code, handle=handle)

    @eager_cached(arrays=("x",))
    def reduce_scatter(
        self, x: ArrayLike, op: MPI.Op = MPI.SUM, *, tiled: bool = False
    ) -> jax.Array:
        """Combine ``x`` from every rank with ``op``; each rank gets its own block.

        Wraps ``MPI_Reduce_scatter_block``. The leading axis of ``x`` is split
        into ``size`` equal blocks and rank ``r`` gets block ``r`` reduced over
        all ranks, like ``jax.lax.psum_scatter``. Works eagerly and under
        ``jit``, in loops and conditionals.

        Args:
            x: array, the same shape and dtype on every rank.
            op: a predefined ``MPI.Op``, as for :meth:`allreduce`.
            tiled: if False, ``x.shape[0]`` must equal the communicator size and
                rank ``r`` gets the reduction of ``x[r]``, of shape
                ``x.shape[1:]``. If True, ``x.shape[0]`` must be a multiple
                ``size * k`` and rank ``r`` gets rows ``r*k:(r+1)*k`` reduced,
                of shape ``(k, *x.shape[1:])``.

        Returns:
            A new array of ``x``'s dtype holding this rank's reduced block.

        Raises:
            TypeError: for a non-array ``x``, an unsupported dtype, an op MPI
                does not define for the dtype, or a non-bool ``tiled``.
            ValueError: for a user-defined ``MPI.Op``, or an ``x`` whose leading
                axis does not fit the communicator size (0-d included).
        """
        handle = self._live()
        x, code = reduction_operand(x, op)
        tiled = static_bool(tiled, "tiled")
        check_split_rows(x, tiled, self._size, op="reduce_scatter")
        return ops.reduce_scatter(x, op=code, size=self._size, tiled=tiled, handle=handle)

    @eager_cached(arrays=("x",))
    def bcast(self, x: Any, root: int = 0) -> Any:
        """Send root's ``x`` to every rank.

        Wraps ``MPI_Bcast``. Every rank passes arrays of the same shapes and
        dtypes; only root's values are read. Works eagerly and under ``jit``.

        Args:
            x: array or scalar, or a pytree of them (one MPI call per dtype).
            root: the rank whose ``x`` is broadcast (a static int).

        Returns:
            New arrays holding root's ``x``, on every rank, in ``x``'s structure.

        Raises:
            TypeError: for a non-array leaf or a non-int or traced ``root``.
            ValueError: if ``root`` is not a rank of the communicator.

        Example:
            >>> params = jc.bcast(params, root=0)  # same initial weights everywhere
        """
        handle = self._live()
        leaves, treedef = pytree_leaves(x, "x")
        return call_on_tree(
            leaves, treedef, "bcast", root=static_rank(root, "root", self._size), handle=handle
        )

    @eager_cached(arrays=())
    def barrier(self) -> None:
        """Block until every rank has reached this barrier.

        Wraps ``MPI_Barrier``. Eagerly it returns once the barrier completed;
        under ``jit`` the barrier is ordered among the function's other MPI
        calls.
        """
        handle = self._live()
        ops.barrier(handle=handle)

    @eager_cached(arrays=("x",))
    def allgather(self, x: Any, *, tiled: bool = False) -> Any:
        """Collect ``x`` from every rank on every rank, in rank order.

        Wraps ``MPI_Allgather``. Every rank passes the same shape and dtype.
        Works eagerly and under ``jit``, in loops and conditionals.

        Args:
            x: array or scalar, or a pytree of them (one MPI call per dtype).
            tiled: as in ``jax.lax.all_gather``: ``False`` stacks the arrays
                along a new leading axis, ``True`` concatenates them along
                ``x``'s leading axis.

        Returns:
            A new array of shape ``(size, *x.shape)``, or
            ``(size * x.shape[0], *x.shape[1:])`` when ``tiled`` (for a pytree,
            each leaf so, in ``x``'s structure).

        Raises:
            TypeError: for a non-array ``x`` or a non-bool ``tiled``.
            ValueError: for ``tiled=True`` with a 0-d ``x``.

        Example:
            With 4 ranks, each passing ``jnp.full(2, rank)``:

            >>> jc.allgather(jnp.full(2, jc.rank)).shape
            (4, 2)
            >>> jc.allgather(jnp.full(2, jc.rank), tiled=True)
            Array([0, 0, 1, 1, 2, 2, 3, 3], dtype=int32)
        """
        handle = self._live()
        leaves, treedef = stackable_leaves(x, tiled)
        return call_on_tree(
            leaves,
            treedef,
            "allgather",
            static_bool(tiled, "tiled"),
            size=self._size,
            handle=handle,
        )

    @eager_cached(arrays=("x",))
    def gather(self, x: Any, root: int = 0, *, tiled: bool = False) -> Any:
        """Collect ``x`` from every rank on ``root``, in rank order.

        Wraps ``MPI_Gather``. Every rank passes the same shape and dtype and
        gets the same output shape: root gets the gathered arrays, the other
        ranks zeros. Works eagerly and under ``jit``.

        Args:
            x: array or scalar, or a pytree of them (one MPI call per dtype).
            root: the rank that receives (a static int).
            tiled: ``False`` stacks along a new leading axis, ``True``
                concatenates along ``x``'s leading axis (see :meth:`allgather`).

        Returns:
            A new array of shape ``(size, *x.shape)``, or
            ``(size * x.shape[0], *x.shape[1:])`` when ``tiled``: the gathered
            values on root, zeros elsewhere.

        Raises:
            TypeError: for a non-array ``x``, a non-int or traced ``root`` or a
                non-bool ``tiled``.
            ValueError: for a ``root`` out of range, or ``tiled=True`` with a
                0-d ``x``.

        Example:
            With 4 ranks, each passing ``jnp.asarray(rank)``:

            >>> jc.gather(jnp.asarray(jc.rank), root=1)
            Array([0, 1, 2, 3], dtype=int32)   # on rank 1; [0, 0, 0, 0] elsewhere
        """
        handle = self._live()
        leaves, treedef = stackable_leaves(x, tiled)
        return call_on_tree(
            leaves,
            treedef,
            "gather",
            static_bool(tiled, "tiled"),
            root=static_rank(root, "root", self._size),
            size=self._size,
            handle=handle,
        )

    @eager_cached(arrays=("x",))
    def scatter(self, x: ArrayLike, root: int = 0, *, tiled: bool = False) -> jax.Array:
        """Send one piece of root's ``x`` to each rank: rank ``r`` gets piece ``r``.

        Wraps ``MPI_Scatter``. Every rank passes an array of the same shape
        and dtype; only root's values are read. Works eagerly and under
        ``jit``.

        Args:
            x: array with a leading axis of length ``size`` (``tiled=False``)
                or a multiple of ``size`` (``tiled=True``).
            root: the rank whose ``x`` is scattered (a static int).
            tiled: ``False``: rank ``r`` gets ``x[r]``; ``True``: the leading
                axis is split into ``size`` equal chunks and rank ``r`` gets
                chunk ``r`` (as in ``jax.lax.psum_scatter``).

        Returns:
            A new array of shape ``x.shape[1:]``, or
            ``(x.shape[0] // size, *x.shape[1:])`` when ``tiled``.

        Raises:
            TypeError: for a non-array ``x``, a non-int or traced ``root`` or a
                non-bool ``tiled``.
            ValueError: for a ``root`` out of range, or a leading axis that
                does not fit the rules above.

        Example:
            With 4 ranks:

            >>> jc.scatter(jnp.arange(8.0), root=0, tiled=True)
            Array([2., 3.], dtype=float32)   # on rank 1: [2r, 2r + 1] on rank r
        """
        handle = self._live()
        x = as_array(x, "x")
        tiled = static_bool(tiled, "tiled")
        check_split_rows(x, tiled, self._size)
        return ops.scatter(
            x,
            root=static_rank(root, "root", self._size),
            size=self._size,
            tiled=tiled,
            handle=handle,
        )

    @eager_cached(arrays=("x",))
    def alltoall(self, x: ArrayLike, *, tiled: bool = False) -> jax.Array:
        """Send block ``r`` of ``x``'s leading axis to rank ``r``, from every rank.

        Wraps ``MPI_Alltoall``. Rank ``r``'s result holds, in rank order, the
        ``r``-th block of every rank's ``x``. Every rank passes the same shape
        and dtype. Works eagerly and under ``jit``.

        Args:
            x: array with a leading axis of length ``size`` (``tiled=False``:
                block ``r`` is ``x[r]``) or a multiple of ``size``
                (``tiled=True``: block ``r`` is the ``r``-th of ``size`` equal
                chunks).
            tiled: how the leading axis splits into blocks (see above).

        Returns:
            A new array of ``x``'s shape and dtype.

        Raises:
            TypeError: for a non-array ``x`` or a non-bool ``tiled``.
            ValueError: for a leading axis that does not fit the rules above.

        Example:
            With 4 ranks, each passing ``10 * rank + jnp.arange(4)``:

            >>> jc.alltoall(10 * jc.rank + jnp.arange(4))
            Array([ 1, 11, 21, 31], dtype=int32)   # on rank 1
        """
        handle = self._live()
        x = as_array(x, "x")
        check_split_rows(x, static_bool(tiled, "tiled"), self._size)
        return ops.alltoall(x, handle=handle)

    @eager_cached(arrays=("x",))
    def allgatherv(self, x: ArrayLike, counts: Any) -> jax.Array:
        """Concatenate ``x`` from every rank along its leading axis, on every rank.

        Wraps ``MPI_Allgatherv``: ranks contribute different numbers of
        rows, given by ``counts``. The trailing dimensions and dtype must
        match on every rank. Works eagerly and under ``jit``.

        Args:
            x: array whose leading axis has ``counts[rank]`` rows (possibly 0).
            counts: static sequence of ``size`` non-negative ints, the rows
                each rank contributes, identical on every rank.

        Returns:
            A new array of shape ``(sum(counts), *x.shape[1:])``, the ranks'
            arrays in rank order.

        Raises:
            TypeError: for a non-array ``x`` or ``counts`` that is traced or
                not a sequence of ints.
            ValueError: for ``counts`` of the wrong length or with negative
                entries, or an ``x`` without ``counts[rank]`` rows.

        Example:
            With 3 ranks, rank ``r`` passing ``jnp.full(r, r)``:

            >>> jc.allgatherv(jnp.full(jc.rank, jc.rank), counts=[0, 1, 2])
            Array([1, 2, 2], dtype=int32)
        """
        handle = self._live()
        x = as_array(x, "x")
        counts = static_counts(counts, "counts", self._size)
        check_own_rows(x, counts, self._rank)
        return ops.allgatherv(x, counts=counts, handle=handle)

    @eager_cached(arrays=("x",))
    def gatherv(self, x: ArrayLike, counts: Any, root: int = 0) -> jax.Array:
        """Concatenate ``x`` from every rank along its leading axis, on ``root``.

        Wraps ``MPI_Gatherv``. Like :meth:`allgatherv`, but only root gets the
        result; the other ranks get zeros of the same shape. Works eagerly
        and under ``jit``.

        Args:
            x: array whose leading axis has ``counts[rank]`` rows (possibly 0).
            counts: static sequence of ``size`` non-negative ints, the rows
                each rank contributes, identical on every rank.
            root: the rank that receives (a static int).

        Returns:
            A new array of shape ``(sum(counts), *x.shape[1:])``: the ranks'
            arrays in rank order on root, zeros elsewhere.

        Raises:
            TypeError: for a non-array ``x``, ``counts`` that is traced or not
                a sequence of ints, or a non-int or traced ``root``.
            ValueError: for bad ``counts`` (see :meth:`allgatherv`), an ``x``
                without ``counts[rank]`` rows, or a ``root`` out of range.

        Example:
            With 3 ranks, rank ``r`` passing ``jnp.full(r, r)``:

            >>> jc.gatherv(jnp.full(jc.rank, jc.rank), counts=[0, 1, 2], root=2)
            Array([1, 2, 2], dtype=int32)   # on rank 2; [0, 0, 0] elsewhere
        """
        handle = self._live()
        x = as_array(x, "x")
        counts = static_counts(counts, "counts", self._size)
        check_own_rows(x, counts, self._rank)
        return ops.gatherv(
            x, counts=counts, root=static_rank(root, "root", self._size), handle=handle
        )

    @eager_cached(arrays=("x",))
    def scatterv(self, x: ArrayLike, counts: Any, root: int = 0) -> jax.Array:
        """Split root's ``x`` along its leading axis into pieces of ``counts`` rows.

        Wraps ``MPI_Scatterv``: rank ``r`` gets the ``r``-th piece, of
        ``counts[r]`` rows. Every rank passes an array of the same shape and
        dtype; only root's values are read. Works eagerly and under ``jit``.

        Args:
            x: array with ``sum(counts)`` rows.
            counts: static sequence of ``size`` non-negative ints, the rows
                each rank gets, identical on every rank.
            root: the rank whose ``x`` is scattered (a static int).

        Returns:
            A new array of shape ``(counts[rank], *x.shape[1:])``.

        Raises:
            TypeError: for a non-array ``x``, ``counts`` that is traced or not
                a sequence of ints, or a non-int or traced ``root``.
            ValueError: for bad ``counts`` (see :meth:`allgatherv`), an ``x``
                without ``sum(counts)`` rows, or a ``root`` out of range.

        Example:
            With 3 ranks:

            >>> jc.scatterv(jnp.arange(3), counts=[0, 1, 2], root=0)
            Array([1, 2], dtype=int32)   # on rank 2; [] on rank 0, [0] on rank 1
        """
        handle = self._live()
        x = as_array(x, "x")
        counts = static_counts(counts, "counts", self._size)
        rows = leading_axis(x, "to split among the ranks")
        if rows != sum(counts):
            raise ValueError(f"x has {rows} rows, but counts add up to {sum(counts)}")
        return ops.scatterv(
            x,
            counts=counts,
            root=static_rank(root, "root", self._size),
            rank=self._rank,
            handle=handle,
        )

    @eager_cached(arrays=("x",))
    def alltoallv(
        self,
        x: ArrayLike,
        sendcounts: Any,
        recvcounts: Any = None,
        *,
        capacity: int | None = None,
    ) -> Any:
        """Exchange blocks of rows of different sizes between every pair of ranks.

        Wraps ``MPI_Alltoallv``. Rank ``i``'s ``x`` holds its blocks for ranks
        0, 1, ... one after another, ``sendcounts[j]`` rows for rank ``j``,
        from its first row on (rows past ``sum(sendcounts)`` are not sent);
        the result holds the blocks received from ranks 0, 1, ... one after
        another. The trailing dimensions and dtype must match on every rank.

        Three forms:

        - ``alltoallv(x, sendcounts)``: this rank's counts, a static sequence
          or an integer array, which may be traced (computed inside ``jit``).
          The receive counts are learned with one ``MPI_Alltoall`` of the
          counts before the ``MPI_Alltoallv``. Returns ``(y, recvcounts)``:
          ``y`` has ``capacity`` rows (default: ``x``'s), the received blocks
          first and zeros after them, and ``recvcounts`` (int32, or int64
          where the counts are) the rows received from each rank.
        - ``alltoallv(x, sendcounts, recvcounts)``: also the rows this rank
          receives from each rank, static or traced, checked against what
          arrives. Returns ``y`` alone, of ``capacity`` rows: by default
          ``sum(recvcounts)`` for static ``recvcounts``, ``x``'s rows for
          traced ones.
        - ``alltoallv(x, counts)`` with the static ``size`` x ``size`` matrix
          identical on every rank (``counts[i][j]``: rows rank ``i`` sends
          rank ``j``): returns ``y`` of exactly the rows received. Kept for
          convenience; the matrix costs O(size**2) on every rank, which the
          other forms avoid.

        Works eagerly and under ``jit``, in ``scan``/``fori_loop``/``cond``,
        under ``vmap`` and differentiable (``jvp``, ``grad``, ``vjp``,
        ``linear_transpose``): the transpose is the reverse exchange, one MPI
        operation again.

        Args:
            x: array of rows; at least ``sum(sendcounts)`` of them (exactly
                that many in the matrix form).
            sendcounts: this rank's row counts per destination (see above),
                or the counts matrix.
            recvcounts: this rank's row counts per source, or None.
            capacity: static number of rows of the result (not in the matrix
                form).

        Returns:
            ``(y, recvcounts)`` without ``recvcounts``, else ``y`` (see above).

        Raises:
            TypeError: for a non-array ``x``, non-integer counts, or a
                traced counts matrix.
            ValueError: for counts without one entry per rank, negative
                static counts, or static counts that do not fit ``x`` or
                ``capacity``.
            RuntimeError: raised by the kernel (``XlaRuntimeError``) for
                traced counts that are negative or do not fit ``x`` (on
                every rank, nothing exchanged), and for received rows that
                overflow ``capacity`` or differ from ``recvcounts`` (on the
                receiving rank, after the exchange, so no rank waits; see
                ``docs/irregular.md``).

        Example:
            With 2 ranks, where rank 0 sends 1 row to itself and 2 to rank 1,
            and rank 1 sends 3 rows to rank 0 and none to itself:

            >>> sendcounts = [[1, 2], [3, 0]][jc.rank]
            >>> y, got = jc.alltoallv(jnp.full(4, jc.rank), sendcounts)
            >>> y, got
            (Array([0, 1, 1, 1], dtype=int32), Array([1, 3], dtype=int32))  # on rank 0
            # on rank 1: (Array([0, 0, 0, 0], dtype=int32), Array([2, 0], dtype=int32))
        """
        handle = self._live()
        x = as_array(x, "x")
        if is_matrix(sendcounts) and recvcounts is None and capacity is None:
            return self._alltoallv_matrix(x, sendcounts, handle)
        return _counted_exchange(
            ops.alltoallv_counts, x, sendcounts, recvcounts, capacity, self._size, "rank", handle
        )

    def _alltoallv_matrix(self, x: jax.Array, counts: Any, handle: int) -> jax.Array:
        rows = per_rank(counts, "counts", self._size)
        matrix = [static_counts(row, f"counts[{i}]", self._size) for i, row in enumerate(rows)]
        send = matrix[self._rank]
        recv = tuple(row[self._rank] for row in matrix)
        own = leading_axis(x, "of sum(counts[rank]) rows")
        if own != sum(send):
            raise ValueError(
                f"x has {own} rows on rank {self._rank}, but counts[{self._rank}] "
                f"adds up to {sum(send)}"
            )
        # Counts and displacements, in rows, of every rank's sends and receives.
        columns = [[row[j] for row in matrix] for j in range(self._size)]
        max_rows = max(max(max(block), sum(block) - block[-1]) for block in (*matrix, *columns))
        return ops.alltoallv(x, sendcounts=send, recvcounts=recv, max_rows=max_rows, handle=handle)

    @eager_cached(
        arrays=(
            "operand",
            "output",
            "input_offsets",
            "send_sizes",
            "output_offsets",
            "recv_sizes",
        )
    )
    def ragged_all_to_all(
        self,
        operand: ArrayLike,
        output: ArrayLike,
        input_offsets: ArrayLike,
        send_sizes: ArrayLike,
        output_offsets: ArrayLike,
        recv_sizes: ArrayLike,
        *,
        axis_name: str | tuple[str, ...] | None = None,
        axis_index_groups: Any = None,
    ) -> jax.Array:
        """Send slices of rows to every rank, each written where its sender says.

        ``jax.lax.ragged_all_to_all`` over the ranks of the communicator,
        made of one ``MPI_Alltoall`` (where each slice goes, and the checks
        below) and one ``MPI_Alltoallv``. This rank sends
        ``operand[input_offsets[j]:input_offsets[j] + send_sizes[j]]`` to rank
        ``j``, which writes it at rows ``output_offsets[j]`` on of its
        result; rank ``j``'s slice arrives here in ``recv_sizes[j]`` rows,
        which must equal rank ``j``'s ``send_sizes[rank]``. The result is
        ``output`` with the received slices written in; other rows keep
        ``output``'s values. A program written for
        ``jax.lax.ragged_all_to_all(..., axis_name=...)`` inside
        ``shard_map`` ports by calling this method instead, with the same
        arguments: ``axis_name`` is checked against the communicator's axes,
        so a function that takes the exchange as an argument can be given
        this method of a :meth:`for_mesh` communicator where it was given
        ``jax.lax.ragged_all_to_all``.

        The index arrays may be computed inside ``jit``. Works eagerly and
        under ``jit``, in ``scan``/``fori_loop``/``cond``, under ``vmap`` and
        differentiable in ``operand`` and ``output`` (``jvp``, ``grad``,
        ``vjp``, ``linear_transpose``): the transpose is the reverse
        exchange, one MPI operation again (not for slices that overlap in
        ``operand``, whose cotangents would have to add).

        Args:
            operand: array of rows to send from; same row shape and dtype
                on every rank.
            output: array of rows (same row shape and dtype as ``operand``)
                that received slices are written into; same shape on every
                rank.
            input_offsets: integer array of shape ``(size,)``: where in
                ``operand`` each rank's slice starts.
            send_sizes: integer array of shape ``(size,)``: rows of each
                rank's slice.
            output_offsets: integer array of shape ``(size,)``: where in rank
                ``j``'s result this rank's slice for it starts.
            recv_sizes: integer array of shape ``(size,)``: rows received
                from each rank.
            axis_name: None (the communicator's ranks), or, as
                ``jax.lax.ragged_all_to_all`` takes it, the mesh axis name or
                tuple of names of a :meth:`for_mesh` communicator, in the
                order given to :meth:`for_mesh`. Only checked: the
                communicator decides who takes part.
            axis_index_groups: None; JAX's groups of positions along the
                axis are not supported (split the communicator instead).

        Returns:
            A new array shaped like ``output``.

        Raises:
            TypeError: for non-arrays, operand and output of different
                dtypes, non-integer index arrays, or an ``axis_name`` that is
                not a name or a tuple of names.
            ValueError: for operand and output rows of different shapes,
                index arrays not of shape ``(size,)``, or an ``axis_name``
                other than None on a communicator not made by
                :meth:`for_mesh`, or other than its axes on one that is.
            NotImplementedError: for ``axis_index_groups`` other than None.
            RuntimeError: raised by the kernel (``XlaRuntimeError``) before
                anything moves, on every rank, for a negative offset or size
                or a slice that overruns ``operand`` or its destination's
                output on any rank (that rank's error gives the reason, the
                others name it); after the exchange, on the receiving rank
                only, for ``recv_sizes`` that disagree with the senders'
                ``send_sizes`` (also on the sender) or received slices that
                overlap. Nothing is written outside the buffers, and no rank
                waits for another (``docs/irregular.md``).

        Example:
            ``jax.lax.ragged_all_to_all``'s own example, on 2 ranks:

            >>> args = [  # operand, output, input_offsets, send_sizes, output_offsets, recv_sizes
            ...     ([1, 2, 2], [0, 0, 0, 0], [0, 1], [1, 2], [0, 0], [1, 1]),
            ...     ([3, 4, 0], [0, 0, 0, 0], [0, 1], [1, 1], [1, 2], [2, 1]),
            ... ][jc.rank]
            >>> jc.ragged_all_to_all(*map(jnp.asarray, args))
            Array([1, 3, 0, 0], dtype=int32)   # on rank 0; [2, 2, 4, 0] on rank 1
        """
        handle = self._live()
        mesh_axis_name(axis_name, axis_index_groups, self.mesh_axes, "ragged_all_to_all")
        operand, output = rows_arrays(operand, output)
        indices = index_arrays(
            {
                "input_offsets": input_offsets,
                "send_sizes": send_sizes,
                "output_offsets": output_offsets,
                "recv_sizes": recv_sizes,
            },
            self._size,
        )
        return ops.ragged_all_to_all(operand, output, indices, handle=handle)

    # Neighbourhood collectives ------------------------------------------------

    def _blocks(self, x: Any, what: str, degree: int) -> jax.Array:
        """``x`` as an array with a leading axis of ``degree`` blocks, or raise."""
        x = as_array(x, "x")
        blocks = leading_axis(x, f"of one block per {what} ({degree})")
        if blocks != degree:
            raise ValueError(
                f"x has {blocks} blocks on rank {self._rank}; it needs one per {what}: {degree}"
            )
        return x

    @eager_cached(arrays=("x",))
    def neighbor_alltoall(self, x: ArrayLike) -> jax.Array:
        """Send block ``j`` of ``x`` to ``destinations[j]``; receive one block from each source.

        Wraps ``MPI_Neighbor_alltoall`` on a communicator with a topology
        (:meth:`from_graph`, :meth:`from_cart`, or ``JaxComm(comm)`` of a
        communicator that has one). On a Cartesian grid the neighbours are,
        per dimension, the one at ``-1`` then the one at ``+1``
        (:attr:`sources` and :attr:`destinations`), so one call is a whole
        halo exchange: send ``x[2 * d]`` towards ``-1`` and ``x[2 * d + 1]``
        towards ``+1`` along dimension ``d``, and get back
        ``y[2 * d]`` (what the neighbour at ``-1`` sent towards ``+1``) and
        ``y[2 * d + 1]``. Blocks from ``MPI.PROC_NULL`` (off a non-periodic
        edge) are zeros; blocks sent there go nowhere. On an ``MPI_GRAPH``
        communicator (``comm.Create_graph``) the neighbours, in the order of
        ``MPI_Graph_neighbors``, are both the sources and the destinations.

        Works eagerly and under ``jit``, in ``scan``/``fori_loop``/``cond``,
        under ``vmap`` and differentiable (``jvp``, ``grad``, ``vjp``,
        ``linear_transpose``): the transpose sends each cotangent block back
        where its block came from, one ``MPI_Neighbor_alltoall`` on the
        reverse graph.

        Args:
            x: array of shape ``(outdegree, ...)``; the block shape and dtype
                must match on every rank.

        Returns:
            A new array of shape ``(indegree, ...)``: block ``i`` from
            ``sources[i]``.

        Raises:
            TypeError: for a communicator without a topology, or a non-array ``x``.
            ValueError: on every rank, on an ``MPI_GRAPH`` communicator whose
                ranks do not list each other equally often (MPI defines
                neighbourhood collectives only on a symmetric graph). If
                ``x``'s leading axis is not the outdegree: raised on this
                rank only, before any MPI call; its neighbours, whose ``x``
                was right, wait for it (the watchdog, ``JAXCOMM_TIMEOUT``,
                reports them).

        Example:
            A halo exchange on a periodic 1-d grid, each rank's first and last
            rows going to the neighbours behind and ahead of it:

            >>> grid = JaxComm.from_cart([0], periods=[True])
            >>> halo = grid.neighbor_alltoall(jnp.stack([u[0], u[-1]]))
            >>> u_ext = jnp.concatenate([halo[:1], u, halo[1:]])  # ghosts at both ends
        """
        handle, _, destinations = self._topology()
        x = self._blocks(x, "destination", len(destinations))
        return ops.neighbor_alltoall(x, handle=handle)

    @eager_cached(arrays=("x",))
    def neighbor_allgather(self, x: ArrayLike) -> jax.Array:
        """Send ``x`` to every destination; receive one from each source.

        Wraps ``MPI_Neighbor_allgather`` on a communicator with a topology
        (see :meth:`neighbor_alltoall` for the neighbours' order and
        ``MPI.PROC_NULL``, whose blocks are zeros).

        Works eagerly and under ``jit``, in ``scan``/``fori_loop``/``cond``,
        under ``vmap`` and differentiable (``jvp``, ``grad``, ``vjp``,
        ``linear_transpose``): the transpose sends each cotangent block back
        to its source (one ``MPI_Neighbor_alltoall`` on the reverse graph)
        and sums what arrives.

        Args:
            x: array or scalar, the same shape and dtype on every rank.

        Returns:
            A new array of shape ``(indegree, *x.shape)``: block ``i`` is the
            ``x`` of ``sources[i]``.

        Raises:
            TypeError: for a communicator without a topology, or a non-array ``x``.
            ValueError: on every rank, on an ``MPI_GRAPH`` communicator that is
                not symmetric (see :meth:`neighbor_alltoall`).

        Example:
            >>> ring = JaxComm.from_graph([(jc.rank - 1) % jc.size], [(jc.rank + 1) % jc.size])
            >>> ring.neighbor_allgather(jnp.float32(ring.rank))  # [rank - 1]
        """
        handle, _, _ = self._topology()
        return ops.neighbor_allgather(as_array(x, "x"), handle=handle)

    @eager_cached(arrays=("x",))
    def neighbor_alltoallv(
        self,
        x: ArrayLike,
        sendcounts: Any,
        recvcounts: Any = None,
        *,
        capacity: int | None = None,
    ) -> Any:
        """Send blocks of rows of different sizes to the destinations; receive from the sources.

        Wraps ``MPI_Neighbor_alltoallv`` on a communicator with a topology
        (see :meth:`neighbor_alltoall` for the neighbours' order). ``x`` holds
        the blocks for ``destinations[0]``, ``destinations[1]``, ... one after
        another, ``sendcounts[j]`` rows for ``destinations[j]``, from its first
        row on (rows past ``sum(sendcounts)`` are not sent); the result holds
        the blocks from ``sources[0]``, ``sources[1]``, ... one after another,
        then zeros. The counts may be static sequences or integer arrays,
        traced or not (computed inside ``jit``). One ``MPI_Neighbor_alltoall``
        of a small header per edge comes first (the rows each block has),
        then the ``MPI_Neighbor_alltoallv``:

        - ``neighbor_alltoallv(x, sendcounts)``: the receive counts are
          learned. Returns ``(y, recvcounts)``: ``y`` of ``capacity`` rows
          (default: ``x``'s) and the rows received from each source (int32,
          or int64 where the counts are).
        - ``neighbor_alltoallv(x, sendcounts, recvcounts)``: also the rows
          expected from each source, checked against what arrives. Returns
          ``y`` alone, of ``capacity`` rows: by default ``sum(recvcounts)``
          for static ``recvcounts``, ``x``'s rows for traced ones.

        Works eagerly and under ``jit``, in ``scan``/``fori_loop``/``cond``,
        under ``vmap`` and differentiable in ``x`` (``jvp``, ``grad``,
        ``vjp``, ``linear_transpose``): the transpose sends each cotangent
        block back to its source, one exchange on the reverse graph. Rows
        sent to ``MPI.PROC_NULL`` (off a non-periodic edge) go nowhere and
        get a zero cotangent; a ``MPI.PROC_NULL`` source sends no rows, so
        its ``recvcounts`` entry is 0.

        Args:
            x: array of rows, at least ``sum(sendcounts)`` of them; the row
                shape and dtype must match on every rank.
            sendcounts: rows for each destination, ``outdegree`` entries.
            recvcounts: rows from each source, ``indegree`` entries, or None.
            capacity: static number of rows of the result.

        Returns:
            ``(y, recvcounts)`` without ``recvcounts``, else ``y``.

        Raises:
            TypeError: for a communicator without a topology, a non-array
                ``x`` or non-integer counts.
            ValueError: on this rank, before any MPI call, for counts of the
                wrong length, negative static counts or static counts that do
                not fit ``x`` or ``capacity``; on every rank, on an
                ``MPI_GRAPH`` communicator that is not symmetric (see
                :meth:`neighbor_alltoall`).
            RuntimeError: raised by the kernel (``XlaRuntimeError``) for
                traced counts that are negative or do not fit ``x`` or
                ``capacity`` (on this rank and its destinations, which
                receive nothing from it), and for received rows that overflow
                ``capacity`` or differ from ``recvcounts`` (on the receiving
                rank). Every rank still makes both MPI calls with the rows it
                announced, so no neighbour waits; nothing is written outside
                the buffers (``docs/irregular.md``).

        Example:
            Ghost rows on a ring: each rank sends its last ``k`` rows ahead,
            ``k`` computed in the step:

            >>> ring = JaxComm.from_graph([(jc.rank - 1) % jc.size], [(jc.rank + 1) % jc.size])
            >>> ghosts, got = ring.neighbor_alltoallv(rows[::-1], jnp.array([k]), capacity=8)
        """
        handle, sources, destinations = self._topology()
        x = as_array(x, "x")
        lengths = {"sendcounts": len(destinations), "recvcounts": len(sources)}
        return _counted_exchange(
            ops.neighbor_alltoallv,
            x,
            sendcounts,
            recvcounts,
            capacity,
            lengths,
            "neighbour",
            handle,
        )

    @eager_cached(arrays=("x",))
    def neighbor_allgatherv(
        self,
        x: ArrayLike,
        recvcounts: Any = None,
        *,
        sendcount: Any = None,
        capacity: int | None = None,
    ) -> Any:
        """Send the same rows to every destination; receive blocks of different sizes from the sources.

        Wraps ``MPI_Neighbor_allgatherv`` on a communicator with a topology
        (see :meth:`neighbor_alltoall` for the neighbours' order). This rank's
        first ``sendcount`` rows of ``x`` (all of them by default) go to every
        destination; the result holds the blocks from ``sources[0]``,
        ``sources[1]``, ... one after another, then zeros. A source that is
        ``MPI.PROC_NULL`` (off a non-periodic edge) sends no rows. The
        counts may be static or integer arrays, traced or not (computed
        inside ``jit``). One ``MPI_Neighbor_alltoall`` of a small header per
        edge comes first (the rows each block has), then the
        ``MPI_Neighbor_allgatherv``:

        - ``neighbor_allgatherv(x)``: the receive counts are learned. Returns
          ``(y, recvcounts)``: ``y`` of ``capacity`` rows (default: indegree
          times ``x``'s rows) and the rows received from each source (int32,
          or int64 where the counts are).
        - ``neighbor_allgatherv(x, recvcounts)``: also the rows expected from
          each source (0 from ``MPI.PROC_NULL``), checked against what
          arrives. Returns ``y`` alone, of ``capacity`` rows: by default
          ``sum(recvcounts)`` for static ``recvcounts``, indegree times
          ``x``'s rows for traced ones.

        Works eagerly and under ``jit``, in ``scan``/``fori_loop``/``cond``,
        under ``vmap`` and differentiable in ``x`` (``jvp``, ``grad``,
        ``vjp``, ``linear_transpose``): the transpose sends each cotangent
        block back to its source (one ``neighbor_alltoallv`` on the reverse
        graph), and each rank sums the cotangents of its rows that come back
        from its destinations.

        Args:
            x: array of rows; the row shape and dtype must match on every
                rank, the number of rows need not.
            recvcounts: rows from each source, ``indegree`` entries, or None.
            sendcount: rows of ``x`` sent, from its first row on (default:
                all of them); a static int or an integer scalar, traced or not.
            capacity: static number of rows of the result.

        Returns:
            ``(y, recvcounts)`` without ``recvcounts``, else ``y``.

        Raises:
            TypeError: for a communicator without a topology, a non-array
                ``x`` or non-integer counts.
            ValueError: on this rank, before any MPI call, for ``recvcounts``
                of the wrong length, a negative static count, a static
                ``sendcount`` over ``x``'s rows or static ``recvcounts`` over
                ``capacity``.
            RuntimeError: raised by the kernel (``XlaRuntimeError``) for a
                traced ``sendcount`` that is negative or over ``x``'s rows
                (on this rank and its destinations, which receive nothing
                from it), and for traced ``recvcounts`` that are negative, or
                received rows that overflow ``capacity`` or differ from
                ``recvcounts`` (on the receiving rank). Every rank still
                makes both MPI calls with the rows it announced, so no
                neighbour waits; nothing is written outside the buffers
                (``docs/irregular.md``).

        Example:
            Each rank of a ring sends its ``k`` particles, ``k`` computed in
            the step, to both neighbours:

            >>> ring = JaxComm.from_cart([0], periods=[True])
            >>> near, got = ring.neighbor_allgatherv(particles, sendcount=k, capacity=64)
        """
        handle, sources, _ = self._topology()
        return _gathered_exchange(
            ops.neighbor_allgatherv,
            as_array(x, "x"),
            sendcount,
            recvcounts,
            capacity,
            len(sources),
            handle,
        )

    # Point to point ----------------------------------------------------------

    @eager_cached(arrays=("x",))
    def send(self, x: ArrayLike, dest: int, tag: int = 0) -> None:
        """Send ``x`` to rank ``dest``.

        Wraps ``MPI_Send`` (blocking, standard mode). The send happens even
        though nothing is returned, also inside ``jit``.

        Args:
            x: array or scalar to send.
            dest: destination rank, or ``MPI.PROC_NULL`` to send nothing.
            tag: message tag, ``0 <= tag <= MPI.TAG_UB``.

        Raises:
            TypeError: for a non-array ``x`` or a non-int or traced ``dest``/``tag``.
            ValueError: for a ``dest`` or ``tag`` out of range.
        """
        handle = self._live()
        x = as_array(x, "x")
        ops.send(
            x,
            dest=static_rank(dest, "dest", self._size, proc_null=True),
            tag=static_tag(tag, "tag", self._tag_ub),
            handle=handle,
        )

    @eager_cached(arrays=("x",))
    def recv(
        self,
        x: Any,
        source: int = MPI.ANY_SOURCE,
        tag: int = MPI.ANY_TAG,
        status: MPI.Status | None = None,
        *,
        return_status: bool = False,
    ) -> Any:
        """Receive an array shaped like ``x`` from rank ``source``.

        Wraps ``MPI_Recv``. ``x`` only gives the shape and dtype (an array,
        tracer or ``jax.ShapeDtypeStruct``); it is not modified.

        Args:
            x: template for the received array's shape and dtype.
            source: sending rank, ``MPI.ANY_SOURCE``, or ``MPI.PROC_NULL``
                (nothing is received and the result is zeros).
            tag: message tag or ``MPI.ANY_TAG``.
            status: an ``MPI.Status`` to fill with the message's source, tag
                and size (``Get_count`` in bytes, ``Get_count(datatype)`` in
                elements). Works eagerly and in traced code (``jit``,
                ``vmap``, ``grad``, loop bodies): there the compiled code
                fills it when the receive runs, so read it once the result
                is ready (``block_until_ready`` or :func:`jaxcomm.sync`).
                Under ``vmap`` it describes the one message that carried the
                whole batch. Tracing with the same object again does not
                recompile; jaxcomm keeps a ``Status`` used in traced code
                alive.
            return_status: also return the message's status as an integer
                array ``[source, tag, count]`` (``count`` in elements of
                ``x``'s dtype; under ``vmap``, of the whole batch), which
                works everywhere, ``jit`` included. Its dtype is int64, or
                int32 without ``jax_enable_x64``.

        Returns:
            The received array, or ``(array, status)`` with ``return_status``.
            A message shorter than ``x`` fills the front of the array and
            leaves zeros behind; a receive from ``MPI.PROC_NULL`` gives zeros
            and the status ``[MPI.PROC_NULL, MPI.ANY_TAG, 0]``.

        Raises:
            TypeError: for a bad template, a non-int or traced ``source``/``tag``,
                a ``status`` that is not an ``MPI.Status``, or a non-bool
                ``return_status``.
            ValueError: for a ``source`` or ``tag`` out of range.

        Example:
            >>> y, status = jax.jit(lambda t: jc.recv(t, return_status=True))(template)
            >>> source, tag, count = status.tolist()
        """
        handle = self._live()
        check_status(status)
        return_status = static_bool(return_status, "return_status")
        result, envelope = ops.recv(
            template(x, "x"),
            source=static_rank(source, "source", self._size, proc_null=True, any_source=True),
            tag=static_tag(tag, "tag", self._tag_ub, any_tag=True),
            handle=handle,
        )
        return received(result, envelope, status, return_status, handle)

    @eager_cached(arrays=("sendbuf", "recvbuf"))
    def sendrecv(
        self,
        sendbuf: ArrayLike,
        recvbuf: Any,
        source: int,
        dest: int,
        sendtag: int = 0,
        recvtag: int = MPI.ANY_TAG,
        status: MPI.Status | None = None,
        *,
        return_status: bool = False,
    ) -> Any:
        """Send ``sendbuf`` to ``dest`` and receive from ``source`` in one call.

        Wraps ``MPI_Sendrecv``, which cannot deadlock on a ring or a pairwise
        exchange the way two blocking calls can. ``recvbuf`` only gives the
        shape and dtype, which must equal ``sendbuf``'s.

        Args:
            sendbuf: array or scalar to send.
            recvbuf: template for the received array (not modified).
            source: sending rank, ``MPI.ANY_SOURCE``, or ``MPI.PROC_NULL``
                (nothing is received and the result is zeros).
            dest: destination rank or ``MPI.PROC_NULL``.
            sendtag: tag of the outgoing message.
            recvtag: tag to match, or ``MPI.ANY_TAG``.
            status: an ``MPI.Status`` to fill for the received message (see
                :meth:`recv`).
            return_status: also return the received message's status as an
                integer array ``[source, tag, count]`` (see :meth:`recv`).

        Returns:
            The received array, or ``(array, status)`` with ``return_status``.

        Raises:
            TypeError: for bad arrays, non-int or traced ranks and tags, a
                bad ``status`` (see :meth:`recv`) or a non-bool ``return_status``.
            ValueError: if the buffers differ in shape or dtype, or a rank or
                tag is out of range.
        """
        handle = self._live()
        check_status(status)
        return_status = static_bool(return_status, "return_status")
        sendbuf = as_array(sendbuf, "sendbuf")
        shape, dtype = shape_dtype(recvbuf, "recvbuf")
        if (shape, dtype) != (sendbuf.shape, np.dtype(sendbuf.dtype)):
            raise ValueError(
                f"sendbuf ({sendbuf.dtype}{list(sendbuf.shape)}) and recvbuf "
                f"({dtype}{list(shape)}) must have the same shape and dtype"
            )
        result, envelope = ops.sendrecv(
            sendbuf,
            source=static_rank(source, "source", self._size, proc_null=True, any_source=True),
            dest=static_rank(dest, "dest", self._size, proc_null=True),
            sendtag=static_tag(sendtag, "sendtag", self._tag_ub),
            recvtag=static_tag(recvtag, "recvtag", self._tag_ub, any_tag=True),
            handle=handle,
        )
        return received(result, envelope, status, return_status, handle)

    # Nonblocking operations --------------------------------------------------
    #
    # Each starts an operation and returns a Request; JaxComm.wait completes
    # it. They take single arrays (not pytrees) and bind their primitives
    # directly, also eagerly (ops/nonblocking.py).

    def isend(self, x: ArrayLike, dest: int, tag: int = 0) -> Request:
        """Start sending ``x`` to rank ``dest``; complete it with :meth:`wait`.

        Wraps ``MPI_Isend``. ``x`` stays alive and unmodified until the wait
        (jaxcomm keeps it). Works eagerly and under ``jit``, in loop bodies
        and under ``vmap``; the request must be waited in the same traced
        function (see ``docs/nonblocking.md``). Differentiable.

        Args:
            x: array or scalar to send.
            dest: destination rank, or ``MPI.PROC_NULL`` to send nothing.
            tag: message tag, ``0 <= tag <= MPI.TAG_UB``.

        Returns:
            A :class:`jaxcomm.Request`; its wait returns None.

        Raises:
            TypeError: for a non-array ``x`` or a non-int or traced ``dest``/``tag``.
            ValueError: for a ``dest`` or ``tag`` out of range.

        Example:
            >>> req = jc.isend(x, dest=(jc.rank + 1) % jc.size)
            >>> y = expensive(z)          # runs while the message travels
            >>> jc.wait(req)
        """
        handle = self._live()
        x = held(x, "x")
        return nonblocking.start(
            nonblocking.isend_p,
            x,
            dest=static_rank(dest, "dest", self._size, proc_null=True),
            tag=static_tag(tag, "tag", self._tag_ub),
            handle=handle,
        )

    def irecv(self, x: Any, source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG) -> Request:
        """Start receiving an array shaped like ``x`` from rank ``source``; see :meth:`wait`.

        Wraps ``MPI_Irecv``. ``x`` only gives the shape and dtype (an array,
        tracer or ``jax.ShapeDtypeStruct``). The received array is returned by
        :meth:`wait`; nothing can read it earlier. A message shorter than
        ``x`` fills the front and leaves zeros; a receive from
        ``MPI.PROC_NULL`` gives zeros. Works eagerly, under ``jit`` and
        ``vmap`` (a batched message needs a batched template, as for
        :meth:`recv`). Differentiable with an explicit ``source`` and
        ``tag``.

        Args:
            x: template for the received array's shape and dtype.
            source: sending rank, ``MPI.ANY_SOURCE``, or ``MPI.PROC_NULL``.
            tag: message tag or ``MPI.ANY_TAG``.

        Returns:
            A :class:`jaxcomm.Request`; its wait returns the received array.

        Raises:
            TypeError: for a bad template or a non-int or traced ``source``/``tag``.
            ValueError: for a ``source`` or ``tag`` out of range.
        """
        handle = self._live()
        return nonblocking.start(
            nonblocking.irecv_p,
            template(x, "x"),
            source=static_rank(source, "source", self._size, proc_null=True, any_source=True),
            tag=static_tag(tag, "tag", self._tag_ub, any_tag=True),
            handle=handle,
        )

    def iallreduce(self, x: ArrayLike, op: MPI.Op = MPI.SUM) -> Request:
        """Start combining ``x`` from every rank with ``op``; :meth:`wait` returns the result.

        Wraps ``MPI_Iallreduce``. Every rank starts the same nonblocking
        collectives in the same order (jaxcomm's program order does that).
        Arguments as for :meth:`allreduce`, but a single array, not a pytree.
        Differentiable.

        Args:
            x: array or scalar, the same shape and dtype on every rank.
            op: a predefined ``MPI.Op`` (see :meth:`allreduce`).

        Returns:
            A :class:`jaxcomm.Request`; its wait returns a new array of
            ``x``'s shape and dtype.

        Raises:
            TypeError: for a non-array ``x`` or an op MPI does not define for its dtype.
            ValueError: for a user-defined ``MPI.Op``.

        Example:
            >>> req = jc.iallreduce(grads)
            >>> loss = forward(batch)     # runs while the reduction travels
            >>> grads = jc.wait(req)
        """
        handle = self._live()
        x, code = reduction_operand(held(x, "x"), op)
        return nonblocking.start(nonblocking.iallreduce_p, x, op=code, handle=handle)

    def ireduce(self, x: ArrayLike, op: MPI.Op = MPI.SUM, root: int = 0) -> Request:
        """Start combining ``x`` from every rank with ``op`` onto ``root``; see :meth:`wait`.

        Wraps ``MPI_Ireduce``. Its wait returns what :meth:`reduce` returns:
        the reduction on root, zeros elsewhere. Arguments as for
        :meth:`reduce`, but a single array, not a pytree. Works eagerly and
        under ``jit``, in loops and conditionals, under ``vmap``;
        differentiable (the cotangent goes back as a broadcast from root, as
        :meth:`reduce`'s).

        Args:
            x: array or scalar, the same shape and dtype on every rank.
            op: a predefined ``MPI.Op`` (see :meth:`allreduce`).
            root: the rank that gets the result (a static int).

        Returns:
            A :class:`jaxcomm.Request`; its wait returns a new array of
            ``x``'s shape and dtype: the reduction on root, zeros elsewhere.

        Raises:
            TypeError: for a non-array ``x``, an op MPI does not define for its
                dtype, or a non-int or traced ``root``.
            ValueError: for a user-defined ``MPI.Op`` or a ``root`` that is not
                a rank of the communicator.
        """
        handle = self._live()
        x, code = reduction_operand(held(x, "x"), op)
        root = static_rank(root, "root", self._size)
        return nonblocking.start(nonblocking.ireduce_p, x, op=code, root=root, handle=handle)

    def iscan(self, x: ArrayLike, op: MPI.Op = MPI.SUM) -> Request:
        """Start the inclusive prefix reduction of ``x`` with ``op``; see :meth:`wait`.

        Wraps ``MPI_Iscan``. Its wait returns what :meth:`scan` returns: on
        rank ``r``, ``x_0 op x_1 op ... op x_r``. Works eagerly and under
        ``jit``, in loops and conditionals, under ``vmap``;
        differentiable with ``MPI.SUM`` (transposed as :meth:`scan`).

        Args:
            x: array or scalar, the same shape and dtype on every rank.
            op: a predefined ``MPI.Op`` (see :meth:`allreduce`).

        Returns:
            A :class:`jaxcomm.Request`; its wait returns a new array of
            ``x``'s shape and dtype.

        Raises:
            TypeError: for a non-array ``x`` or an op MPI does not define for its dtype.
            ValueError: for a user-defined ``MPI.Op``.
        """
        handle = self._live()
        x, code = reduction_operand(held(x, "x"), op)
        return nonblocking.start(nonblocking.iscan_p, x, op=code, handle=handle)

    def ibcast(self, x: ArrayLike, root: int = 0) -> Request:
        """Start broadcasting root's ``x`` to every rank; :meth:`wait` returns it.

        Wraps ``MPI_Ibcast``. Every rank passes an array of the same shape and
        dtype; only root's values are read. Differentiable.

        Args:
            x: array or scalar.
            root: the rank whose ``x`` is broadcast (a static int).

        Returns:
            A :class:`jaxcomm.Request`; its wait returns a new array holding root's ``x``.

        Raises:
            TypeError: for a non-array ``x`` or a non-int or traced ``root``.
            ValueError: if ``root`` is not a rank of the communicator.
        """
        handle = self._live()
        x = held(x, "x")
        return nonblocking.start(
            nonblocking.ibcast_p, x, root=static_rank(root, "root", self._size), handle=handle
        )

    def iallgather(self, x: ArrayLike, *, tiled: bool = False) -> Request:
        """Start collecting ``x`` from every rank on every rank; :meth:`wait` returns it.

        Wraps ``MPI_Iallgather``; the result is laid out as :meth:`allgather`'s.
        Differentiable.

        Args:
            x: array or scalar, the same shape and dtype on every rank.
            tiled: ``False`` stacks along a new leading axis, ``True``
                concatenates along ``x``'s leading axis.

        Returns:
            A :class:`jaxcomm.Request`; its wait returns the gathered array.

        Raises:
            TypeError: for a non-array ``x`` or a non-bool ``tiled``.
            ValueError: for ``tiled=True`` with a 0-d ``x``.
        """
        handle = self._live()
        tiled = static_bool(tiled, "tiled")
        x = held(x, "x")
        if tiled:
            leading_axis(x, "to concatenate along with tiled=True")
        return nonblocking.start(
            nonblocking.iallgather_p, x, size=self._size, tiled=tiled, handle=handle
        )

    def igather(self, x: ArrayLike, root: int = 0, *, tiled: bool = False) -> Request:
        """Start collecting ``x`` from every rank on ``root``; :meth:`wait` returns it.

        Wraps ``MPI_Igather``. Its wait returns what :meth:`gather` returns:
        the gathered arrays on root, zeros of the same shape elsewhere.
        Arguments as for :meth:`gather`, but a single array, not a pytree.
        Works eagerly and under ``jit``, in loops and conditionals, under
        ``vmap``; differentiable (transposed by a reverse :meth:`iscatter`
        from root, as :meth:`gather` to a scatter).

        Args:
            x: array or scalar, the same shape and dtype on every rank.
            root: the rank that receives (a static int).
            tiled: ``False`` stacks along a new leading axis, ``True``
                concatenates along ``x``'s leading axis.

        Returns:
            A :class:`jaxcomm.Request`; its wait returns the gathered array on
            root, zeros elsewhere.

        Raises:
            TypeError: for a non-array ``x``, a non-int or traced ``root`` or a
                non-bool ``tiled``.
            ValueError: for a ``root`` out of range, or ``tiled=True`` with a
                0-d ``x``.
        """
        handle = self._live()
        tiled = static_bool(tiled, "tiled")
        x = held(x, "x")
        if tiled:
            leading_axis(x, "to concatenate along with tiled=True")
        return nonblocking.start(
            nonblocking.igather_p,
            x,
            root=static_rank(root, "root", self._size),
            size=self._size,
            tiled=tiled,
            handle=handle,
        )

    def iscatter(self, x: ArrayLike, root: int = 0, *, tiled: bool = False) -> Request:
        """Start sending one piece of root's ``x`` to each rank; :meth:`wait` returns it.

        Wraps ``MPI_Iscatter``. Its wait returns what :meth:`scatter`
        returns: rank ``r`` gets piece ``r``. Arguments as for
        :meth:`scatter`; only root's values are read. Works eagerly and under
        ``jit``, in loops and conditionals, under ``vmap``; differentiable
        (transposed by a reverse :meth:`igather` on root, as :meth:`scatter`
        to a gather).

        Args:
            x: array with a leading axis of length ``size`` (``tiled=False``)
                or a multiple of ``size`` (``tiled=True``), the same shape and
                dtype on every rank.
            root: the rank whose ``x`` is scattered (a static int).
            tiled: ``False``: rank ``r`` gets ``x[r]``; ``True``: the leading
                axis is split into ``size`` equal chunks and rank ``r`` gets
                chunk ``r``.

        Returns:
            A :class:`jaxcomm.Request`; its wait returns a new array of shape
            ``x.shape[1:]``, or ``(x.shape[0] // size, *x.shape[1:])`` when
            ``tiled``.

        Raises:
            TypeError: for a non-array ``x``, a non-int or traced ``root`` or a
                non-bool ``tiled``.
            ValueError: for a ``root`` out of range, or a leading axis that
                does not fit.
        """
        handle = self._live()
        x = held(x, "x")
        tiled = static_bool(tiled, "tiled")
        check_split_rows(x, tiled, self._size)
        return nonblocking.start(
            nonblocking.iscatter_p,
            x,
            root=static_rank(root, "root", self._size),
            size=self._size,
            tiled=tiled,
            handle=handle,
        )

    def ialltoall(self, x: ArrayLike, *, tiled: bool = False) -> Request:
        """Start sending block ``r`` of ``x``'s leading axis to rank ``r``; see :meth:`wait`.

        Wraps ``MPI_Ialltoall``; blocks as in :meth:`alltoall`. Differentiable.

        Args:
            x: array with a leading axis of length ``size`` (``tiled=False``)
                or a multiple of ``size`` (``tiled=True``).
            tiled: how the leading axis splits into blocks.

        Returns:
            A :class:`jaxcomm.Request`; its wait returns a new array of ``x``'s shape and dtype.

        Raises:
            TypeError: for a non-array ``x`` or a non-bool ``tiled``.
            ValueError: for a leading axis that does not fit.
        """
        handle = self._live()
        x = held(x, "x")
        check_split_rows(x, static_bool(tiled, "tiled"), self._size)
        return nonblocking.start(nonblocking.ialltoall_p, x, handle=handle)

    def ineighbor_alltoall(self, x: ArrayLike) -> Request:
        """Start sending block ``j`` of ``x`` to ``destinations[j]``; see :meth:`wait`.

        Wraps ``MPI_Ineighbor_alltoall``; blocks and neighbours as in
        :meth:`neighbor_alltoall`, whose result the wait returns (blocks from
        ``MPI.PROC_NULL`` zeroed). So a step can compute its interior while
        its ghosts travel. Works eagerly and under ``jit``, in loops and
        conditionals, under ``vmap``; differentiable (transposed by the
        reverse exchange, a request on the reverse graph).

        Args:
            x: array of shape ``(outdegree, ...)``.

        Returns:
            A :class:`jaxcomm.Request`; its wait returns a new array of shape
            ``(indegree, ...)``.

        Raises:
            TypeError: for a communicator without a topology, or a non-array ``x``.
            ValueError: if ``x``'s leading axis is not the outdegree (on this
                rank, before any MPI call); on every rank, on an ``MPI_GRAPH``
                communicator that is not symmetric (see
                :meth:`neighbor_alltoall`).

        Example:
            >>> request = grid.ineighbor_alltoall(jnp.stack([u[0], u[-1]]))
            >>> interior = update(u[1:-1])  # while the halo travels
            >>> halo = grid.wait(request)
        """
        handle, _, destinations = self._topology()
        x = self._blocks(held(x, "x"), "destination", len(destinations))
        return nonblocking.start(nonblocking.ineighbor_alltoall_p, x, handle=handle)

    def ineighbor_allgather(self, x: ArrayLike) -> Request:
        """Start sending ``x`` to every destination; see :meth:`wait`.

        Wraps ``MPI_Ineighbor_allgather``; the wait returns what
        :meth:`neighbor_allgather` returns (blocks from ``MPI.PROC_NULL``
        zeroed). Works eagerly and under ``jit``, in loops and conditionals,
        under ``vmap``; differentiable (its transpose is the blocking
        :meth:`neighbor_allgather`'s).

        Args:
            x: array or scalar, the same shape and dtype on every rank.

        Returns:
            A :class:`jaxcomm.Request`; its wait returns a new array of shape
            ``(indegree, *x.shape)``.

        Raises:
            TypeError: for a communicator without a topology, or a non-array ``x``.
            ValueError: on every rank, on an ``MPI_GRAPH`` communicator that is
                not symmetric (see :meth:`neighbor_alltoall`).
        """
        handle, _, _ = self._topology()
        return nonblocking.start(nonblocking.ineighbor_allgather_p, held(x, "x"), handle=handle)

    def ineighbor_alltoallv(
        self,
        x: ArrayLike,
        sendcounts: Any,
        recvcounts: Any = None,
        *,
        capacity: int | None = None,
    ) -> Request:
        """Start sending blocks of rows of different sizes to the destinations; see :meth:`wait`.

        The nonblocking :meth:`neighbor_alltoallv`, with the same arguments,
        checks and neighbours' order; its wait returns what
        :meth:`neighbor_alltoallv` returns: ``(y, recvcounts)`` without
        ``recvcounts`` (learned), else ``y``. The start makes the blocking
        form's header exchange (one ``MPI_Neighbor_alltoall`` of a small
        header per edge: the rows of each block) and its checks, then starts
        the rows' ``MPI_Ineighbor_alltoallv``, which the wait completes: only
        the rows travel while the caller computes. The counts may be static
        or traced. Works eagerly and under ``jit``, in loops and
        conditionals, under ``vmap`` (counts shared by the batch);
        differentiable in ``x`` (transposed by the reverse exchange, a
        request on the reverse graph; rows sent to ``MPI.PROC_NULL`` get a
        zero cotangent, as in :meth:`neighbor_alltoallv`).

        Args:
            x: array of rows, at least ``sum(sendcounts)`` of them; the row
                shape and dtype must match on every rank.
            sendcounts: rows for each destination, ``outdegree`` entries.
            recvcounts: rows from each source, ``indegree`` entries, or None.
            capacity: static number of rows of the result (default as
                :meth:`neighbor_alltoallv`'s).

        Returns:
            A :class:`jaxcomm.Request`; its wait returns the received rows
            (and the counts received, without ``recvcounts``).

        Raises:
            TypeError: for a communicator without a topology, a non-array
                ``x`` or non-integer counts.
            ValueError: as :meth:`neighbor_alltoallv` raises it, on the same
                ranks.
            RuntimeError: raised by the start (``XlaRuntimeError``) where
                :meth:`neighbor_alltoallv` raises, on the same ranks: the
                rows still move (a failing rank receives into scratch memory
                and waits for them), so no neighbour waits and no request is
                left under way.

        Example:
            Ghost rows on a ring, ``k`` computed in the step, while the
            interior is updated:

            >>> ring = JaxComm.from_graph([(jc.rank - 1) % jc.size], [(jc.rank + 1) % jc.size])
            >>> request = ring.ineighbor_alltoallv(rows[::-1], jnp.array([k]), capacity=8)
            >>> interior = update(rows)  # while the ghosts travel
            >>> ghosts, got = ring.wait(request)
        """
        handle, sources, destinations = self._topology()
        lengths = {"sendcounts": len(destinations), "recvcounts": len(sources)}
        return _counted_exchange(
            partial(nonblocking.start_counts, neighbors=True),
            held(x, "x"),
            sendcounts,
            recvcounts,
            capacity,
            lengths,
            "neighbour",
            handle,
            started=True,
        )

    def ineighbor_allgatherv(
        self,
        x: ArrayLike,
        recvcounts: Any = None,
        *,
        sendcount: Any = None,
        capacity: int | None = None,
    ) -> Request:
        """Start sending the same rows to every destination; see :meth:`wait`.

        The nonblocking :meth:`neighbor_allgatherv`, with the same arguments,
        checks and neighbours' order; its wait returns what
        :meth:`neighbor_allgatherv` returns: ``(y, recvcounts)`` without
        ``recvcounts`` (learned), else ``y``. The start makes the blocking
        form's header exchange (one ``MPI_Neighbor_alltoall`` of a small
        header per edge) and its checks, then starts the rows'
        ``MPI_Ineighbor_allgatherv``, which the wait completes. The counts
        may be static or traced. Works eagerly and under ``jit``, in loops
        and conditionals, under ``vmap`` (counts shared by the batch);
        differentiable in ``x`` (its transpose is the blocking
        :meth:`neighbor_allgatherv`'s).

        Args:
            x: array of rows; the row shape and dtype must match on every rank.
            recvcounts: rows from each source, ``indegree`` entries, or None.
            sendcount: rows of ``x`` sent (default: all of them), static or traced.
            capacity: static number of rows of the result (default as
                :meth:`neighbor_allgatherv`'s).

        Returns:
            A :class:`jaxcomm.Request`; its wait returns the received rows
            (and the counts received, without ``recvcounts``).

        Raises:
            TypeError: for a communicator without a topology, a non-array
                ``x`` or non-integer counts.
            ValueError: on this rank, before any MPI call, as
                :meth:`neighbor_allgatherv`.
            RuntimeError: raised by the start (``XlaRuntimeError``) where
                :meth:`neighbor_allgatherv` raises, on the same ranks: the
                rows still move, so no neighbour waits and no request is left
                under way.

        Example:
            >>> request = ring.ineighbor_allgatherv(particles, sendcount=k, capacity=64)
            >>> forces = interact(particles)  # while the neighbours' particles travel
            >>> near, got = ring.wait(request)
        """
        handle, sources, _ = self._topology()
        return _gathered_exchange(
            nonblocking.start_gathered,
            held(x, "x"),
            sendcount,
            recvcounts,
            capacity,
            len(sources),
            handle,
            started=True,
        )

    def ialltoallv(
        self,
        x: ArrayLike,
        sendcounts: Any,
        recvcounts: Any = None,
        *,
        capacity: int | None = None,
    ) -> Request:
        """Start exchanging blocks of rows of different sizes between every pair of ranks.

        The nonblocking :meth:`alltoallv`, in its forms by this rank's counts;
        the wait returns what :meth:`alltoallv` returns. ``sendcounts[j]`` is
        the number of rows this rank sends to rank ``j`` (its blocks one
        after another in ``x``) and ``recvcounts[i]`` the number it receives
        from rank ``i``, which must be rank ``i``'s ``sendcounts`` entry for
        this rank.

        - ``ialltoallv(x, sendcounts, recvcounts)`` with both counts static
          (sequences of ints) and no ``capacity``: wraps ``MPI_Ialltoallv``
          alone; ``x`` has exactly ``sum(sendcounts)`` rows and the wait
          returns the ``sum(recvcounts)`` rows received.
        - Otherwise the counts may be traced (computed inside ``jit``), as in
          :meth:`alltoallv`'s first two forms: the start exchanges the
          counts with one ``MPI_Alltoall`` (short, blocking) and checks them
          as :meth:`alltoallv` does, then starts the rows' ``MPI_Ialltoallv``,
          which the wait completes; only the rows travel while the caller
          computes. Without ``recvcounts`` the wait returns ``(y,
          recvcounts)``, ``y`` of ``capacity`` rows (default: ``x``'s), the
          received blocks first and zeros after them; with ``recvcounts`` it
          returns ``y`` alone (``capacity`` by default ``sum(recvcounts)``
          for static ``recvcounts``, ``x``'s rows for traced ones).

        Works eagerly and under ``jit``, in loops and conditionals, under
        ``vmap`` (counts shared by the batch); differentiable (transposed by
        the reverse exchange, a request again).

        Args:
            x: array of rows, trailing dimensions and dtype the same on
                every rank.
            sendcounts: this rank's row counts per destination.
            recvcounts: this rank's row counts per source, or None.
            capacity: static number of rows of the result.

        Returns:
            A :class:`jaxcomm.Request`; its wait returns the received rows
            (and the counts received, without ``recvcounts``; see above).

        Raises:
            TypeError: for a non-array ``x`` or non-integer counts.
            ValueError: for counts without one entry per rank, negative
                static counts, or static counts that do not fit ``x`` or
                ``capacity``.
            RuntimeError: raised by the kernel (``XlaRuntimeError``) as for
                :meth:`alltoallv`: for traced counts that are negative or do
                not fit ``x``, by the start on every rank, nothing
                exchanged; for received rows that overflow ``capacity`` or
                differ from ``recvcounts``, by the wait on the receiving rank
                (``docs/irregular.md``).

        Example:
            With 2 ranks, where rank 0 sends 1 row to itself and 2 to rank 1,
            and rank 1 sends 3 rows to rank 0 and none to itself:

            >>> counts = [[1, 2], [3, 0]]
            >>> received = [row[jc.rank] for row in counts]
            >>> x = jnp.full(sum(counts[jc.rank]), jc.rank)
            >>> jc.wait(jc.ialltoallv(x, counts[jc.rank], received))
            Array([0, 1, 1, 1], dtype=int32)   # on rank 0; [0, 0] on rank 1
            >>> request = jc.ialltoallv(jnp.full(4, jc.rank), jnp.asarray(counts[jc.rank]))
            >>> jc.wait(request)  # counts learned, capacity of x's 4 rows
            (Array([0, 1, 1, 1], dtype=int32), Array([1, 3], dtype=int32))  # on rank 0
        """
        handle = self._live()
        x = held(x, "x")
        static = recvcounts is not None and capacity is None
        static = static and _concrete(sendcounts) is not None and _concrete(recvcounts) is not None
        if not static:
            return _counted_exchange(
                nonblocking.start_counts,
                x,
                sendcounts,
                recvcounts,
                capacity,
                self._size,
                "rank",
                handle,
                started=True,
            )
        send = static_counts(sendcounts, "sendcounts", self._size)
        recv = static_counts(recvcounts, "recvcounts", self._size)
        own = leading_axis(x, "of sum(sendcounts) rows")
        if own != sum(send):
            raise ValueError(
                f"x has {own} rows on rank {self._rank}, but sendcounts adds up to {sum(send)}"
            )
        return nonblocking.start(
            nonblocking.ialltoallv_p, x, sendcounts=send, recvcounts=recv, handle=handle
        )

    def iragged_all_to_all(
        self,
        operand: ArrayLike,
        output: ArrayLike,
        input_offsets: ArrayLike,
        send_sizes: ArrayLike,
        output_offsets: ArrayLike,
        recv_sizes: ArrayLike,
        *,
        axis_name: str | tuple[str, ...] | None = None,
        axis_index_groups: Any = None,
    ) -> Request:
        """Start :meth:`ragged_all_to_all`; see :meth:`wait`, which returns its result.

        Same arguments (``axis_name`` and ``axis_index_groups`` too), checks
        and errors as :meth:`ragged_all_to_all`; the index arrays may be
        traced. The start makes the small exchange of
        where each slice goes (``MPI_Alltoall``, blocking) and its checks,
        then starts the rows' ``MPI_Ialltoallv``; the wait completes it and
        returns ``output`` with the received slices written in. So the rows
        travel while the caller computes (use :meth:`during` to tie that
        computation in between inside ``jit``). Works eagerly and under
        ``jit``, in loops and conditionals, under ``vmap`` (index arrays
        shared by the batch), and differentiable in ``operand`` and
        ``output``: transposed by the reverse exchange, a request again.

        Args:
            operand: array of rows to send from.
            output: array of rows that received slices are written into.
            input_offsets: integer array of shape ``(size,)``.
            send_sizes: integer array of shape ``(size,)``.
            output_offsets: integer array of shape ``(size,)``.
            recv_sizes: integer array of shape ``(size,)``.
            axis_name: as :meth:`ragged_all_to_all`'s.
            axis_index_groups: None, as :meth:`ragged_all_to_all`'s.

        Returns:
            A :class:`jaxcomm.Request`; its wait returns a new array shaped
            like ``output``.

        Raises:
            TypeError: as :meth:`ragged_all_to_all`.
            ValueError: as :meth:`ragged_all_to_all`.
            NotImplementedError: as :meth:`ragged_all_to_all`.
            RuntimeError: raised by the kernel (``XlaRuntimeError``): by the
                start on every rank, nothing moved, where
                :meth:`ragged_all_to_all` raises before anything moves; by
                the wait, on the receiving rank, where it raises after the
                exchange (``docs/irregular.md``).

        Example:
            ``jax.lax.ragged_all_to_all``'s own example, on 2 ranks, with
            the interior computed while the rows travel:

            >>> args = [  # operand, output, input_offsets, send_sizes, output_offsets, recv_sizes
            ...     ([1, 2, 2], [0, 0, 0, 0], [0, 1], [1, 2], [0, 0], [1, 1]),
            ...     ([3, 4, 0], [0, 0, 0, 0], [0, 1], [1, 1], [1, 2], [2, 1]),
            ... ][jc.rank]
            >>> request = jc.iragged_all_to_all(*map(jnp.asarray, args))
            >>> interior = update(u)  # while the rows travel
            >>> jc.wait(request)
            Array([1, 3, 0, 0], dtype=int32)   # on rank 0; [2, 2, 4, 0] on rank 1
        """
        handle = self._live()
        mesh_axis_name(axis_name, axis_index_groups, self.mesh_axes, "iragged_all_to_all")
        operand, output = rows_arrays(held(operand, "operand"), output)
        indices = index_arrays(
            {
                "input_offsets": input_offsets,
                "send_sizes": send_sizes,
                "output_offsets": output_offsets,
                "recv_sizes": recv_sizes,
            },
            self._size,
        )
        return nonblocking.start(
            nonblocking.iragged_all_to_all_p,
            operand,
            output,
            jnp.stack(indices),
            reverse=0,
            handle=handle,
        )

    def during(self, requests: Sequence[Request], fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` while ``requests`` are under way, and return its result.

        Inside a traced function XLA orders work only by data, not by the
        order of the Python code: it may run a computation before the starts
        it was written after, or after the waits, and then nothing overlaps.
        ``during`` ties ``fn`` in between, with no data moved: its inputs
        depend on the starts of ``requests`` (``MPI_Isend``, ``MPI_Irecv``,
        ``MPI_I*``) and their waits on its outputs. Eagerly it just calls ``fn``.

        Args:
            requests: the :class:`jaxcomm.Request` objects to overlap with
                (not waited yet).
            fn: the computation; its arguments and results are pytrees of arrays.
            *args: positional arguments of ``fn``.
            **kwargs: keyword arguments of ``fn``.

        Returns:
            ``fn(*args, **kwargs)``.

        Raises:
            TypeError: an entry of ``requests`` is not a Request.
            RuntimeError: a request was waited already.

        Example:
            >>> reqs = [jc.irecv(halo, source=left), jc.isend(edge, dest=right)]
            >>> interior = jc.during(reqs, update_interior, u)
            >>> halo, _ = jc.waitall(reqs)
        """
        return nonblocking.during(sequence(requests, "requests"), fn, *args, **kwargs)

    def wait(self, request: Request) -> Any:
        """Complete a nonblocking operation and return its result.

        Wraps ``MPI_Wait``. Returns the received array (``irecv``), the
        collective's result (``iallreduce``, ``ireduce``, ``iscan``,
        ``ibcast``, ``iallgather``, ``igather``, ``iscatter``, ``ialltoall``,
        ``ialltoallv``, ``ineighbor_alltoall``, ``ineighbor_allgather``,
        ``ineighbor_alltoallv``, ``ineighbor_allgatherv``,
        ``iragged_all_to_all``; ``(y, recvcounts)`` for ``ialltoallv``,
        ``ineighbor_alltoallv`` and ``ineighbor_allgatherv`` without
        ``recvcounts``) or None (``isend``). Waits are ordered with
        every other jaxcomm call, in program order. Each request is waited exactly once,
        in the traced function (loop body, cond branch) that started it, or
        eagerly for a request started eagerly.

        Args:
            request: a :class:`jaxcomm.Request` from a method of any ``JaxComm``.

        Returns:
            The operation's result, or None for a send.

        Raises:
            TypeError: ``request`` is not a Request.
            RuntimeError: the request was waited already, or is waited outside
                the traced function that started it (a compiled function
                that breaks the rule raises when it is lowered).
        """
        return nonblocking.wait(request)

    def waitall(self, requests: Sequence[Request]) -> list[jax.Array | None]:
        """Complete several nonblocking operations, in order, and return their results.

        Wraps ``MPI_Wait`` once per request (an ``MPI_Waitall``, in the order
        given). See :meth:`wait`.

        Args:
            requests: a sequence of :class:`jaxcomm.Request`.

        Returns:
            The list of results (None for sends), in the order of ``requests``.

        Raises:
            TypeError: ``requests`` is not a sequence of Requests.
            RuntimeError: as :meth:`wait`.
        """
        items = sequence(requests, "requests")
        for item in items:
            if not isinstance(item, Request):
                raise TypeError(f"waitall takes jaxcomm Requests, got {type(item).__name__}")
        return [nonblocking.wait(item) for item in items]

    # Synchronisation ---------------------------------------------------------

    @staticmethod
    def sync() -> None:
        """Wait until every dispatched jaxcomm operation has finished (see ``jaxcomm.sync``)."""
        sync()


def _row_major(index: list[int], sizes: list[int]) -> int:
    """The position of ``index`` in a row-major grid of ``sizes`` (0 for no axes)."""
    return int(np.ravel_multi_index(index, sizes)) if sizes else 0


def _neighbor_lists(comm: MPI.Intracomm) -> tuple[list[int], list[int]] | None:
    """``(sources, destinations)`` of a ``comm`` with a topology, in MPI's order (None without one)."""
    topology = comm.Get_topology()
    if topology == MPI.DIST_GRAPH:
        sources, destinations, _ = comm.Get_dist_neighbors()
        return list(sources), list(destinations)
    if topology == MPI.CART:
        # Per dimension, the neighbour at -1 then the one at +1 (MPI 4.1, 8.6).
        ranks = [rank for d in range(comm.Get_dim()) for rank in comm.Shift(d, 1)]
        return ranks, ranks
    if topology == MPI.GRAPH and _asymmetric_graph(comm) is None:
        # Its neighbours are both sources and destinations (MPI 4.1, 8.6).
        ranks = list(comm.Get_neighbors(comm.Get_rank()))
        return ranks, ranks
    return None


def _asymmetric_graph(comm: MPI.Graphcomm) -> str | None:
    """Why MPI leaves neighbourhood collectives on the graph ``comm`` undefined, or None.

    MPI 4.1, 8.6 defines them on an MPI_GRAPH only where every pair of
    ranks lists each other equally often. Every rank holds the whole graph,
    so every rank finds the same answer without a message.
    """
    ends, edges = comm.Get_topo()
    listed = Counter()
    start = 0
    for node, end in enumerate(ends):
        listed.update((node, int(neighbor)) for neighbor in edges[start:end])
        start = end
    for (a, b), times in sorted(listed.items()):
        if listed[b, a] != times:
            return (
                f"rank {a} lists rank {b} {times} times among its neighbours, "
                f"but rank {b} lists rank {a} {listed[b, a]} times"
            )
    return None


def _check_graph(comm: MPI.Intracomm, sources: list[int], destinations: list[int]) -> None:
    """Raise on every rank unless every edge is in its sender's and its receiver's lists alike.

    One MPI_Alltoall of edge counts (size entries per rank, once).
    """
    size = comm.Get_size()
    bad = [r for r in (*sources, *destinations) if not 0 <= r < size]
    if bad:
        reason = f"rank {bad[0]} is not a rank of comm (size {size})"
    else:
        sent = np.bincount(np.asarray(destinations, np.int64), minlength=size)
        received = np.bincount(np.asarray(sources, np.int64), minlength=size)
        told = np.array(comm.alltoall(sent.tolist()))
        wrong = np.nonzero(told != received)[0]
        reason = None
        if wrong.size:
            r = int(wrong[0])
            reason = (
                f"rank {r} lists rank {comm.Get_rank()} {told[r]} times among its destinations, "
                f"but rank {comm.Get_rank()} lists it {received[r]} times among its sources"
            )
    if bad:
        # The others still make the exchange above; a rank with ranks out
        # of range joins it with the edge counts it can make.
        comm.alltoall([0] * size)
    reasons = comm.allgather(reason)
    failed = [(r, why) for r, why in enumerate(reasons) if why is not None]
    if failed:
        r, why = failed[0]
        raise ValueError(f"sources and destinations do not describe one graph: on rank {r}, {why}")


def _concrete(counts: Any) -> np.ndarray | None:
    """``counts`` as a NumPy array where they are known before the call runs, else None."""
    if any(isinstance(c, jax.core.Tracer) for c in jax.tree_util.tree_leaves(counts)):
        return None
    return np.asarray(counts)


def _counted_exchange(
    bind, x, sendcounts, recvcounts, capacity, lengths, per, handle, *, started=False
):
    """An exchange of rows by this rank's counts (``alltoallv``, ``neighbor_alltoallv``, ``ialltoallv``).

    Checks the counts (one per ``per``; ``lengths`` as :func:`index_arrays`
    takes it), picks the capacity, and binds ``bind`` with a zero output of
    that many rows. Returns the received rows, and the counts received when
    ``recvcounts`` is None (they are learned); ``started``: what ``bind``
    returns (a request).
    """
    rows = leading_axis(x, "of rows")
    learn = recvcounts is None
    if learn:
        (send,), recv = index_arrays({"sendcounts": sendcounts}, lengths, per), None
    else:
        send, recv = index_arrays(
            {"sendcounts": sendcounts, "recvcounts": recvcounts}, lengths, per
        )
    static = _concrete(sendcounts), None if learn else _concrete(recvcounts)
    if static[0] is not None:
        _check_static_counts("sendcounts", static[0], rows, "x's rows")
    if capacity is None:
        capacity = rows if learn or static[1] is None else int(sum(static[1]))
    capacity = static_int(capacity, "capacity")
    if capacity < 0:
        raise ValueError(f"capacity={capacity} is negative")
    if static[1] is not None:
        _check_static_counts("recvcounts", static[1], capacity, "the capacity")
    output = jnp.zeros((capacity, *x.shape[1:]), x.dtype)
    if started:
        return bind(x, output, send, recv, handle=handle)
    y, received = bind(x, output, send, recv, handle=handle)
    return (y, received) if learn else y


def _gathered_exchange(
    bind, x, sendcount, recvcounts, capacity, indegree, handle, *, started=False
):
    """An exchange of this rank's first ``sendcount`` rows to every destination (``neighbor_allgatherv``).

    Checks the counts, picks the capacity and binds ``bind`` with a zero
    output of that many rows, as :func:`_counted_exchange`.
    """
    rows = leading_axis(x, "of rows")
    send = _sendcount(sendcount, rows)
    learn = recvcounts is None
    recv = None
    if not learn:
        (recv,) = index_arrays({"recvcounts": recvcounts}, {"recvcounts": indegree}, "neighbour")
    static = None if learn else _concrete(recvcounts)
    if static is not None:
        _check_static_counts("recvcounts", static, int(static.sum()), "their sum")
    if capacity is None:
        capacity = indegree * rows if static is None else int(static.sum())
    capacity = static_int(capacity, "capacity")
    if capacity < 0:
        raise ValueError(f"capacity={capacity} is negative")
    if static is not None:
        _check_static_counts("recvcounts", static, capacity, "the capacity")
    output = jnp.zeros((capacity, *x.shape[1:]), x.dtype)
    if started:
        return bind(x, output, send, recv, handle=handle)
    y, received = bind(x, output, send, recv, handle=handle)
    return (y, received) if learn else y


def _sendcount(sendcount: Any, rows: int) -> Any:
    """``sendcount`` as an int32 scalar where it is known (checked against ``rows``), else the traced scalar."""
    if sendcount is None:
        return np.int32(rows)
    if isinstance(sendcount, bool):
        raise TypeError("sendcount must be an integer, got bool")
    try:
        value = sendcount if isinstance(sendcount, jax.core.Tracer) else np.asarray(sendcount)
    except TypeError:
        raise TypeError(f"sendcount must be an integer, got {sendcount!r}") from None
    if not jnp.issubdtype(value.dtype, jnp.integer):
        raise TypeError(f"sendcount must be an integer, got {value.dtype}")
    if value.shape != ():
        raise ValueError(f"sendcount must be one integer, got shape {value.shape}")
    if isinstance(value, jax.core.Tracer):
        return value
    count = int(value)
    if count < 0:
        raise ValueError(f"sendcount={count} is negative")
    if count > rows:
        raise ValueError(f"sendcount={count} is more than x's rows ({rows})")
    return np.asarray(count, value.dtype if value.dtype == np.int64 else np.int32)


def _check_static_counts(name: str, counts: np.ndarray, rows: int, what: str) -> None:
    for i, count in enumerate(counts.tolist()):
        if count < 0:
            raise ValueError(f"{name}[{i}]={count} is negative")
    if counts.sum() > rows:
        raise ValueError(f"{name} add up to {counts.sum()} rows, more than {what} ({rows})")
