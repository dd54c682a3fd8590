"""The exponent codec: lossless for any bytes, and small for bf16 weights.

On a GPU the kernels run compiled, each test in a process of its own;
without one they run in Triton's CPU interpreter (tests/unit/
triton_interpreter.py), with short lanes so that the interpreter's per-step
cost stays small. The interpreter runs the same kernel code with numpy's
integer semantics; tests here compile the kernels for an H200 and an MI300
without a GPU and check the arguments they are launched with, and their run
on a GPU (benchmarks/exponent_codec.py, test_cumem.py) is what proves their
results."""

from __future__ import annotations

import inspect

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from tests.unit.triton_interpreter import interpret_codec
from tests.utils import fresh_process
from vllm_graph_sleep import coded_backup, exponent_codec
from vllm_graph_sleep.exponent_codec import MAX_CODE_BITS, build_table, decode_into, encode

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
# On a GPU, as the other GPU tests, so that this process keeps no CUDA context.
in_a_fresh_process_on_a_gpu = fresh_process if ON_GPU else (lambda test: test)
compiled_kernels_only = pytest.mark.skipif(
    not isinstance(exponent_codec._decode_kernel, triton.runtime.JITFunction),
    reason="the kernels were defined under TRITON_INTERPRET=1",
)


@pytest.fixture
def kernels():
    """The codec's kernels: compiled on a GPU, interpreted without one."""
    if ON_GPU:
        yield
        return
    with pytest.MonkeyPatch.context() as monkeypatch:
        interpret_codec(monkeypatch, symbols_per_lane=32, lanes_per_program=64)
        yield


def bf16_weights(count: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(count, generator=generator) * 0.02
    return values.to(torch.bfloat16).view(torch.uint8).to(DEVICE)


def round_trip(data: torch.Tensor) -> tuple[torch.Tensor, exponent_codec.Encoded]:
    encoded = encode(data)
    assert encoded is not None
    out = torch.full_like(data, 0xA5)
    decode_into(encoded, out)
    return out, encoded


def is_prefix_free(table) -> bool:
    codes = [
        format(code, f"0{length}b")
        for code, length in zip(table.codes, table.lengths, strict=True)
        if length
    ]
    return not any(a != b and b.startswith(a) for a in codes for b in codes)


@in_a_fresh_process_on_a_gpu
@pytest.mark.usefixtures("kernels")
def test_bf16_weights_come_back_bit_exact_in_two_thirds_of_their_bytes():
    # Sizes around the lane and program boundaries: a partial last program, a
    # partial last lane. A piece too small to gain anything is left alone.
    assert encode(bf16_weights(17)) is None
    lane = exponent_codec.SYMBOLS_PER_LANE
    for words in (3 * lane * exponent_codec.LANES_PER_PROGRAM + 5, 5 * lane + 3, 1000):
        data = bf16_weights(words, seed=words)
        out, encoded = round_trip(data)
        assert torch.equal(out, data), words
        # Sign and mantissa raw, exponents coded: two thirds of the bytes, before
        # the lanes' padding and starts (0.6% more with the real lane length).
        histogram = exponent_codec.exponent_histogram(data.view(torch.int16))
        coded = data.numel() // 2 + encoded.piece.table.coded_bits(histogram) / 8
        assert coded < 0.67 * data.numel(), (words, coded)


@in_a_fresh_process_on_a_gpu
@pytest.mark.usefixtures("kernels")
def test_any_bytes_come_back_bit_exact_or_are_left_as_they_are():
    generator = torch.Generator().manual_seed(1)
    noise = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=generator).to(DEVICE)
    assert encode(noise) is None  # uniform exponents: nothing to gain
    # fp32 and int32 data, zeros, one repeated value, and exponents with
    # halving counts, whose optimal code would be 13 bits long at its tail.
    floats = (torch.randn(2048, generator=generator) * 3).view(torch.uint8).to(DEVICE)
    counters = torch.arange(2048, dtype=torch.int32).view(torch.uint8).to(DEVICE)
    zeros = torch.zeros(4096, dtype=torch.uint8, device=DEVICE)
    repeated = torch.full((2048,), 1.5, dtype=torch.bfloat16).view(torch.uint8).to(DEVICE)
    counts = torch.tensor([1 << (12 - k) for k in range(13)] + [1])
    exponents = torch.arange(100, 114, dtype=torch.int32).repeat_interleave(counts)
    skewed = ((exponents << 7) | 0x8003).to(torch.int16).view(torch.uint8).to(DEVICE)
    for name, data in [
        ("fp32", floats),
        ("int32", counters),
        ("zeros", zeros),
        ("repeated", repeated),
        ("skewed", skewed),
    ]:
        encoded = encode(data)
        if encoded is None:
            continue
        out = torch.full_like(data, 0x5A)
        decode_into(encoded, out)
        assert torch.equal(out, data), name
    assert encode(zeros) is not None and encode(repeated) is not None
    skewed_code = encode(skewed)
    assert skewed_code is not None and max(skewed_code.piece.table.lengths) == MAX_CODE_BITS


