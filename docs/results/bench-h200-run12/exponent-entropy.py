"""How few bytes could a level-1 wake copy for the bench's random bf16 weights?

Draws 5e7 values the way vllm_graph_sleep.models initialises matrices (normal,
std 0.02, in bf16), and prints the entropy of the 8-bit exponent field and the
average length of a Huffman code for it; sign and mantissa (8 bits) stay raw.
CPU only; seeded, so it prints the same figures every time."""

import heapq

import torch

VALUES = 50_000_000
INIT_STD = 0.02

torch.manual_seed(0)
words = (torch.randn(VALUES) * INIT_STD).to(torch.bfloat16).view(torch.int16).to(torch.int32)
exponents = (words >> 7) & 0xFF
counts = torch.bincount(exponents, minlength=256).double()
probabilities = counts[counts > 0] / counts.sum()
entropy = float(-(probabilities * probabilities.log2()).sum())

# Huffman code lengths: every merge adds one bit to each symbol below it.
lengths = {symbol: 0 for symbol, count in enumerate(counts.tolist()) if count > 0}
heap = [(counts[symbol].item(), symbol, [symbol]) for symbol in lengths]
heapq.heapify(heap)
tiebreak = 256
while len(heap) > 1:
    first, second = heapq.heappop(heap), heapq.heappop(heap)
    for symbol in first[2] + second[2]:
        lengths[symbol] += 1
    heapq.heappush(heap, (first[0] + second[0], tiebreak, first[2] + second[2]))
    tiebreak += 1
huffman = sum(counts[s].item() * n for s, n in lengths.items()) / counts.sum().item()

print(f"exponent entropy {entropy:.3f} bits, Huffman average {huffman:.3f} bits")
print(f"bytes to copy: {(8 + entropy) / 16:.1%} at the entropy, {(8 + huffman) / 16:.1%} Huffman")
