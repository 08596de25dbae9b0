"""core/sizes.py: one rule for sizes on the command line (cohort comm's messages, cohort doctor's device memory)
and one way of writing them."""

from __future__ import annotations

import pytest

from core.errors import UserError
from core.sizes import format_bytes, parse_byte_size


def test_a_bare_or_iec_unit_is_binary_and_an_si_one_decimal() -> None:
    assert parse_byte_size("256M", "--max-size") == parse_byte_size("256 MiB", "--max-size") == 256 * 2**20
    assert parse_byte_size("1k", "--min-size") == parse_byte_size("1Ki", "--min-size") == 1024
    assert parse_byte_size("80GB", "device memory") == 80 * 10**9
    assert parse_byte_size("1.5T", "device memory") == int(1.5 * 2**40)
    assert parse_byte_size("4096", "--min-size") == parse_byte_size("4096B", "--min-size") == 4096


@pytest.mark.parametrize("text", ["lots", "16i", "G", "-1K", ""])
def test_what_is_not_a_size_is_one_line_naming_the_option(text: str) -> None:
    with pytest.raises(UserError, match=f"^--max-size {text!r} is not a size: write bytes") as error:
        parse_byte_size(text, "--max-size")
    assert "\n" not in str(error.value)


def test_sizes_are_written_in_gib_from_one_gib_and_in_mib_below() -> None:
    assert format_bytes(3 * 2**30) == "3.0 GiB"
    assert format_bytes(2**30 - 2**20) == "1023.0 MiB"
    assert format_bytes(3 * 2**30, "GiB", 2) == "3.00 GiB"
