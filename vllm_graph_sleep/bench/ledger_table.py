"""The "ledger while asleep" rows: per level, field and GPU, the configurations
side by side, from the ledgers the worker probe reported at the last sleep of
each level (bench.report keeps them in each summary's "ledger_asleep"). The
bench's printed table and tools/render_results.py both show these rows."""

from __future__ import annotations

from typing import Any

from vllm_graph_sleep.ledger_fields import COUNTS, INFORMATIVE, SUMMED
from vllm_graph_sleep.units import MiB

#: What the process holds, what explains it, what is left, then what is shown beside.
FIELDS = ("nvml_used", *SUMMED, "attributed", "unattributed", *INFORMATIVE)
NOTE = (
    "Ledger while asleep: what each GPU still holds at the last sleep of each level, as the "
    "worker sees it; MiB unless a count; ~ marks an estimate; unattributed = nvml used - "
    "attributed (the sum of the fields above it); cuBLAS workspaces are inside torch's memory, "
    "not added. A field no configuration could read is left out; results.json says why "
    '("unavailable" of each ledger). Fields: vllm_graph_sleep/ledger_fields.py.'
)
WORKSPACE_NOTE = (
    "vLLM's workspace is inside torch's memory or a sleep pool too, not added; its "
    "outside-pools row is the part no sleep releases."
)
SAMPLER_NOTE = (
    "vLLM's sampler scratch (its Triton top-k/top-p buffers, which stock vLLM keeps "
    "through a sleep and ours drops) is inside torch's memory too, not added."
)
#: Added to NOTE where the rows show their field (ledgers older than it have none,
#: and their rendered tables stay as they were).
FIELD_NOTES = {"vllm_workspace": WORKSPACE_NOTE, "vllm_sampler_scratch": SAMPLER_NOTE}


def _name(field: str) -> str:
    return field.replace("_", " ")


def note(lines: list[list[str]]) -> str:
    """The note under the rows `lines` (as rows() gives them)."""
    shown = [
        text
        for field, text in FIELD_NOTES.items()
        if any(f": {_name(field)}" in line[0] for line in lines)
    ]
    return " ".join([NOTE, *shown])


def _ledger(summary: dict[str, Any], level: str, gpu: int) -> dict[str, Any] | None:
    per_gpu = (summary.get("ledger_asleep") or {}).get(level) or []
    return per_gpu[gpu] if gpu < len(per_gpu) else None


def _cell(ledger: dict[str, Any] | None, field: str) -> str | None:
    value = (ledger or {}).get(field)
    if not isinstance(value, int | float):
        return None
    text = f"{value:.0f}" if field in COUNTS else f"{value / MiB:.0f}"
    return ("~" if field in (ledger.get("estimated") or {}) else "") + text


def rows(summaries: dict[str, dict[str, Any]]) -> list[list[str]]:
    """Text cells: a label, then one cell per configuration ("-" where it has no figure)."""
    ledgers = [s.get("ledger_asleep") or {} for s in summaries.values()]
    levels = sorted({level for per_level in ledgers for level in per_level})
    gpus = max((len(v) for per_level in ledgers for v in per_level.values()), default=0)
    lines = []
    for level in levels:
        for field in FIELDS:
            for gpu in range(gpus):
                cells = [_cell(_ledger(s, level, gpu), field) for s in summaries.values()]
                if all(cell is None for cell in cells):
                    continue
                where = f" gpu{gpu}" if gpus > 1 else ""
                unit = "" if field in COUNTS else " (MiB)"
                label = f"asleep L{level}: {_name(field)}{where}{unit}"
                lines.append([label, *[cell or "-" for cell in cells]])
    return lines
