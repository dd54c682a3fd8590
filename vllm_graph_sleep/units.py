"""Byte units and the byte formatters every log line, bench report and results page uses."""

from __future__ import annotations

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

_SCALES = (("GiB", GiB), ("MiB", MiB), ("KiB", KiB))


def format_bytes(size: int) -> str:
    """The largest unit the size reaches, two decimals: '1.50 GiB', '512 B'."""
    for unit, scale in _SCALES:
        if size >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{size} B"


def format_exact_bytes(size: int) -> str:
    """The largest unit that divides the size, no decimals: '64 KiB', '1536 B'."""
    for unit, scale in _SCALES:
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"
