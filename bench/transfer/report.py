"""The transfer benchmark's plot and tables."""

from __future__ import annotations

from bench.common import print_table


def draw(plt, rows: list[dict]) -> None:
    fig, (rate, size, descriptors) = plt.subplots(1, 3, figsize=(17, 4.5))
    x = [r["prompt_len"] for r in rows]
    rate.plot(x, [r["slice_gb_s"] for r in rows], "o-", label="windowed slice (receive_kv)")
    rate.plot(x, [r["buffer_gb_s"] for r in rows], "s--", label="one NIXL read, one buffer")
    rate.plot(x, [r["memcpy_gb_s"] for r in rows], "^:", label="torch memory copy")
    frag = [r for r in rows if "fragmented_gb_s" in r]
    rate.plot([r["prompt_len"] for r in frag], [r["fragmented_gb_s"] for r in frag], "x-.",
              label="slice, fragmented pool")
    rate.set(xscale="log", xlabel="prompt tokens", ylabel="GB/s", title="transfer rate (median)")
    rate.legend()
    mib = 2 ** 20
    size.plot(x, [r["bytes_window_unaware"] / mib for r in rows], "s--",
              label="window-unaware (every layer, whole prompt)")
    size.plot(x, [r["bytes_moved"] / mib for r in rows], "o-", label="moved")
    size.plot(x, [r["bytes_min"] / mib for r in rows], "k.", label="minimum (from P, W, B)")
    size.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="MiB per request", title="bytes per request")
    size.legend()
    descriptors.plot(x, [r["pages"] for r in rows], "s--", label="pages (before coalescing)")
    descriptors.plot(x, [r["descriptors"] for r in rows], "o-", label="runs = descriptors (after)")
    descriptors.plot([r["prompt_len"] for r in frag], [r["fragmented_descriptors"] for r in frag], "x-.",
                     label="runs, fragmented pool")
    descriptors.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="per transfer", title="descriptors")
    descriptors.legend()


def print_tables(result: dict) -> None:
    rows = result["sizes"]
    print_table("windowed KV slice over NIXL (B=32, W=128, 512 KiB pages)",
                ["P", "MiB", "x min", "unaware/moved", "pages", "runs", "slice GB/s", "buffer GB/s", "memcpy GB/s",
                 "slice/buffer", "(best)", "slice/memcpy", "frag runs", "frag/slice"],
                [[r["prompt_len"], r["bytes_moved"] / 2**20, r["bytes_ratio"], r["window_unaware_over_moved"],
                  r["pages"], r["descriptors"], r["slice_gb_s"], r["buffer_gb_s"], r["memcpy_gb_s"],
                  r["slice_over_buffer"], r["slice_over_buffer_best"], r["slice_over_memcpy"],
                  r.get("fragmented_descriptors", "-"),
                  r.get("fragmented_over_slice", "-")] for r in rows])
    print_table("real prefill vs synthetic pages", ["P", "pages", "runs", "bytes", "same"],
                [[c["prompt_len"], c["real_num_pages"], c["real_num_descriptors"], c["real_num_bytes"], c["same"]]
                 for c in result["cross_check"]])
