"""Sizes in bytes, read from the command line and written for people, by one rule.

A size is a number of bytes with an optional unit, any case, spaces allowed between:

    K, M, G, T and KiB, MiB, GiB, TiB (Ki, Mi, ...)   powers of 2^10: "256M" = 256 x 2^20, "16GiB" = 16 x 2^30
    KB, MB, GB, TB                                    powers of 10^3, as GPU and disk makers write them: "80GB" = 80 x 10^9
    B, or nothing                                     bytes: "1024"

Sizes are written in binary units: GiB from 1 GiB up, MiB below it (not "0.0 GiB").
"""

from __future__ import annotations

import re

from core.errors import UserError

BYTES_IN = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
GIB = BYTES_IN["GiB"]

SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*(?:([kmgt])(i?))?(b?)\s*", re.IGNORECASE)  # number, prefix, i, B


def parse_byte_size(text: str, what: str) -> int:
    """Bytes in ``text`` by the rule above; a UserError naming ``what`` the size is for where it is not a size."""
    match = SIZE.fullmatch(text)
    if match is None:
        raise UserError(f"{what} {text!r} is not a size: write bytes, or a number with K, M, G, T or KiB, MiB, GiB, "
                        "TiB (powers of 1024) or KB, MB, GB, TB (powers of 1000), e.g. 256M, 16GiB or 80GB")
    number, prefix, binary, byte = match.groups()
    if not prefix:
        return int(float(number))
    power = "kmgt".index(prefix.lower()) + 1
    base = 1000 if (byte and not binary) else 1024
    return int(float(number) * base**power)


def size_unit(size: float) -> str:
    """The binary unit a size is written in: GiB from 1 GiB up, MiB below."""
    return "GiB" if size >= GIB else "MiB"


def format_bytes(size: float, unit: str | None = None, digits: int = 1) -> str:
    """``size`` bytes as "3.2 GiB": in ``unit`` (one of BYTES_IN) if given, else in ``size_unit``'s."""
    unit = unit or size_unit(size)
    return f"{size / BYTES_IN[unit]:.{digits}f} {unit}"
