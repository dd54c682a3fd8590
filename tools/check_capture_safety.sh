#!/usr/bin/env bash
# Capture safety, checked on the binary: the allocator's mapping path runs during
# CUDA/HIP graph capture, so the extension must not import anything that writes
# memory through a stream or touches streams (DESIGN.md decision 4).
# Usage: check_capture_safety.sh cuda|rocm path/to/_cumem*.so
set -euo pipefail
target=$1
library=$2
imports=$(nm -D --undefined-only "$library" | awk '{print $2}' | sed 's/@.*//')
case "$target" in
  cuda) forbidden='^(cuMemsetD|cudaMemset|cuStream|cudaStream)'; expected=cuMemCreate ;;
  rocm) forbidden='^(hipMemset|hipStream)'; expected=hipMemCreate ;;
  *) echo "unknown target $target" >&2; exit 2 ;;
esac
# Guard against checking the wrong file: the real driver imports must be there.
if ! grep -qx "$expected" <<<"$imports"; then
  echo "$library does not import $expected: not a $target build of the allocator" >&2
  exit 1
fi
if bad=$(grep -E "$forbidden" <<<"$imports"); then
  echo "$library imports capture-unsafe symbols:" >&2
  echo "$bad" >&2
  exit 1
fi
echo "$target build imports no memset or stream symbol ($(wc -l <<<"$imports") imports checked)"
