"""Builds vllm_graph_sleep._cumem (csrc/) with CMake, for CUDA or ROCm.

The target is VLLM_GRAPH_SLEEP_TARGET (cuda|rocm) when set, otherwise ROCm
exactly when the torch this build imports is a ROCm build (an isolated build
imports none: CUDA).
"""

import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent.resolve()


def gpu_target() -> str:
    explicit = os.environ.get("VLLM_GRAPH_SLEEP_TARGET")
    if explicit:
        if explicit not in ("cuda", "rocm"):
            sys.exit(f"VLLM_GRAPH_SLEEP_TARGET must be cuda or rocm, not {explicit!r}")
        return explicit
    try:
        import torch
    except ImportError:
        return "cuda"
    return "rocm" if torch.version.hip else "cuda"


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        out_dir = Path(self.get_ext_fullpath(ext.name)).parent.resolve()
        build_dir = Path(self.build_temp).resolve() / gpu_target()
        build_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                "cmake",
                "-S",
                str(ROOT),
                "-B",
                str(build_dir),
                "-DCMAKE_BUILD_TYPE=Release",
                f"-DGRAPH_SLEEP_TARGET={gpu_target()}",
                f"-DPython_EXECUTABLE={sys.executable}",
                f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            ],
            check=True,
        )
        subprocess.run(["cmake", "--build", str(build_dir), "-j"], check=True)


setup(
    ext_modules=[CMakeExtension("vllm_graph_sleep._cumem")],
    cmdclass={"build_ext": CMakeBuild},
)
