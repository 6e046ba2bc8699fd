"""NIXL between two Ray actors (separate processes), peers found via PeerDirectory."""

from __future__ import annotations

import hashlib
import os
import random
from pathlib import Path

import pytest
import ray
import torch

from bench.common import start_ray

pytest.importorskip("nixl._api")

from actors.peers import PeerDirectory, PeerMismatchError, PeerNotFoundError, compat_differences  # noqa: E402
from actors.transport import LocalFabric, coalesce, make_transport, unique_agent_name  # noqa: E402

REPO = str(Path(__file__).resolve().parents[2])
COMPAT = {"model": "tiny-swa", "dtype": "float32", "tokens_per_block": 16,
          "page_layout": "[num_pages, layers, 2, block, kv_heads, head_dim]",
          "groups": [{"name": "full", "window": None}, {"name": "swa", "window": 64}]}
NUM_PAGES = {"full": 64, "swa": 32, "bench": 2048}
BENCH_PAGE_ELEMS = 64 * 1024 // 4    # 64 KiB pages of float32


@ray.remote(num_cpus=0)
class PageHolder:
    """One worker's page tensors, NIXL transport and peer directory."""

    def __init__(self, role: str, seed: int, compat: dict, progress_delay_us: int | None) -> None:
        torch.set_num_threads(1)
        gen = torch.Generator().manual_seed(seed)
        tensors = {g: torch.randn(n, 2, 2, 16, 4, dtype=torch.float32, generator=gen)
                   for g, n in NUM_PAGES.items() if g != "bench"}
        tensors["bench"] = torch.randn(NUM_PAGES["bench"], BENCH_PAGE_ELEMS, generator=gen)
        self.transport = make_transport("nixl", unique_agent_name(role), progress_delay_us=progress_delay_us)
        self.transport.register(tensors)
        self.directory = PeerDirectory(self.transport, compat)
        self.directory.publish()

    def agent_name(self) -> str:
        return self.transport.agent_name

    def ensure_connected(self, peer_name: str) -> None:
        self.directory.ensure_connected(peer_name)

    def read(self, peer_name: str, pairs: dict[str, list[tuple[int, int]]]):
        runs = [run for group, p in pairs.items() for run in coalesce(p, group)]
        self.transport.read(peer_name, runs)
        return self.transport.last_read

    def pages(self, group: str, page_ids: list[int]) -> torch.Tensor:
        return self.transport.tensors[group][page_ids].clone()

    def digest(self, group: str, page_ids: list[int]) -> str:
        """The pages' bytes in order, hashed here: 64 MiB compared without shipping it through Ray."""
        return hashlib.sha256(self.transport.tensors[group][page_ids].numpy().tobytes()).hexdigest()

    def close(self) -> None:
        self.directory.unpublish()
        self.transport.close()


