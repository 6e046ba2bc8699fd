"""The windowed KV slice over NIXL between a context and a generation worker (Ray actors).

    python -m bench.transfer [--quick] [--out bench/out] [--reps N]

Geometry: a random GPT-OSS-shaped model built here (8 layers alternating
window-128 / full, 8 KV heads of 64, float32), B = 32 tokens per page, so a
page is 4 layers x 2 (K, V) x 32 x 8 x 64 x 4 B = 512 KiB per group. The
generation side reserves 3 draft tokens (scratch that never travels).

Per prompt length P (1k .. 32k tokens), measured side by side, reps interleaved:

- bytes moved by ``GenerationWorker.receive_kv`` (its ``ReadStats``) against
  the slice's minimum, computed here from P, W, B and the page size alone
  (must be exactly 1.00), and against a window-unaware transfer (every layer's
  whole prompt);
- its rate against ONE NIXL read of the same bytes in a single buffer (two
  plain actors, ``NixlTransport``, one registered tensor) and against a torch
  memory copy of the same bytes in this process (one thread);
- descriptors: pages before coalescing, runs after; and the same transfer into
  a fragmented generation pool (every other page held), where no page coalesces.

How the context pages are populated: prefilling 32k tokens takes many minutes
on a CPU (attention is quadratic), so a benchmark-only actor subclass binds the
prompt's pages exactly as prefill admission does (``KVCacheManager.allocate`` of
the whole prompt) and grants the same lease; the pages hold random values. The
transfer path (claim, plan, coalesce, NIXL read, release) is the real one. At
the smallest sizes the run also prefills for real and checks that the real
and the synthetic transfer move the same pages, descriptors and bytes.

    geometry.py  the model, page size, the slice's minimum   workers.py  benchmark-only actors
    measure.py   one measurement each, a size's figures       report.py   plot and tables
    cli.py       setup, cross-check, the sizes, main          __main__.py ``python -m bench.transfer``
"""

from bench.transfer.cli import main

__all__ = ["main"]
