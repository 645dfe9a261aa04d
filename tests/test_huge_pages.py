"""Large host buffers are advised onto transparent huge pages (kernels/memory.cc).

What is checked is the advice itself, the ``hg`` flag Linux shows in
``/proc/self/smaps`` for a range given ``MADV_HUGEPAGE``: whether the kernel
then finds free huge pages depends on the machine's memory, not on jaxcomm.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomm import _malloc, _runtime

MIB = 1 << 20
# Above the mmap threshold jaxcomm sets, so that glibc's main heap does not
# serve these buffers (another arena's may still hand out memory that an
# earlier call advised: see the test).
NBYTES = _malloc.MMAP_THRESHOLD + 8 * MIB
_RANGE = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) ")


def _huge_page_size():
    """The transparent huge page size where the kernel offers them for madvise, else 0."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                return 0
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            return int(f.read())
    except OSError:
        return 0


def _vm_flags(address):
    """The VmFlags of the mapping that holds ``address``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            match = _RANGE.match(line)
            if match:
                inside = int(match[1], 16) <= address < int(match[2], 16)
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def _advised(result, huge):
    start = result.unsafe_buffer_pointer()
    return "hg" in _vm_flags((start + huge - 1) // huge * huge)


@pytest.fixture
def huge_page_bytes():
    before = _runtime._kernels_cpu.huge_page_bytes()
    yield
    _runtime._kernels_cpu.set_huge_page_bytes(before)


def _fresh(jc):
    """A host buffer of XLA's own (NumPy's arrays are advised by NumPy itself).

    On the CPU device also where JAX's default device is a GPU: the advice
    is for host memory.
    """
    cpu = jax.devices("cpu")[0]
    return jnp.full(NBYTES // 4, jc.rank + 1, jnp.float32, device=cpu).block_until_ready()


@pytest.mark.mpi
@pytest.mark.skipif(not hasattr(_runtime._kernels_cpu, "huge_page_bytes"), reason="not built")
def test_large_buffers_are_advised_onto_huge_pages(jc, huge_page_bytes):
    huge = _huge_page_size()
    assert _runtime._kernels_cpu.huge_page_bytes() == 4 * MIB
    step = jax.jit(lambda v: jc.allreduce(v))
    total = np.full(3, jc.size * (jc.size + 1) / 2, np.float32)
    x = _fresh(jc)
    y = step(x).block_until_ready()
    np.testing.assert_array_equal(y[:3], total)
    # The argument MPI read and the result it wrote; where Linux has no huge
    # pages to offer, madvise fails and nothing is advised. The kernels' own
    # account says which: no page size seen, no call made, or refusals.
    advice = _runtime._kernels_cpu.huge_page_advice()
    assert huge == 0 or (_advised(x, huge) and _advised(y, huge)), advice
    assert advice["page_size"] == huge, advice
    assert huge == 0 or advice["advised"] >= 2, advice
    del x, y
    # Off, and with a threshold above the buffers' size, the argument's pages
    # stay as they were. (Only the argument's can be looked at before the
    # call; malloc may hand out memory advised by an earlier call again.)
    for setting in (0, NBYTES + 1):
        _runtime._kernels_cpu.set_huge_page_bytes(setting)
        x = _fresh(jc)
        before = huge and _advised(x, huge)
        y = step(x).block_until_ready()
        np.testing.assert_array_equal(y[:3], total)
        assert (huge and _advised(x, huge)) == before, setting
        del x, y


@pytest.mark.mpi
@pytest.mark.skipif(not hasattr(_runtime._kernels_cpu, "huge_page_bytes"), reason="not built")
def test_the_ends_of_a_buffer_used_again_are_advised(jc, huge_page_bytes):
    # XLA's buffers start at any 64-byte boundary, so the huge pages that
    # hold a buffer's ends hold its neighbours' memory too. They are advised
    # once the same buffer comes to the kernels again (here a kept argument,
    # as a loop's carry is), and only below 16 MiB.
    huge = _huge_page_size()
    if huge == 0:
        pytest.skip("no transparent huge pages for madvise on this machine")
    step = jax.jit(lambda v: jc.allreduce(v))
    cpu = jax.devices("cpu")[0]
    x = jnp.full((4 * MIB + 8192) // 4, 1.0, jnp.float32, device=cpu).block_until_ready()
    begin = x.unsafe_buffer_pointer()
    end = begin + x.nbytes
    first = _runtime._kernels_cpu.huge_page_advice()["advised_ends"]
    step(x).block_until_ready()
    once = _runtime._kernels_cpu.huge_page_advice()["advised_ends"]
    for _ in range(2):
        np.testing.assert_array_equal(step(x).block_until_ready()[:3], jc.size)
    advice = _runtime._kernels_cpu.huge_page_advice()
    ends = (begin % huge != 0) + (end % huge != 0)
    # The first call advises no end of x (its result's ends may be, where
    # XLA put it where a recent buffer was); the calls after it advise both.
    assert advice["advised_ends"] - once >= ends, (first, once, advice)
    assert "hg" in _vm_flags(begin) and "hg" in _vm_flags(end - 1), advice
