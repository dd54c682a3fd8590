#!/usr/bin/env bash
# Builds the CUDA wheel of this package the way a runtime-only GPU image would
# (NVIDIA driver and vLLM's wheels, no CUDA toolkit): every toolkit folder on
# this machine is hidden in a private mount namespace, CUDA_HOME/CUDA_PATH are
# unset and no PATH entry names CUDA. The build must then take cuda.h from the
# nvidia-cuda-runtime wheel that pyproject.toml lists as a build requirement.
# Usage: tools/build_without_toolkit.sh PYTHON OUT_DIR   (needs root for unshare)
set -euo pipefail
python=$1
out=$2
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [[ -z "${_GRAPH_SLEEP_TOOLKIT_HIDDEN:-}" ]]; then
  if ! unshare --mount true 2>/dev/null; then
    echo "build_without_toolkit: cannot make a mount namespace (unshare --mount; needs root)" >&2
    exit 2
  fi
  exec env _GRAPH_SLEEP_TOOLKIT_HIDDEN=1 unshare --mount --propagation private "$0" "$@"
fi

shopt -s nullglob
for dir in /usr/local/cuda* /opt/cuda* /opt/nvidia/hpc_sdk; do
  [[ -d "$dir" && ! -L "$dir" ]] && mount -t tmpfs none "$dir"
done
unset CUDA_HOME CUDA_PATH CUDA_ROOT CUDAToolkit_ROOT
PATH=$(tr ':' '\n' <<<"$PATH" | grep -iv cuda | paste -sd: -)
export PATH

# The toolkit really is out of reach: no working nvcc (a wrapper script may
# remain on PATH), no cuda.h on the compiler's paths.
if nvcc --version >/dev/null 2>&1; then
  echo "build_without_toolkit: nvcc still runs: $(command -v nvcc)" >&2
  exit 1
fi
if echo '#include <cuda.h>' | g++ -E -x c++ - >/dev/null 2>&1; then
  echo "build_without_toolkit: the compiler still finds a cuda.h of its own" >&2
  exit 1
fi

mkdir -p "$out"
log="$out/build.log"
if ! VLLM_GRAPH_SLEEP_TARGET=cuda "$python" -m pip wheel -v --no-deps -w "$out" . >"$log" 2>&1; then
  tail -30 "$log" >&2
  echo "build_without_toolkit: the build failed without a CUDA toolkit (log: $log)" >&2
  exit 1
fi
used=$(grep -o 'CUDA build: cuda.h from .*' "$log" | head -1)
if ! grep -q '/nvidia/cu13/include$' <<<"$used"; then
  echo "build_without_toolkit: cuda.h did not come from the nvidia-cuda-runtime wheel: $used" >&2
  exit 1
fi
echo "built without a CUDA toolkit; ${used#CUDA build: }"
wheel=$(ls -t "$out"/vllm_graph_sleep-*.whl | head -1)
"$python" -m zipfile -e "$wheel" "$out/unpacked"
tools/check_capture_safety.sh cuda "$out"/unpacked/vllm_graph_sleep/_cumem*.so