@pytest.fixture(scope="module")
def holders():
    start_ray(num_cpus=2,
              runtime_env={"env_vars": {"PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}})
    # The context side serves reads, so it needs NIXL's progress thread; the reader drives its own.
    ctx = PageHolder.remote("ctx", seed=1, compat=COMPAT, progress_delay_us=1000)
    gen = PageHolder.remote("gen", seed=2, compat=COMPAT, progress_delay_us=None)
    ctx_name, gen_name = ray.get([ctx.agent_name.remote(), gen.agent_name.remote()])
    ray.get(gen.ensure_connected.remote(ctx_name))
    yield ctx, gen, ctx_name
    ray.get([ctx.close.remote(), gen.close.remote()])
    ray.shutdown()


def _scattered(num: int, num_src: int, num_dst: int, rng: random.Random) -> list[tuple[int, int]]:
    return list(zip(rng.sample(range(num_src), num), rng.sample(range(num_dst), num)))


def test_reader_pulls_scattered_pages_exactly(holders):
    ctx, gen, ctx_name = holders
    rng = random.Random(0)
    scattered_dst = rng.sample([p for p in range(NUM_PAGES["full"]) if p not in (10, 11, 12)], 40)
    pairs = {"full": list(zip(rng.sample(range(60), 40), scattered_dst)) + [(60, 10), (61, 11), (62, 12)],
             "swa": [(i, i + 4) for i in range(3, 20)]}
    untouched = {g: sorted(set(range(NUM_PAGES[g])) - {d for _, d in p}) for g, p in pairs.items()}
    before = {g: ray.get(gen.pages.remote(g, untouched[g])) for g in pairs}

    stats = ray.get(gen.read.remote(ctx_name, pairs))

    for group, p in pairs.items():
        src = ray.get(ctx.pages.remote(group, [s for s, _ in p]))
        dst = ray.get(gen.pages.remote(group, [d for _, d in p]))
        assert torch.equal(src, dst), f"group {group}: pulled pages differ from the source"
        assert torch.equal(ray.get(gen.pages.remote(group, untouched[group])), before[group])
    assert stats.num_pages == sum(len(p) for p in pairs.values())
    assert stats.num_descriptors < stats.num_pages    # the swa run and the full tail coalesced


def test_incompatible_peer_is_refused_with_the_field_named(holders):
    _, gen, _ = holders
    impostor = make_transport("local", unique_agent_name("ctx"), fabric=LocalFabric())
    impostor.register({"full": torch.zeros(4, 8)})
    PeerDirectory(impostor, {**COMPAT, "tokens_per_block": 32}).publish()
    with pytest.raises(PeerMismatchError, match=r"tokens_per_block: ours=16 peer=32"):
        ray.get(gen.ensure_connected.remote(impostor.agent_name))


def test_directory_connects_once_and_forgets(holders):
    fabric = LocalFabric()
    a, b = (make_transport("local", unique_agent_name(role), fabric=fabric) for role in ("ctx", "gen"))
    for t in (a, b):
        t.register({"full": torch.randn(4, 8)})
    dir_a, dir_b = PeerDirectory(a, COMPAT), PeerDirectory(b, COMPAT)
    dir_a.publish()
    dir_b.ensure_connected(a.agent_name)
    dir_b.ensure_connected(a.agent_name)
    assert dir_b.is_connected(a.agent_name) and b.is_connected(a.agent_name)
    dir_b.forget(a.agent_name)
    assert not b.is_connected(a.agent_name)
    dir_a.unpublish()
    with pytest.raises(PeerNotFoundError):
        dir_b.ensure_connected(a.agent_name)


def test_compat_differences_name_nested_fields_with_both_values():
    theirs = {**COMPAT, "dtype": "bfloat16", "layout": {"heads": 4}}
    assert compat_differences({**COMPAT, "layout": {"heads": 8}}, theirs) == [
        "dtype: ours='float32' peer='bfloat16'", "layout.heads: ours=8 peer=4"]


def test_large_reads_land_every_byte_in_coalesced_descriptors(holders):
    """A long prompt's sizes: one 64 MiB run (one descriptor) and 1024 scattered 64 KiB pages (one
    descriptor per coalesced run): every destination page holds its source page's bytes afterwards.
    Their rates are bench's to measure (``python -m bench.transfer``: the slice against one NIXL read
    of the same bytes), not a test's."""
    ctx, gen, ctx_name = holders
    scattered = _scattered(1024, 2048, 2048, random.Random(1))
    for pairs, num_runs in (([(i, 1024 + i) for i in range(1024)], 1), (scattered, len(coalesce(scattered, "bench")))):
        stats = ray.get(gen.read.remote(ctx_name, {"bench": pairs}))
        assert (stats.num_pages, stats.num_bytes) == (len(pairs), len(pairs) * BENCH_PAGE_ELEMS * 4)
        assert stats.num_descriptors == num_runs
        src = ray.get(ctx.digest.remote("bench", [s for s, _ in pairs]))
        assert ray.get(gen.digest.remote("bench", [d for _, d in pairs])) == src
