"""The byte formatters keep the exact text that logs, reports and committed results pages show."""

from vllm_graph_sleep.units import GiB, KiB, MiB, format_bytes, format_exact_bytes


def test_units_are_binary():
    assert (KiB, MiB, GiB) == (1024, 1024**2, 1024**3)


def test_format_bytes_picks_the_largest_unit_reached_with_two_decimals():
    assert format_bytes(0) == "0 B"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(KiB) == "1.00 KiB"
    assert format_bytes(MiB + MiB // 2) == "1.50 MiB"
    assert format_bytes(3 * GiB) == "3.00 GiB"


def test_format_exact_bytes_picks_the_largest_unit_that_divides():
    assert format_exact_bytes(64 * KiB) == "64 KiB"
    assert format_exact_bytes(MiB) == "1 MiB"
    assert format_exact_bytes(MiB + KiB) == "1025 KiB"
    assert format_exact_bytes(1536) == "1536 B"
    assert format_exact_bytes(2 * GiB) == "2 GiB"
