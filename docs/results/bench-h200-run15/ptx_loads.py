"""Compiles the coder's kernels for sm_90 (no GPU needed) twice: with the sizes
unspecialized, as they ship since c0af062, and with them marked divisible by 16
as Triton would specialize them; counts each variant's global loads and stores
in the PTX. Run from the repository root: python docs/results/bench-h200-run15/ptx_loads.py"""

import collections
import inspect
import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from vllm_graph_sleep import exponent_codec as codec

SIZES = ("symbols", "lanes", "piece_symbols")
LANES = {"SYMBOLS_PER_LANE": codec.SYMBOLS_PER_LANE, "LANES_PER_PROGRAM": codec.LANES_PER_PROGRAM}
COUNT = {"words": "*i16", "symbols": "i32", "lanes": "i32", "lengths": "*i32"}
DECODE = {
    "stream": "*i32",
    "total_words": "i32",
    "starts": "*i32",
    "raw": "*u8",
    "lookup": "*i32",
    "out": "*i16",
    "symbols": "i32",
    "lanes": "i32",
    "mismatches": "*i32",
}
KERNELS = {
    "count": (codec._count_kernel, {**COUNT, "lane_bits": "*i32"}, LANES),
    "encode": (
        codec._encode_kernel,
        {**COUNT, "codes": "*i32", "starts": "*i32", "stream": "*i32", "raw": "*u8"},
        LANES,
    ),
    "check": (codec._decode_kernel, DECODE, {**LANES, "MAX_CODE_BITS": 12, "CHECK": True}),
    "decode": (codec._decode_kernel, DECODE, {**LANES, "MAX_CODE_BITS": 12, "CHECK": False}),
    "histogram": (
        codec._histogram_kernel,
        {"words": "*i16", "symbols": "i32", "piece_symbols": "i32", "histograms": "*i32"},
        {"BLOCK": codec.HISTOGRAM_BLOCK, "BLOCKS_PER_PROGRAM": codec.HISTOGRAM_BLOCKS_PER_PROGRAM},
    ),
}


def memory_instructions(kernel, arguments, constants, sizes_divisible: bool) -> dict[str, int]:
    names = list(inspect.signature(kernel.fn).parameters)
    signature = {name: arguments.get(name, "constexpr") for name in names}
    constexprs = {(names.index(name),): value for name, value in constants.items()}
    # Pointers are 16-byte aligned in every call the coder makes, so Triton specializes them.
    divisible = [
        name
        for name, kind in arguments.items()
        if kind.startswith("*") or (sizes_divisible and name in SIZES)
    ]
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in divisible}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    return dict(collections.Counter(re.findall(r"\b(?:ld|st)\.global[\w.]*", ptx)))


for name, (kernel, arguments, constants) in KERNELS.items():
    for sizes_divisible in (False, True):
        label = "sizes divisible by 16" if sizes_divisible else "sizes unspecialized"
        counts = memory_instructions(kernel, arguments, constants, sizes_divisible)
        print(f"{name:9} {label:22} {counts}")
