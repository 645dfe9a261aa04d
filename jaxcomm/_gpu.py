"""jaxcomm on CUDA GPUs: which data path device buffers take, and one GPU per rank.

Device buffers reach MPI in one of two ways, chosen for every call:

- *CUDA-aware*: the device pointers go straight to MPI, after XLA's stream
  has finished the work that produced them. Used when the MPI library says it
  supports CUDA, or when ``JAXCOMM_CUDA_AWARE=1`` (or :func:`set_cuda_aware`)
  says so.
- *Host staging*: the bytes are copied on XLA's stream to pinned host memory
  that jaxcomm allocates once and reuses, and back. Always used for
  reductions with jaxcomm's own MPI ops (float16 and bfloat16, and MIN/MAX of
  floating types), whose functions run on the host.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess

import jax
from mpi4py import MPI

from . import _compat, _runtime

_override: tuple[bool, str] | None = None  # (enabled, who set it)


def apply_data_path(enabled: bool | None, source: str) -> None:
    """Set the data path as set_cuda_aware() does; ``source`` names who set it in cuda_info()."""
    global _override
    _override = None if enabled is None else (bool(enabled), source)
    _runtime.set_cuda_aware_mode(-1 if enabled is None else int(bool(enabled)))


def set_cuda_aware(enabled: bool | None) -> None:
    """Choose the data path of arrays in GPU memory from now on.

    Args:
        enabled: ``True`` hands device pointers straight to MPI (the MPI
            library must be CUDA-aware, or it reads device memory as host
            memory and crashes), ``False`` stages through pinned host memory,
            ``None`` goes back to what the MPI library says about itself.

    Raises:
        TypeError: ``enabled`` is not ``True``, ``False`` or ``None``.
    """
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"enabled must be True, False or None, got {enabled!r}")
    apply_data_path(enabled, "set_cuda_aware()")


def cuda_info() -> dict:
    """Say whether jaxcomm can use GPUs and which data path device arrays take.

    Calling it initialises JAX's backends (to count the GPUs), so call
    :func:`bind_local_gpu` first if you use it.

    Returns:
        A dict with ``built`` (jaxcomm's CUDA kernels are installed), ``gpus``
        (CUDA devices JAX sees in this process), ``mpi_cuda_support``
        (``True``/``False`` as the MPI library reports, ``None`` if it cannot
        say), ``cuda_aware`` (device pointers go straight to MPI),
        ``path`` (``"cuda-aware"``, ``"host staging"``, or ``None`` without
        CUDA kernels), ``reason`` (why, in words) and ``staging_bytes``
        (pinned host memory held for staging).
    """
    kernels = _runtime.load_cuda_kernels()
    try:
        gpus = len(jax.devices("cuda"))
    except RuntimeError:
        gpus = 0
    if kernels is None:
        return {
            "built": False,
            "gpus": gpus,
            "mpi_cuda_support": None,
            "cuda_aware": False,
            "path": None,
            "reason": NO_CUDA_KERNELS,
            "staging_bytes": 0,
        }
    support = {1: True, 0: False}.get(kernels.mpi_cuda_support())
    aware = bool(kernels.cuda_aware())
    if _override is not None:
        reason = f"set by {_override[1]}"
    elif support is None:
        reason = (
            "the MPI library cannot say whether it is CUDA-aware; set JAXCOMM_CUDA_AWARE=1 if it is"
        )
    else:
        reason = f"the MPI library reports that it is {'' if support else 'not '}CUDA-aware"
    if aware:
        reason += (
            "; float16/bfloat16 reductions and MIN/MAX of floating types still stage "
            "through the host"
        )
    return {
        "built": True,
        "gpus": gpus,
        "mpi_cuda_support": support,
        "cuda_aware": aware,
        "path": "cuda-aware" if aware else "host staging",
        "reason": reason,
        "staging_bytes": int(kernels.staging_bytes()),
    }


NO_CUDA_KERNELS = (
    "this jaxcomm was built without its CUDA kernels: reinstall it on a machine with the "
    "CUDA toolkit (nvcc on PATH, or in /usr/local/cuda), for example "
    "'JAXCOMM_CUDA=ON pip install --force-reinstall --no-deps --no-cache-dir jaxcomm' "
    "from the jaxcomm source tree"
)


def _gpu_count() -> int:
    """NVIDIA GPUs on this node, found without initialising CUDA in this process."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            listing = subprocess.run(
                [smi, "-L"], capture_output=True, text=True, timeout=30, check=True
            ).stdout
            return sum(line.startswith("GPU ") for line in listing.splitlines())
        except (OSError, subprocess.SubprocessError):
            pass
    return len(glob.glob("/proc/driver/nvidia/gpus/*"))


