"""What reusing a cached prefix costs on the slot-based KV cache, against the prefill it saves.

Prints, for a model (default: the demo target, bf16 with the CPU kernels), seconds per token of:
- prefill: one forward over N prompt tokens (what a cache hit saves);
- copy: `KVCache.copy_prefix` of L positions from one slot to another in every layer (what a hit costs here);
- block gather: reading L positions of every layer through a block table (16 positions a block, by index), the
  price a forward pays on *every* step when prefixes are shared by reference but attention reads contiguous keys;
  and a decode step at that context, for scale.

Usage: python scripts/prefix_copy_cost.py [MODEL] [--dtype bfloat16] [--tokens 512] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specdec_core.build import prepare_model
from specdec_core.runner import ModelRunner, RunnerConfig

BLOCK = 16


def _best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", nargs="?", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    n = args.tokens
    loaded = prepare_model(args.model, dtype=args.dtype)
    runner = ModelRunner(loaded.model, RunnerConfig(num_slots=2, max_seq_len=n + 16))
    cache = runner.cache
    a, b = runner.allocate(), runner.allocate()
    prompt = torch.randint(0, runner.vocab_size, (n,)).tolist()

    def prefill() -> None:
        runner.truncate(a, 0)
        runner.extend([a], [prompt])

    prefill_s = _best(prefill, args.repeat)
    decode_s = _best(lambda: (runner.extend([a], [[7]]), runner.truncate(a, n)), args.repeat)
    copy_s = {length: _best(lambda: cache.copy_prefix(a, b, length), args.repeat) for length in (64, n // 2, n)}
    # Shared blocks: slot a's positions as blocks of 16; a forward reads a sequence's keys through its table.
    m = n // BLOCK * BLOCK
    table = torch.arange(m // BLOCK)  # [L / 16]

    def gather() -> None:
        for kc, vc in zip(cache.keys, cache.values):  # [slots, Hkv, capacity, hd]
            for c in (kc, vc):
                blocks = c[a, :, :m].unflatten(1, (-1, BLOCK))  # [Hkv, L/16, 16, hd]
                blocks.index_select(1, table).flatten(1, 2)  # [Hkv, L, hd]: contiguous for attention

    gather_s = _best(gather, args.repeat)
    print(json.dumps({
        "model": str(args.model), "dtype": args.dtype, "threads": torch.get_num_threads(), "tokens": n,
        "bytes_per_position": cache.bytes_per_position,
        "prefill_ms_per_token": 1000 * prefill_s / n,
        "decode_step_ms": 1000 * decode_s,
        "copy_ms_per_token": {length: 1000 * s / length for length, s in copy_s.items()},
        "copy_ms": {length: 1000 * s for length, s in copy_s.items()},
        "block_gather_ms_per_forward": {m: 1000 * gather_s},
        "prefill_over_copy": (prefill_s / n) / statistics.mean(s / length for length, s in copy_s.items()),
    }, indent=2))


if __name__ == "__main__":
    main()
