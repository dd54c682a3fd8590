#!/usr/bin/env bash
# Validate every Buildkite pipeline in .buildkite/ against Buildkite's official
# schema, as vendored by check-jsonschema (--builtin-schema vendor.buildkite):
# no network needed. Exit status is check-jsonschema's: non-zero on any error.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

if ! command -v check-jsonschema >/dev/null 2>&1; then
  echo "check_pipelines: check-jsonschema not on PATH (pip install check-jsonschema)" >&2
  exit 2
fi

shopt -s nullglob
pipelines=(.buildkite/*.yaml .buildkite/*.yml)
if ((${#pipelines[@]} == 0)); then
  echo "check_pipelines: no .buildkite/*.yaml or *.yml files found" >&2
  exit 2
fi

check-jsonschema --builtin-schema vendor.buildkite "${pipelines[@]}"