def bind_local_gpu(comm: MPI.Comm | None = None) -> int:
    """Give each rank of a node its own GPU: node-local rank r uses GPU r % n.

    Call it on every rank of ``comm`` (it is collective: it splits ``comm``
    by node with ``MPI.COMM_TYPE_SHARED``), right after importing jaxcomm and
    before JAX initialises its backends. It sets ``CUDA_VISIBLE_DEVICES`` to
    that one GPU, chosen among those ``CUDA_VISIBLE_DEVICES`` already lists,
    if set. When there are more ranks than GPUs on a node, ranks share GPUs;
    JAX would then preallocate 75% of a GPU's memory in every process, so
    unless ``XLA_PYTHON_CLIENT_PREALLOCATE`` or
    ``XLA_PYTHON_CLIENT_MEM_FRACTION`` is set, this sets
    ``XLA_PYTHON_CLIENT_PREALLOCATE=false``.

    Args:
        comm: the ranks to spread over the node's GPUs (default
            ``MPI.COMM_WORLD``).

    Returns:
        The GPU this rank uses, as numbered before the call (an index into
        the previous ``CUDA_VISIBLE_DEVICES`` list, if that was set).

    Raises:
        TypeError: ``comm`` is not an mpi4py communicator.
        ValueError: ``comm`` is ``MPI.COMM_NULL`` (such as a freed one).
        RuntimeError: JAX's backends are already initialised (any
            ``jax.devices()``, array creation or jitted call before this one
            does that), or this node has no NVIDIA GPU.

    Example:
        >>> import jaxcomm
        >>> gpu = jaxcomm.bind_local_gpu()
        >>> import jax.numpy as jnp  # arrays now live on this rank's GPU
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    if not isinstance(comm, MPI.Comm):
        raise TypeError(f"comm must be an mpi4py communicator, got {type(comm).__name__}")
    if comm == MPI.COMM_NULL:
        raise ValueError("comm must be a live communicator, got MPI.COMM_NULL (freed or null)")
    # Every rank takes part in the split before any of them can fail, so a
    # failure on some ranks never leaves the others waiting in it.
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        local_rank, local_size = node.Get_rank(), node.Get_size()
    finally:
        node.Free()
    if _compat.backends_initialized():
        raise RuntimeError(
            "jaxcomm.bind_local_gpu() was called after JAX initialised its backends, when "
            "the GPUs JAX uses can no longer change. Call it right after importing jaxcomm, "
            "before anything creates an array, calls jax.devices() or runs a jitted function."
        )
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        gpus = [entry.strip() for entry in visible.split(",") if entry.strip()]
    else:
        gpus = [str(i) for i in range(_gpu_count())]
    if not gpus:
        raise RuntimeError(
            "jaxcomm.bind_local_gpu(): no NVIDIA GPU found on this node"
            + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else "")
        )
    index = local_rank % len(gpus)
    os.environ["CUDA_VISIBLE_DEVICES"] = gpus[index]
    if local_size > len(gpus) and not (
        "XLA_PYTHON_CLIENT_PREALLOCATE" in os.environ
        or "XLA_PYTHON_CLIENT_MEM_FRACTION" in os.environ
    ):
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    return index


_env = os.environ.get("JAXCOMM_CUDA_AWARE", "").strip()
if _env:
    if _env not in ("0", "1"):
        raise ValueError(f"JAXCOMM_CUDA_AWARE must be 0 or 1, got {_env!r}")
    apply_data_path(_env == "1", "JAXCOMM_CUDA_AWARE")
