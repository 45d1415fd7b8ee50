"""--kv-disk-dir in the engine: the cache saved at shutdown comes back at the next start
(the system prompt hits on the first request), a corrupt page is recomputed (same reply as
without the cache, counter 1), another configuration leaves the directory untouched, and a
save while requests run keeps pages conserved."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import pytest

from engine_helpers import QUESTIONS, chat_ids, collect, make_engine, run_all, wait_idle
from radixserve.cache.tiers import DISK
from radixserve.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
PAGE_SIZE = 4


def snapshot(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def uncached(model_fp32):
    engine = make_engine(model_fp32, disable_radix_cache=True)
    prompts = [chat_ids(engine, q) for q in QUESTIONS[:2]]
    return prompts, [r.token_ids[0] for r in run_all(engine, prompts, GREEDY)]


def first_then_second(model_fp32, directory, uncached, **overrides):
    """Serve question 0 and shut down (saving); start again, serve question 1: -> its
    result and the second engine."""
    prompts, expected = uncached
    first = make_engine(model_fp32, page_size=PAGE_SIZE, kv_disk_dir=str(directory))
    assert [r.token_ids[0] for r in run_all(first, prompts[:1], GREEDY)] == expected[:1]
    assert first.persistence.last_save.pages_written > 0
    return make_engine(model_fp32, page_size=PAGE_SIZE, kv_disk_dir=str(directory),
                       **overrides)


def test_restart_hits_the_system_prompt_on_the_first_request(model_fp32, tmp_path, uncached):
    prompts, expected = uncached
    second = first_then_second(model_fp32, tmp_path / "kv", uncached)
    [result] = run_all(second, prompts[1:2], GREEDY)
    assert result.token_ids[0] == expected[1]
    shared = next(i for i, (a, b) in enumerate(zip(prompts[0], prompts[1])) if a != b)
    # Restored as disk-tier nodes: the whole pages are loaded (a partial page of a node
    # outside the pool is not copied-on-write, as for any tier load).
    assert result.final.usage.cached_tokens == shared - shared % PAGE_SIZE
    assert second.stats().tiers.l3.loaded_tokens >= shared - shared % PAGE_SIZE
    stats = second.stats().kv_disk
    assert stats.corrupt_pages == 0 and stats.restored_tokens >= shared - PAGE_SIZE


def test_a_flipped_byte_is_recomputed(model_fp32, tmp_path, uncached):
    prompts, expected = uncached
    second = first_then_second(model_fp32, tmp_path / "kv", uncached)
    pages = sorted((tmp_path / "kv" / "pages").glob("*.page"))
    victim = pages[3]                                     # inside the system prompt
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0x10
    victim.write_bytes(bytes(data))
    [result] = run_all(second, prompts[1:2], GREEDY)
    assert result.token_ids[0] == expected[1]             # as without the cache (fp32)
    assert result.final.usage.cached_tokens == 3 * PAGE_SIZE   # pages before the bad one
    assert second.stats().kv_disk.corrupt_pages == 1
    assert not victim.exists()


def test_another_page_size_leaves_the_directory_untouched(model_fp32, tmp_path, uncached,
                                                          caplog):
    first_then_second(model_fp32, tmp_path / "kv", uncached)
    before = snapshot(tmp_path / "kv")
    other = make_engine(model_fp32, page_size=8, kv_disk_dir=str(tmp_path / "kv"))
    assert other.persistence is None and other.stats().kv_disk is None
    lines = [r.getMessage() for r in caplog.records if "not used" in r.getMessage()]
    assert len(lines) == 1 and "page size 4 there, 8 here" in lines[0]
    run_all(other, uncached[0][:1], GREEDY)
    assert snapshot(tmp_path / "kv") == before


def test_save_while_requests_run(model_fp32, tmp_path, uncached):
    prompts, expected = uncached
    engine = make_engine(model_fp32, page_size=PAGE_SIZE, kv_disk_dir=str(tmp_path / "kv"))

    async def main():
        await engine.start()
        try:
            await collect(engine.generate(prompts[0], GREEDY))
            task = asyncio.create_task(collect(engine.generate(prompts[1], GREEDY)))
            report = await engine.save_cache()
            result = await task
            await wait_idle(engine)
            engine.check_invariants()
            again = await engine.save_cache()
            return report, result, again
        finally:
            await engine.shutdown()

    report, result, again = asyncio.run(main())
    assert result.token_ids[0] == expected[1]
    assert report["pages_written"] > 0 and report["complete"]
    assert again["pages_kept"] >= report["pages_written"]   # nothing written twice
    assert engine.persistence.last_save.pages_written == 0  # shutdown: nothing new


def test_a_save_cut_short_keeps_the_start_of_a_node(model_fp32, tmp_path, uncached,
                                                   monkeypatch):
    """A save that stops inside a node (the shutdown's grace ran out, or the disk filled:
    here the "disk" takes 5 pages) indexes the pages it wrote, parents first: the next
    start restores those 5 pages, not only whole nodes (a 5,300-token tool block saved as
    far as 4,300 tokens used to come back as its two whole 2,048-token nodes)."""
    from radixserve.engine import kv_persistence
    real, room = kv_persistence.write_pages, [5]

    def five_pages(disk, slots, payloads, *args):
        n = min(room[0], len(slots))
        room[0] -= n
        return real(disk, slots[:n], payloads[:n], *args)

    monkeypatch.setattr(kv_persistence, "write_pages", five_pages)
    prompts, expected = uncached
    second = first_then_second(model_fp32, tmp_path / "kv", uncached)
    monkeypatch.undo()
    [result] = run_all(second, prompts[1:2], GREEDY)
    assert second.stats().kv_disk.restored_tokens == 5 * PAGE_SIZE
    assert result.token_ids[0] == expected[1]
    assert result.final.usage.cached_tokens == 5 * PAGE_SIZE


def test_host_tier_contents_are_saved_and_restored(model_fp32, tmp_path):
    """A prefix pushed out of the pool into host memory (L2) is written down at shutdown
    too: after a restart (with a pool that holds it) it hits on the first request."""
    from test_engine_tiers import pool_for, run_in_turn, scenario

    probe = make_engine(model_fp32, disable_radix_cache=True)
    prompts = scenario(probe)[:-1]                  # A, then five others pushing A out
    expected = run_in_turn(probe, prompts[:1])[0].token_ids[0]
    small = pool_for(prompts) // PAGE_SIZE * PAGE_SIZE + 2 * PAGE_SIZE + 16
    first = make_engine(model_fp32, page_size=PAGE_SIZE, kv_cache_tokens=small,
                        kv_host_tokens=16384, kv_disk_dir=str(tmp_path / "kv"))
    run_in_turn(first, prompts)
    assert first.stats().tiers.l2.demoted_tokens > 0   # A went to host memory
    report = first.persistence.last_save
    assert report.complete and report.pages_written * PAGE_SIZE > small  # more than L1 holds
    second = make_engine(model_fp32, page_size=PAGE_SIZE, kv_disk_dir=str(tmp_path / "kv"))
    [result] = run_in_turn(second, prompts[:1])
    assert result.token_ids[0] == expected
    assert result.final.usage.cached_tokens >= len(prompts[0]) - PAGE_SIZE - 1


def test_one_store_restored_as_disk_tier_nodes(model_fp32, tmp_path):
    """The disk tier and the saved cache are one store: prefixes demoted to L3 are indexed
    from their own files (not written again), the whole directory stays under the one
    --kv-disk-bytes, and a restart rebuilds every node in L3 without taking pool pages;
    the first request loads its prefix from there."""
    from test_engine_tiers import pool_for, run_in_turn, scenario

    probe = make_engine(model_fp32, disable_radix_cache=True)
    prompts = scenario(probe)[:-1]                  # A, then five others pushing A out
    expected = run_in_turn(probe, prompts[:1])[0].token_ids[0]
    small = pool_for(prompts) // PAGE_SIZE * PAGE_SIZE + 2 * PAGE_SIZE + 16
    budget = 64 << 20
    kv = tmp_path / "kv"
    first = make_engine(model_fp32, page_size=PAGE_SIZE, kv_cache_tokens=small,
                        kv_disk_dir=str(kv), kv_disk_bytes=budget)
    run_in_turn(first, prompts)
    l3 = first.stats().tiers.l3
    assert l3.demoted_tokens > 0
    report = first.persistence.last_save
    assert report.complete
    # Pages on disk already were indexed from their files, not written again: the disk
    # tier's own (whole pages) and the copies it kept of pool pages before them (so they
    # survive a crash: docs/tiers.md); only the rest of the pool's were written.
    disk_nodes = first.tiers.lower.nodes[DISK].values()
    whole = sum(n.num_tokens // PAGE_SIZE for n in disk_nodes)
    partial = sum(len(n.pages) for n in disk_nodes) - whole
    assert report.pages_written * PAGE_SIZE <= small
    assert report.pages_kept >= whole > 0
    # The copies of pool pages took disk-tier slots: the tier's use counts them all.
    assert l3.cached_tokens == \
        (report.pages_kept + report.pages_written + partial) * PAGE_SIZE
    used = sum(p.stat().st_size for p in (kv / "pages").glob("*.page"))
    assert 0 < used <= budget

    second = make_engine(model_fp32, page_size=PAGE_SIZE, kv_cache_tokens=small,
                         kv_disk_dir=str(kv), kv_disk_bytes=budget)

    async def main():
        await second.start()
        try:
            restored = second.persistence.restored
            second.check_invariants()
            at_start = (second.tree.total_tokens, second.memory.num_free,
                        second.stats().tiers.l3.cached_tokens)
            result = await collect(second.generate(prompts[0], GREEDY))
            await wait_idle(second)
            second.check_invariants()
            return restored, at_start, result
        finally:
            await second.shutdown()

    restored, (pool_tokens, free, l3_tokens), result = asyncio.run(main())
    assert restored.tokens > small and restored.skipped_nodes == 0   # more than L1 holds
    assert pool_tokens == 0 and free == second.runner.num_pages     # no pool page taken
    assert l3_tokens == restored.tokens
    assert result.token_ids[0] == expected
    assert result.final.usage.cached_tokens >= len(prompts[0]) - 2 * PAGE_SIZE
    stats = second.stats()
    assert stats.tiers.l3.loaded_tokens >= len(prompts[0]) - 2 * PAGE_SIZE
    assert stats.tiers.corrupt_pages == 0