@in_a_fresh_process_on_a_gpu
@pytest.mark.usefixtures("kernels")
def test_piece_histograms_count_each_pieces_exponents_in_one_pass():
    per_program = exponent_codec.HISTOGRAM_BLOCK * exponent_codec.HISTOGRAM_BLOCKS_PER_PROGRAM
    # Two whole pieces and a partial third; a repeated word makes one count large.
    words = bf16_weights(2 * per_program + 777, seed=9).view(torch.int16).clone()
    words[5:5000] = 0x3F80
    rows = torch.zeros(3, 256, dtype=torch.int32, device=DEVICE)
    exponent_codec.add_piece_histograms(words, per_program, rows)
    expected = [exponent_codec.exponent_histogram(part) for part in words.split(per_program)]
    assert rows.tolist() == expected
    with pytest.raises(ValueError, match="not a multiple"):
        exponent_codec.add_piece_histograms(words, per_program + 2, rows)


def test_the_code_is_canonical_prefix_free_and_within_the_length_limit():
    # Geometric counts over all 256 values: plain Huffman would need 255 bits.
    histogram = [1 << (255 - k) if k < 62 else 1 for k in range(256)]
    table = build_table(histogram)
    assert max(table.lengths) == MAX_CODE_BITS and min(table.lengths) >= 1
    assert sum(2.0**-length for length in table.lengths if length) <= 1.0
    assert is_prefix_free(table)
    # Skewed counts that need no limit keep their optimal lengths.
    table = build_table([0] * 100 + [8, 4, 2, 1, 1] + [0] * 151)
    assert table.lengths[100:105] == (1, 2, 3, 4, 4) and sum(table.lengths) == 14
    assert build_table([0] * 7 + [5] + [0] * 248).lengths[7] == 1


def test_a_table_of_weights_is_within_a_tenth_of_a_bit_of_their_entropy():
    # bf16 N(0, 0.02): what each exponent costs against the Shannon bound
    # (a Huffman code is within one bit; with the length limit on the rare
    # exponents it stays within 0.1 here).
    import math

    words = torch.randn(1 << 20, generator=torch.Generator().manual_seed(3)) * 0.02
    histogram = exponent_codec.exponent_histogram(words.to(torch.bfloat16).view(torch.int16))
    total = sum(histogram)
    entropy = -sum(c / total * math.log2(c / total) for c in histogram if c)
    bits = build_table(histogram).coded_bits(histogram) / total
    assert entropy <= bits <= entropy + 0.1


def test_bad_input_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="even number of bytes"):
        encode(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="even number of bytes"):
        encode(torch.zeros(4, dtype=torch.int16))
    assert encode(torch.zeros(0, dtype=torch.uint8)) is None


@compiled_kernels_only
def test_no_size_makes_triton_compile_a_kernel_again():
    # The worker's warm-up compiles the kernels once (coded_backup.prepare); a
    # size Triton specialized on (divisible by 16, equal to 1) would make it
    # compile another variant at a sleep or a wake, under vLLM's JIT monitor.
    sizes = {"symbols", "lanes", "piece_symbols", "total_words"}
    kernels = (
        exponent_codec._histogram_kernel,
        exponent_codec._count_kernel,
        exponent_codec._encode_kernel,
        exponent_codec._decode_kernel,
    )
    for kernel in kernels:
        names = {parameter.name for parameter in kernel.params}
        assert names & sizes <= set(kernel.do_not_specialize), kernel.fn.__name__


