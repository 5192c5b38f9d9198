"""`sluice bench attention`: the decode-attention kernel over blocks scattered in the pool, and over contiguous ones.

A fresh engine hands a batch's KV blocks out in order, so an in-process step measures the decode attention
over contiguous memory; a server that has run for a while hands out blocks its free list returns in any
order, and every block then starts at an address nothing predicted. This runs `paged_decode_attention`
(`engine_native/kernels/paged_attention.cpp`) on the same sequences laid out both ways: `--sequences`
sequences of `--context`/2 to `--context` tokens (uniform, seeded), their K/V written into a pool of
`--pool-blocks` blocks either at a random permutation of the pool or in order, a different set of blocks
for each of `--layers` layers (as each layer has its own cache). Each round calls the kernel once per layer
for each layout in turn (alternating, so drift hits both alike); it prints the median over `--rounds` in
ms for all layers, the K/V bytes read per ms as GB/s, and the load average, and checks that both layouts
gave the same output bits (the kernel's arithmetic must not depend on where a block lies).

It is the kernel's own in-process figure, on the bundled model's shapes by default (9 query heads, 3 KV
heads, head_dim 64, a bf16 cache unless --dtype float32), not a served figure: `sluice bench serve`
measures what a client sees. The pool is allocated as the engine process allocates its own, with transparent
huge pages asked for (engine_native/host_memory.py `ask_for_huge_pages`): with 4 KiB pages the scattered walk
pays TLB misses the engine does not (21 sequences of 800-1,600 tokens: ~40 against ~34 ms on an AVX-512 EPYC).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

LAYOUTS = ("scattered", "contiguous")


def add_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("attention", help="the decode-attention kernel over scattered and contiguous KV blocks",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sequences", type=int, default=32, help="decoding sequences, one query token each")
    p.add_argument("--context", type=int, default=200, help="longest context; lengths uniform in [context/2, context]")
    p.add_argument("--layers", type=int, default=30, help="calls per round, each over its own blocks")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--pool-blocks", type=int, default=16384, help="blocks in the pool (the default: 300 MiB of bf16 K and V)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="the cache's dtype")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", type=Path, default=None)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from engine_native.host_memory import ask_for_huge_pages

    ask_for_huge_pages()  # before torch's first allocation, as the engine process
    import torch

    from engine_native.kernels import cpu_kernels

    kernels = cpu_kernels()
    if kernels is None:
        print("Sluice's CPU kernels are not available here (no AVX2, no compiler, or SLUICE_KERNELS=0)")
        return 2
    dtype = getattr(torch, args.dtype)
    b, h, hkv, d, bs = args.sequences, args.heads, args.kv_heads, args.head_dim, args.block_size
    per_seq = (args.context + bs - 1) // bs
    if b * per_seq > args.pool_blocks:
        print(f"{b} sequences of {args.context} tokens need {b * per_seq} blocks: raise --pool-blocks")
        return 2
    if b * per_seq * args.layers > args.pool_blocks:
        # Layers share the pool; each takes its own blocks where there are enough of them.
        print(f"note: {args.layers} layers x {b * per_seq} blocks exceed the pool: layers reuse blocks")
    gen = torch.Generator().manual_seed(args.seed)
    lens = torch.randint(max(1, args.context // 2), args.context + 1, (b,), generator=gen, dtype=torch.int64)
    q = torch.randn(b, h, d, generator=gen)
    # The same logical K/V, [B, context, Hkv, D], written into the pool at each layout's blocks.
    keys = torch.randn(b, per_seq * bs, hkv, d, generator=gen).to(dtype)
    values = torch.randn(b, per_seq * bs, hkv, d, generator=gen).to(dtype)
    pools = {name: (torch.zeros(args.pool_blocks, bs, hkv, d, dtype=dtype),
                    torch.zeros(args.pool_blocks, bs, hkv, d, dtype=dtype)) for name in LAYOUTS}
    order = {"scattered": torch.randperm(args.pool_blocks, generator=gen), "contiguous": torch.arange(args.pool_blocks)}
    tables: dict[str, list[torch.Tensor]] = {name: [] for name in LAYOUTS}
    for name in LAYOUTS:
        k_pool, v_pool = pools[name]
        for layer in range(args.layers):
            start = layer * b * per_seq % max(1, args.pool_blocks - b * per_seq + 1)
            table = order[name][start:start + b * per_seq].view(b, per_seq).contiguous()
            k_pool[table] = keys.view(b, per_seq, bs, hkv, d)
            v_pool[table] = values.view(b, per_seq, bs, hkv, d)
            tables[name].append(table)
    scale = d ** -0.5

    def call(name: str, layer: int) -> torch.Tensor:
        k_pool, v_pool = pools[name]
        out: torch.Tensor = kernels.paged_decode_attention(q, k_pool, v_pool, tables[name][layer], lens, scale)
        return out

    same = all(torch.equal(call("scattered", layer), call("contiguous", layer)) for layer in range(args.layers))
    times: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    for r in range(args.rounds):
        for name in (LAYOUTS if r % 2 == 0 else LAYOUTS[::-1]):
            started = time.perf_counter()
            for layer in range(args.layers):
                call(name, layer)
            times[name].append(time.perf_counter() - started)
    kv_bytes = int(lens.sum()) * hkv * d * 2 * keys.element_size() * args.layers
    report: dict[str, Any] = {
        "sequences": b, "context": args.context, "layers": args.layers, "rounds": args.rounds,
        "threads": torch.get_num_threads(), "dtype": args.dtype, "kv_bytes": kv_bytes,
        "same_results": same, "load_average": os.getloadavg()[0], "layouts": {},
    }
    print(f"decode attention, {b} sequences of {args.context // 2}-{args.context} tokens, {args.layers} layers, "
          f"{args.dtype} cache, {torch.get_num_threads()} threads (in-process kernel figure, not a served one)")
    for name in LAYOUTS:
        median = statistics.median(times[name])
        report["layouts"][name] = {"median_ms": median * 1e3, "gb_per_s": kv_bytes / median / 1e9,
                                   "rounds_ms": [t * 1e3 for t in times[name]]}
        print(f"  {name:10s}  {median * 1e3:8.2f} ms  {kv_bytes / median / 1e9:6.1f} GB/s of K/V")
    print(f"  same output bits in both layouts: {same}; load average {report['load_average']:.2f}")
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(report, indent=2))
    return 0 if same else 1
