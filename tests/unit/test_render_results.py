"""tools/render_results.py: renders docs/results/ into a folder, deterministically,
and the committed index.md and charts are what it renders (CPU, stdlib only)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

from vllm_graph_sleep.bench import report

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"

_spec = importlib.util.spec_from_file_location(
    "render_results", ROOT / "tools" / "render_results.py"
)
render_results = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render_results)


def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def test_renders_the_key_figures_into_a_folder(tmp_path):
    assert render_results.main(["--results", str(RESULTS), "--out", str(tmp_path)]) == 0
    index = (tmp_path / "index.md").read_text()

    bench = _load("allocator-bench-h200.json")
    assert bench["environment"]["gpu_name"] in index
    assert bench["environment"]["torch"] in index
    assert bench["command"] in index
    for entry in bench["bandwidth"]:
        row = next(
            line for line in index.splitlines() if line.startswith(f"| {entry['size_gib']:g} GiB |")
        )
        assert f"| {entry['ours']['sleep']['gbps']:.1f} |" in row
        assert f"| {entry['ours']['wake']['gbps']:.1f} |" in row
        assert f"| {entry['ratio_sleep_vs_d2h']:.2f} |" in row

    memory = _load("sleep-memory-h200.json")
    assert render_results.command_text(memory["command"]) in index
    for config, over in memory["summary"].items():
        # The first row of each configuration is in the memory table.
        row = next(line for line in index.splitlines() if line.startswith(f"| `{config}` | "))
        assert f"| {over['level1_over_stock_eager_mib']:.0f} |" in row, row
    # The graph pool, per tag: backed up to host at both levels.
    ours = next(r for r in memory["results"] if r["config"] == "ours")
    for level in (1, 2):
        pool = ours[f"level{level}_asleep_report"]["tags"]["cudagraph"]["backed_up"]
        assert pool > 0 and f"{render_results.mib(pool)} on host" in index

    # The bench's own tables: the labels `vllm-graph-sleep bench` prints.
    lines = index.splitlines()
    for name in ("bench-h200.json", "bench-h200-run5.json"):
        run = _load(name)
        for key in ("1", "2"):
            label = f"asleep L{key}, over idle GPU (MiB)"
            assert label in report.format_table(run)
            rows = [line for line in lines if line.startswith(f"| {label} |")]
            expected = [f"{run['summary'][c]['asleep_mib'][key][0]:.0f}" for c in run["summary"]]
            assert expected in [_first_numbers(row) for row in rows], (name, rows)
        exacts = [line for line in lines if line.startswith("| bit-exact after wake |")]
        assert any(row.count("8/8") == len(run["summary"]) for row in exacts)
        assert f"]({name.removesuffix('.json')}.png)" in index

    measured_on_rocm = [
        path.name
        for path in RESULTS.glob("*.json")
        if (json.loads(path.read_text()).get("environment") or {}).get("hip")
    ]
    if not measured_on_rocm:
        assert "**ROCm is untested on hardware.**" in index
    assert "(allocator-h200.md) (hand-written)" in index
    for chart in ("allocator-bench-h200.svg", "sleep-memory-h200.svg"):
        assert f"]({chart})" in index
        assert (tmp_path / chart).read_text().startswith("<svg ")


def _first_numbers(row: str) -> list[str]:
    """The figure of each configuration in a table row (its ratio left out)."""
    return [cell.strip().split(" ")[0] for cell in row.strip("|").split("|")][1:]


def test_rendering_is_deterministic():
    assert render_results.render(RESULTS) == render_results.render(RESULTS)


def test_committed_pages_are_up_to_date():
    stale = render_results.stale(render_results.render(RESULTS), RESULTS)
    assert not stale, f"{stale} out of date: run python tools/render_results.py"


def test_other_benchmarks_and_unknown_files(tmp_path):
    shutil.copy(RESULTS / "sleep-memory-h200.json", tmp_path)
    (tmp_path / "tp2-bench.json").write_text(
        json.dumps(
            {
                "benchmark": "TP=2 sleep",
                "command": ["bench", "--tp", "2"],
                "environment": {"gpu_name": "AMD Instinct MI300X", "hip": "6.4", "torch": "2.11"},
                "results": [{"config": "ours", "asleep_mib": 12.5, "exact": True, "nested": {}}],
            }
        )
    )
    (tmp_path / "notes.json").write_text('{"anything": 1}')
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "plot.png").write_bytes(b"\x89PNG")
    (tmp_path / "run.md").write_text("# A run\n\nsee sleep-memory-h200.json\n")

    outputs = render_results.render(tmp_path)
    index = outputs["index.md"]
    assert "## TP=2 sleep (tp2-bench.json)" in index
    assert "| config | asleep_mib | exact |" in index and "| ours | 12.5 | yes |" in index
    assert "Not rendered (format not recognised): [broken.json](broken.json), [notes.json]" in index
    assert "Other files: [plot.png](plot.png)" in index
    assert "[A run](run.md) (hand-written)" in index
    # Run without recorded hardware: the hand-written page that names it is pointed to.
    assert "not recorded in this file; [run.md](run.md) describes this run." in index
    # A result measured on ROCm changes the ROCm statement.
    assert "**ROCm**: measured on AMD hardware in `tp2-bench.json`." in index
    assert "untested on hardware" not in index
    # Rendering again over its own output gives the same output.
    render_results.main(["--results", str(tmp_path)])
    assert render_results.render(tmp_path) == outputs
    assert render_results.main(["--results", str(tmp_path), "--check"]) == 0
    (tmp_path / "index.md").write_text("stale\n")
    assert render_results.main(["--results", str(tmp_path), "--check"]) == 1


def test_a_bench_runs_floor_is_rendered_with_its_table(tmp_path):
    run = _load("bench-h200.json")
    run["floor"] = {
        "what": "a bare CUDA context with a cuBLAS handle, stack reservation released",
        "baseline_used_bytes": [615 * 2**20],
        "used_bytes": [1115 * 2**20],
    }
    (tmp_path / "bench-floor.json").write_text(json.dumps(run))
    assert render_results.main(["--results", str(tmp_path), "--out", str(tmp_path)]) == 0
    index = (tmp_path / "index.md").read_text()
    assert "The run's floor (a bare CUDA context with a cuBLAS handle, stack" in index
    assert "released): 500 MiB over the idle GPU." in index


def test_a_bench_runs_switches_are_rendered_with_it(tmp_path):
    run = _load("bench-h200.json")
    run["switches"] = {"VLLM_GRAPH_SLEEP_COMPRESS_BACKUPS": "1"}
    (tmp_path / "bench-switches.json").write_text(json.dumps(run))
    assert render_results.main(["--results", str(tmp_path), "--out", str(tmp_path)]) == 0
    index = (tmp_path / "index.md").read_text()
    assert "- Switches the servers inherited: `VLLM_GRAPH_SLEEP_COMPRESS_BACKUPS=1`" in index


def test_a_bench_runs_charts_are_shown_under_its_table_where_they_were_drawn(tmp_path):
    # `vllm-graph-sleep bench --report run.json` draws run.asleep.png and run.wake.png.
    fixture = report.read_json(ROOT / "tests" / "unit" / "data" / "bench-results-fixture.json")
    report.write_json(fixture, tmp_path / "run.json")
    assert render_results.main(["--results", str(tmp_path), "--out", str(tmp_path)]) == 0
    assert ".asleep.png" not in (tmp_path / "index.md").read_text()
    for name in ("run.asleep.png", "run.wake.png"):
        (tmp_path / name).write_bytes(b"\x89PNG\r\n\x1a\n")
    assert render_results.main(["--results", str(tmp_path), "--out", str(tmp_path)]) == 0
    index = (tmp_path / "index.md").read_text()
    assert "![Asleep memory per configuration, with the floor](run.asleep.png)" in index
    assert "![Level-1 wake per configuration, full and staged](run.wake.png)" in index
