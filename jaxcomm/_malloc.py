"""How much freed memory glibc's malloc keeps for the next jitted call.

A jitted call returns its result in a fresh buffer from XLA, and MPI's
reductions allocate a temporary of the message's size. Once both are freed,
glibc's malloc can find more free memory at the top of its heap than its trim
threshold and hand it back to Linux; the next call then gets new pages, and
pays one page fault and one zeroed page per 4 KiB of its buffers (a jitted
1 MiB ``allreduce`` on 2 ranks: 100 to 350 faults per call, where a jitted
``x + 1`` of the same size has 1 to 4 and mpi4py on preallocated arrays none).
Whether it happens depends on what the program allocated before, so it comes
and goes from run to run.

At import jaxcomm therefore asks glibc to keep ``JAXCOMM_MALLOC_PAD`` bytes
(64 MiB by default) at the top of its heap when it trims, and to take every
allocation below 32 MiB (the largest threshold glibc would pick itself) from
the heap rather than from a mapping of its own. Messages up to tens of
MiB then reuse the same pages call after call. ``JAXCOMM_MALLOC_PAD=0``
leaves malloc as it is, and so does any malloc setting of the user's own
(``MALLOC_TOP_PAD_``, ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``,
or ``glibc.malloc`` tunables in ``GLIBC_TUNABLES``). Other C libraries
(musl, macOS) are left alone.
"""

from __future__ import annotations

import ctypes
import os

DEFAULT_PAD = 64 << 20
# glibc's largest dynamic mmap threshold on 64-bit systems (4 * 1024 * 1024 *
# sizeof(long)): setting the pad freezes the dynamic threshold, so it is set
# to the value glibc would grow it to.
MMAP_THRESHOLD = 32 << 20

_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3

_USER_SETTINGS = ("MALLOC_TOP_PAD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
_USER_TUNABLES = (
    "glibc.malloc.top_pad",
    "glibc.malloc.mmap_threshold",
    "glibc.malloc.trim_threshold",
)


def _glibc():
    """The C library's functions if it is glibc, else None."""
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") else None


def user_settings(environ=os.environ) -> list[str]:
    """The malloc settings of the user's own in ``environ``, which jaxcomm leaves as they are."""
    found = [name for name in _USER_SETTINGS if name in environ]
    tunables = environ.get("GLIBC_TUNABLES", "")
    found += [t for t in _USER_TUNABLES if t in tunables]
    return found


def in_effect(pad: int, environ=os.environ) -> dict:
    """The malloc settings a process runs with, for a benchmark's record.

    Args:
        pad: what :func:`keep_freed_memory` returned at import.

    Returns:
        ``jaxcomm_pad`` and ``jaxcomm_mmap_threshold``, the bytes jaxcomm set
        (0 where it left malloc as it is), and ``user``, the user's own
        settings from ``environ`` with their values: the ``MALLOC_*``
        variables above, and ``GLIBC_TUNABLES`` where it sets any
        ``glibc.malloc`` tunable (``hugetlb`` too, which jaxcomm does not
        yield to but which moves buffers all the same).
    """
    user = {name: environ[name] for name in _USER_SETTINGS if name in environ}
    if "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        user["GLIBC_TUNABLES"] = environ["GLIBC_TUNABLES"]
    return {
        "jaxcomm_pad": pad,
        "jaxcomm_mmap_threshold": MMAP_THRESHOLD if pad else 0,
        "user": user,
    }


def keep_freed_memory(pad: int | None) -> int:
    """Apply the setting at import; the bytes glibc now keeps (0: malloc left as it is).

    Args:
        pad: ``JAXCOMM_MALLOC_PAD``'s bytes, or None where it is not set.
    """
    if pad is None:
        pad = DEFAULT_PAD
    if pad < 0:
        raise ValueError(f"JAXCOMM_MALLOC_PAD must be 0 or a number of bytes, got {pad}")
    if pad == 0 or user_settings():
        return 0
    libc = _glibc()
    if libc is None:
        return 0
    pad = min(pad, 2**31 - 1)  # mallopt takes an int
    if libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1:
        return 0
    return pad if libc.mallopt(_M_TOP_PAD, pad) == 1 else 0
