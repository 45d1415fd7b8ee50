"""Sizes on the command line: token counts and byte sizes, one reading of their suffixes.

One rule for both kinds, so that `4M` is the same number wherever a flag takes it:

- SI prefixes are decimal: `k` = 10^3, `M` = 10^6, `G` = 10^9, `T` = 10^12 (any case:
  `500k`, `1.5M`, `4m`). The docs and the replay figures count tokens this way (`1M`
  tokens = 1,000,000), as `--capacity-tokens` always did.
- IEC prefixes are binary: `Ki` = 2^10, `Mi` = 2^20, `Gi` = 2^30, `Ti` = 2^40 (`32Ki`
  tokens = 32,768; `8GiB` = 8 x 2^30 bytes).
- A byte size may end in `B` (`24GB`, `512MiB`, `1073741824B`); a token count may not.
- A token count is a whole number (`1.5k` is 1500, `1.5` is refused); a byte size is
  rounded down to a whole byte.

The errors subclass both ValueError and argparse.ArgumentTypeError, so argparse prints the
message as it is and library callers catch a plain ValueError.
"""

from __future__ import annotations

import argparse
import re
from fractions import Fraction

_PREFIXES = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
             "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?)?(b?)\s*", re.IGNORECASE)


class SizeError(ValueError, argparse.ArgumentTypeError):
    """A size that does not parse; the message names the text and shows good examples."""


def _scaled(text: str, kind: str, examples: str, unit_allowed: bool) -> Fraction:
    m = _SIZE.fullmatch(text)
    if not m or (m.group(3) and not unit_allowed):
        raise SizeError(f"not a {kind}: {text!r} (e.g. {examples})")
    return Fraction(m.group(1)) * _PREFIXES[(m.group(2) or "").lower()]


def parse_tokens(text: str) -> int:
    """A token count: '8192', '500k' (500,000), '1.5M', '32Ki' (32,768)."""
    value = _scaled(text, "token count", "8192, 500k, 1.5M, 32Ki", unit_allowed=False)
    if value.denominator != 1:
        raise SizeError(f"not a whole number of tokens: {text!r}")
    return int(value)


def parse_bytes(text: str) -> int:
    """A byte size: '1073741824', '24GB' (24 x 10^9), '8GiB' (8 x 2^30), '500M'."""
    return int(_scaled(text, "memory size", "80GiB, 24GB, 512MiB", unit_allowed=True))
