"""tools/render_results.py: renders docs/results/ into a folder, deterministically;
the committed index.md, tables.md and charts, and README.md's results table, are
what it renders; every current page says what ran, with which code and command
(CPU)."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest

from vllm_graph_sleep.bench import markdown, report

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
    index = (tmp_path / "tables.md").read_text()

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
    assert markdown.command_text(memory["command"]) in index
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
    for name in ("bench-h200-run18.json", "bench-h200-run11.json"):
        run = _load(name)
        for key in ("1", "2"):
            label = f"asleep L{key}, over idle GPU (MiB)"
            assert label in report.format_table(run)
            rows = [line for line in lines if line.startswith(f"| {label} |")]
            expected = [f"{run['summary'][c]['asleep_mib'][key][0]:.0f}" for c in run["summary"]]
            assert expected in [_first_numbers(row) for row in rows], (name, rows)
        exacts = [line for line in lines if line.startswith("| bit-exact after wake |")]
        good, total = next(iter(run["summary"].values()))["exact"]
        assert good == total
        assert any(row.count(f"{good}/{total}") == len(run["summary"]) for row in exacts)
        # The memory plot is linked where it was drawn, never as a dead link.
        plot = f"{name.removesuffix('.json')}.png"
        assert (f"]({plot})" in index) == (RESULTS / plot).is_file()

    measured_on_rocm = [
        path.name
        for path in RESULTS.glob("*.json")
        if (json.loads(path.read_text()).get("environment") or {}).get("hip")
    ]
    contents = (tmp_path / "index.md").read_text()
    if not measured_on_rocm:
        assert "**ROCm is untested on hardware.**" in index
        assert "**ROCm is untested on hardware.**" in contents
    assert (
        "- [Allocator on one H200: tests and sleep/wake bandwidth](allocator-h200.md): " in contents
    )
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
    index, tables = outputs["index.md"], outputs["tables.md"]
    assert "## TP=2 sleep (tp2-bench.json)" in tables
    assert "| config | asleep_mib | exact |" in tables and "| ours | 12.5 | yes |" in tables
    rows = {line.split(" | ")[0]: line for line in index.splitlines() if line.startswith("| [")}
    assert "not rendered (not JSON)" in rows["| [broken.json](broken.json)"]
    assert "not rendered (format not recognised)" in rows["| [notes.json](notes.json)"]
    assert "`bench --tp 2`" in rows["| [tp2-bench.json](tp2-bench.json)"]
    assert rows["| [sleep-memory-h200.json](sleep-memory-h200.json)"].endswith(
        "| [run.md](run.md) |"
    )
    assert "Not cited by any page: [plot.png](plot.png)" in index
    assert "- [A run](run.md): [sleep-memory-h200.json](sleep-memory-h200.json)" in index
    # Run without recorded hardware: the hand-written page that names it is pointed to.
    assert "not recorded in this file; [run.md](run.md) describes this run." in tables
    # A result measured on ROCm changes the ROCm statement.
    assert "**ROCm**: measured on AMD hardware in `tp2-bench.json`." in index
    assert "untested on hardware" not in index + tables
    # Rendering again over its own output gives the same output.
    render_results.main(["--results", str(tmp_path)])
    assert render_results.render(tmp_path) == outputs
    assert render_results.main(["--results", str(tmp_path), "--check"]) == 0
    (tmp_path / "index.md").write_text("stale\n")
    assert render_results.main(["--results", str(tmp_path), "--check"]) == 1


def test_a_bench_runs_floor_is_rendered_with_its_table(tmp_path):
    run = _load("bench-h200-run18.json")
    run["floor"] = {
        "what": "a bare CUDA context with a cuBLAS handle, stack reservation released",
        "baseline_used_bytes": [615 * 2**20],
        "used_bytes": [1115 * 2**20],
    }
    (tmp_path / "bench-floor.json").write_text(json.dumps(run))
    assert render_results.main(["--results", str(tmp_path), "--out", str(tmp_path)]) == 0
    index = (tmp_path / "tables.md").read_text()
    assert "The run's floor (a bare CUDA context with a cuBLAS handle, stack" in index
    assert "released): 500 MiB over the idle GPU." in index


def test_a_bench_runs_switches_are_rendered_with_it(tmp_path):
    run = _load("bench-h200-run18.json")
    run["switches"] = {"VLLM_GRAPH_SLEEP_COMPRESS_BACKUPS": "1"}
    (tmp_path / "bench-switches.json").write_text(json.dumps(run))
    assert render_results.main(["--results", str(tmp_path), "--out", str(tmp_path)]) == 0
    index = (tmp_path / "tables.md").read_text()
    assert "- Switches the servers inherited: `VLLM_GRAPH_SLEEP_COMPRESS_BACKUPS=1`" in index


def _pages() -> list[Path]:
    return sorted(
        p
        for p in RESULTS.glob("*.md")
        if p.name not in (render_results.INDEX, render_results.TABLES)
    )


def test_results_are_a_short_index_of_current_pages_and_an_archive():
    index = (RESULTS / "index.md").read_text()
    assert len(index.splitlines()) < 150
    outside_archive = [p for p in RESULTS.rglob("*") if p.is_file() and "archive" not in p.parts]
    assert len(outside_archive) < 60, len(outside_archive)
    assert not [p for p in RESULTS.iterdir() if p.is_dir() and p.name != "archive"]
    for page in _pages():
        assert f"]({page.name})" in index, page.name
    for data in RESULTS.glob("*.json"):
        assert f"| [{data.name}]({data.name}) |" in index, data.name
    assert "](archive/README.md)" in index


def test_every_current_page_names_the_code_and_command_of_what_ran():
    for page in _pages():
        text = page.read_text()
        assert "\n## What ran\n" in text, f"{page.name}: no 'What ran' section"
        section = text.split("\n## What ran\n", 1)[1].split("\n## ", 1)[0]
        header = next(line for line in section.splitlines() if line.startswith("| "))
        assert "| code |" in header and ("| command |" in header or "| what |" in header), page
        rows = [line for line in section.splitlines() if line.startswith("| ")][1:]
        assert rows, page.name
        code_column = [c.strip() for c in header.strip("|").split("|")].index("code")
        for row in rows:
            cell = [c.strip() for c in row.strip("|").split("|")][code_column]
            assert re.search(r"\b[0-9a-f]{7,40}\b|not recorded", cell), (page.name, row)
        # Every file a page links to in this folder exists.
        for target in re.findall(r"\]\(([^)#\s]+)", text):
            if "://" not in target:
                assert (page.parent / target).exists(), (page.name, target)


def _readme() -> str:
    return (ROOT / "README.md").read_text()


def test_readmes_table_is_the_rendering_of_the_run_it_names():
    readme = _readme()
    marker = render_results.README_BEGIN.search(readme)
    assert marker, "README.md has no results-table marker"
    assert render_results.readme_block(readme, RESULTS, None, None) == readme, (
        "README's table is stale: run python tools/render_results.py --readme"
    )
    run = _load(Path(marker["source"]).name)
    block = readme[marker.end() : readme.index(render_results.README_END)]
    ours = run["summary"]["ours"]
    assert (
        f"| asleep, level 1 (MiB over the idle GPU) | {ours['asleep_mib']['1'][0]:.0f} |" in block
    )
    assert f"| level-1 wake (ms) | {ours['wake_ms']['1 full']:.0f} (" in block
    assert "| tokens exact after each wake | {}/{} |".format(*ours["exact"]) in block
    # The figures come from a current page that names the run.
    page = re.search(r"page: \[[^]]+\]\(docs/results/([^)]+)\)", block)[1]
    assert Path(marker["source"]).name in (RESULTS / page).read_text()
    # The first figure comes after the quick start.
    assert readme.index("## Quick start") < marker.start()


def test_readmes_table_moves_to_another_run_and_refuses_one_no_page_names(tmp_path):
    readme = _readme()
    # Run 9 (archived now): another run than the one README names.
    for name in ("archive/bench-h200-run9.json", "bench-h200-run11.json"):
        shutil.copy(RESULTS / name, tmp_path)
    (tmp_path / "run9.md").write_text("# Run 9\n\nbench-h200-run9.json\n")
    moved = render_results.readme_block(
        readme, tmp_path, "docs/results/bench-h200-run9.json", "32c9c8a"
    )
    assert "<!-- results table: docs/results/bench-h200-run9.json code=32c9c8a -->" in moved
    assert "code `32c9c8a`" in moved and "page: [run9.md](docs/results/run9.md)" in moved
    run9 = _load("archive/bench-h200-run9.json")["summary"]["ours"]
    assert f"| level-1 wake (ms) | {run9['wake_ms']['1 full']:.0f} (" in moved
    # Rendering again from its own marker gives the same text.
    assert render_results.readme_block(moved, tmp_path, None, None) == moved
    # Everything outside the block is kept.
    end = render_results.README_END
    assert moved[moved.index(end) :] == readme[readme.index(end) :]
    with pytest.raises(ValueError, match="no page in .* names bench-h200-run11.json"):
        render_results.readme_block(readme, tmp_path, "docs/results/bench-h200-run11.json", None)
    with pytest.raises(ValueError, match="no such file"):
        render_results.readme_block(readme, tmp_path, "docs/results/nope.json", None)
    with pytest.raises(ValueError, match="has no"):
        render_results.readme_block("# no table\n", tmp_path, None, None)
    # A run that records its commit and duration is named by them.
    run9 = {**_load("archive/bench-h200-run9.json"), "duration_s": 213.4}
    run9["host"] = {**run9["host"], "git_revision": "0123abc"}
    (tmp_path / "bench-h200-run9.json").write_text(json.dumps(run9))
    named = render_results.readme_block(readme, tmp_path, "docs/results/bench-h200-run9.json", None)
    assert "2026-12-01, 3.6 min end to end, code `0123abc`)" in named


def test_readme_keeps_its_two_commands_under_their_headings():
    """.ci/run takes the test command from README with awk: the first indented line
    after '## Run the tests'; the main job's command sits the same way under its heading."""

    def first_indented_after(heading: str) -> str:
        lines = _readme().splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith(heading))
        return next(line[4:] for line in lines[start + 1 :] if line.startswith("    "))

    assert first_indented_after("## Install and run the main job") == (
        "pip install -e '.[bench]' && vllm-graph-sleep bench"
    )
    assert first_indented_after("## Run the tests") == (
        "pip install -e '.[test]' && python -m pytest tests -q -rs"
    )
    awk = re.search(r"readme_tests=\$\(awk '([^']+)' README.md\)", (ROOT / ".ci/run").read_text())
    assert awk and "/^## Run the tests/" in awk[1], (
        "the awk line of .ci/run changed: check this test"
    )


def test_a_bench_runs_charts_are_shown_under_its_table_where_they_were_drawn(tmp_path):
    # `vllm-graph-sleep bench --report run.json` draws run.asleep.png and run.wake.png.
    fixture = report.read_json(ROOT / "tests" / "unit" / "data" / "bench-results-fixture.json")
    report.write_json(fixture, tmp_path / "run.json")
    assert render_results.main(["--results", str(tmp_path), "--out", str(tmp_path)]) == 0
    assert ".asleep.png" not in (tmp_path / render_results.TABLES).read_text()
    for name in ("run.asleep.png", "run.wake.png"):
        (tmp_path / name).write_bytes(b"\x89PNG\r\n\x1a\n")
    assert render_results.main(["--results", str(tmp_path), "--out", str(tmp_path)]) == 0
    index = (tmp_path / render_results.TABLES).read_text()
    assert "![Asleep memory per configuration, with the floor](run.asleep.png)" in index
    assert "![Level-1 wake per configuration, full and staged](run.wake.png)" in index
