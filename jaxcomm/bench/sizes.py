"""Message sizes: the default sets, and sizes as people write and read them."""

from __future__ import annotations

import argparse
import re

KIB, MIB = 1 << 10, 1 << 20
# 8 B to 64 MiB, a factor 8 apart.
DEFAULT_SIZES = (8, 64, 512, 4 * KIB, 32 * KIB, 256 * KIB, 2 * MIB, 16 * MIB, 64 * MIB)
QUICK_SIZES = (8, 1 * MIB)


def format_size(nbytes: int) -> str:
    """``nbytes`` as B, KiB or MiB."""
    for unit, scale in (("MiB", MIB), ("KiB", KIB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def parse_size(text: str) -> int:
    """``"8"``, ``"4K"``, ``"4KiB"``, ``"64M"`` or ``"1MiB"`` as a number of bytes."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (for example 8, 4K, 64MiB)")
    scale = {"": 1, "K": KIB, "M": MIB, "G": 1 << 30}[match.group(2).upper()]
    return int(match.group(1)) * scale


def sizes_between(low: int, high: int) -> list[int]:
    """Powers of 8 times ``low`` up to ``high``, and ``high`` itself."""
    sizes = []
    size = low
    while size < high:
        sizes.append(size)
        size *= 8
    return sizes + [high]
