"""GPU class: the name placement matches profiles against, e.g. ``l40s-45g``.

A class is a short product token plus the memory the driver reports, rounded to GiB. The number is
never taken from the product name: an L40S is sold as "48GB" but reports 44.99 GiB, and whether a
model fits depends on what the driver gives, so the class says ``l40s-45g``. Consistency across
nodes matters more than matching the box.
"""

from __future__ import annotations

import math
import re

GIB = 2**30

# Brand words that come before the product token and say nothing about the chip.
_BRAND_WORDS = frozenset({"nvidia", "tesla", "geforce", "quadro"})
# Memory size, memory type and form factor: the same chip in another package is the same class
# (the driver's memory number tells the sizes apart).
_PACKAGING = re.compile(r"\d+gb|hbm\d*e?|sxm\d*|pcie|nvl\d*")
_SEPARATORS = re.compile(r"[\s\-_/]+")
_NON_ALNUM = re.compile(r"[^a-z0-9]")


def gpu_class(product_name: str, memory_total_bytes: int) -> str:
    """The class of a GPU from NVML's product name and total memory in bytes."""
    return f"{_product_token(product_name)}-{_round_half_up(memory_total_bytes / GIB)}g"


def _product_token(product_name: str) -> str:
    tokens = [_NON_ALNUM.sub("", t) for t in _SEPARATORS.split(product_name.lower())]
    tokens = [t for t in tokens if t and t not in _BRAND_WORDS and not _PACKAGING.fullmatch(t)]
    if not tokens:
        return "gpu"
    if tokens[0] == "rtx":
        # "RTX 4090", "RTX A6000", "RTX PRO 6000": "rtx" alone names a brand, not a chip, so
        # it takes the words up to the first one carrying a model number.
        joined = ""
        for token in tokens:
            joined += token
            if any(c.isdigit() for c in token):
                break
        return joined
    return tokens[0]


def _round_half_up(value: float) -> int:
    # round() rounds halves to even; half-up keeps 15.5 GiB and 16.5 GiB going the same way.
    return math.floor(value + 0.5)
