"""The disk tier between saves (storage/journal.py): pages demoted to disk after the last
save come back after a crash (no save at the end, as with kill -9), replies stay equal to
the uncached ones, and a page loaded back into the pool keeps its disk copy (the tier is
inclusive) until the disk tier needs the room or a save takes it over."""

from __future__ import annotations

import asyncio

from engine_helpers import collect, make_engine, wait_idle
from test_engine_tiers import GREEDY, pool_for, uncached  # noqa: F401  (a fixture)

from radixserve.cache.tiers import DISK
from radixserve.storage.journal import PagesTouched, journal_files, read_journal

PAGE = 16


def disk_engine(model, directory, prompts):
    pool = pool_for(prompts) // PAGE * PAGE + 2 * PAGE + 16
    return make_engine(model, page_size=PAGE, kv_cache_tokens=pool,
                       kv_disk_dir=str(directory), kv_disk_journal_sync_ms=0)


def test_pages_demoted_after_the_last_save_survive_a_crash_and_loads_keep_copies(
        model_fp32, uncached, tmp_path):  # noqa: F811
    prompts, expected = uncached
    first = disk_engine(model_fp32, tmp_path, prompts)

    async def serve_then_crash():
        await first.start()
        for p, want in zip(prompts[:-1], expected):   # A, then others push it to disk
            out = await collect(first.generate(p, GREEDY))
            assert out.token_ids[0] == want
        await wait_idle(first)
        first.check_invariants()
        await asyncio.to_thread(first.tiers.writer.drain)   # what the files hold
        first.tiers.moves_done()
        assert first.tiers.lower.nodes[DISK]
        on_disk = set(first.persistence.store.page_keys())
        # The crash: no save at the end (as after kill -9); the process's files and
        # journal are what the next start finds.
        first.persistence.restored = None
        await first.shutdown()
        return on_disk

    on_disk = asyncio.run(serve_then_crash())
    assert first.persistence.saves == 0               # only the journal knows the pages
    second = disk_engine(model_fp32, tmp_path, prompts)

    async def after_restart():
        await second.start()
        try:
            restored = second.persistence.restored
            recovery = second.stats().kv_disk.recovery
            assert recovery["journal_records"] > 0 and recovery["seconds"] > 0
            assert restored.pages >= 0.95 * len(on_disk), (restored.pages, len(on_disk))
            out = await collect(second.generate(prompts[-1], GREEDY))     # A again
            assert out.token_ids[0] == expected[-1]
            assert out.final.usage.cached_tokens > 0      # from disk, known by the journal
            await wait_idle(second)
            second.check_invariants()
            tiers = second.tiers.lower
            kept = [tiers.disk.key_of(s) for s in tiers.kept]
            assert kept and None not in kept              # loaded, and still on disk
            assert set(kept) <= set(second.persistence.store.page_keys())
            store = second.persistence.store              # the load's recency, journaled
            store.journal.sync()
            touched = {k for _, path in journal_files(store.journal.directory)
                       for r in read_journal(path).records if isinstance(r, PagesTouched)
                       for k in r.keys}
            assert set(kept) & touched, (kept, touched)   # the loaded ones (not ancestor copies)
            report = await second.persistence.save()      # the save takes them over
            assert report.pages_kept >= len(kept) and not tiers.kept
            second.check_invariants()
        finally:
            await second.shutdown()

    asyncio.run(after_restart())