@compiled_kernels_only
@pytest.mark.parametrize(
    "target", [GPUTarget("cuda", 90, 32), GPUTarget("hip", "gfx942", 64)], ids=["sm_90", "gfx942"]
)
def test_the_kernels_compile_for_an_h200_and_an_mi300(target):
    # Compiled, not interpreted: a loop-carried value that changes type, or an
    # operation Triton cannot lower, fails here on a machine without a GPU.
    lanes = {"SYMBOLS_PER_LANE": 512, "LANES_PER_PROGRAM": 128}
    count = {"words": "*i16", "symbols": "i32", "lanes": "i32", "lengths": "*i32"}
    kernels = [
        (exponent_codec._count_kernel, {**count, "lane_bits": "*i32"}, lanes),
        (
            exponent_codec._encode_kernel,
            {
                **count,
                "codes": "*i32",
                "starts": "*i32",
                "stream": "*i32",
                "raw": "*u8",
                "ends": "*i32",
            },
            lanes,
        ),
        *(
            (
                exponent_codec._decode_kernel,
                {
                    "stream": "*i32",
                    "total_words": "i32",
                    "starts": "*i32",
                    "raw": "*u8",
                    "lookup": "*i32",
                    "out": "*i16",
                    "symbols": "i32",
                    "lanes": "i32",
                    "mismatches": "*i32",
                },
                {**lanes, "MAX_CODE_BITS": MAX_CODE_BITS, "CHECK": check},
            )
            for check in (False, True)
        ),
        (
            exponent_codec._histogram_kernel,
            {"words": "*i16", "symbols": "i64", "piece_symbols": "i64", "histograms": "*i32"},
            {"BLOCK": 2048, "BLOCKS_PER_PROGRAM": 32},
        ),
    ]
    for kernel, arguments, constants in kernels:
        names = list(inspect.signature(kernel.fn).parameters)
        signature = {name: arguments.get(name, "constexpr") for name in names}
        assert set(signature) - set(constants) == set(arguments), kernel.fn.__name__
        constexprs = {(names.index(name),): value for name, value in constants.items()}
        source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
        binary = "cubin" if target.backend == "cuda" else "hsaco"
        assert binary in triton.compile(source, target=target).asm, kernel.fn.__name__


@compiled_kernels_only
def test_an_allocation_of_4_gib_or_more_launches_the_variant_the_warm_up_compiled(monkeypatch):
    # Triton passes a size of 2**31 or more as i64 whatever do_not_specialize
    # says: a 4 GiB allocation's histograms (one launch per piece) must not
    # take another variant than the warm-up's sample (coded_backup.prepare)
    # compiled, at its first sleep.
    real = exponent_codec._histogram_kernel
    launches = []

    class Recorded:
        def __getitem__(self, grid):
            return lambda *arguments, **constants: launches.append((arguments, constants))

    monkeypatch.setattr(exponent_codec, "_histogram_kernel", Recorded())
    sample = torch.empty(2 * coded_backup.SAMPLE_WORDS, dtype=torch.uint8)  # what prepare codes
    large = torch.empty(4 << 30, dtype=torch.uint8, device="meta")  # no memory behind it
    pieces = coded_backup._split([(large, large)])
    chunks = [[sample], [piece.on_device([(large, large)]) for piece in pieces]]
    coded_backup._histograms(chunks, torch.device("cpu"))
    assert len(launches) == 1 + (4 << 30) // coded_backup.PIECE_BYTES
    assert launches[-1][0][1] == coded_backup.PIECE_BYTES // 2  # a piece's size, in words
    # What Triton's launcher makes of the arguments, on an H200: the cache key
    # of the compiled variant (triton/runtime/jit.py, JITFunction.run).
    backend = make_backend(GPUTarget("cuda", 90, 32))
    binder = create_function_from_signature(real.signature, real.params, backend)
    warm_up, *first_sleep = (binder(*arguments, **c)[1] for arguments, c in launches)
    assert all(key == warm_up for key in first_sleep)


def test_tables_of_random_histograms_are_complete_prefix_codes_within_the_limit():
    generator = torch.Generator().manual_seed(11)
    for _ in range(200):
        present = torch.rand(256, generator=generator) < torch.rand(1, generator=generator)
        present[torch.randint(0, 256, (1,), generator=generator)] = True
        scale = 2 ** torch.randint(0, 40, (256,), generator=generator).double()
        counts = (torch.rand(256, generator=generator).double() * scale).long() + 1
        histogram = (counts * present).tolist()
        table = build_table(histogram)
        assert all(
            (length > 0) == (count > 0)
            for length, count in zip(table.lengths, histogram, strict=True)
        )
        assert max(table.lengths) <= MAX_CODE_BITS
        kraft = sum(2.0**-length for length in table.lengths if length)
        assert kraft == 1.0 or (kraft == 0.5 and sum(present.tolist()) == 1)
        assert is_prefix_free(table)
