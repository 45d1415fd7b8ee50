"""A hybrid model's window pools with host/disk tiers and persistence (tiny Gemma 3, window
16, page 4): a path demoted to host memory or disk keeps its windows in the windowed pool
under its new ids and is loaded back with them, so the hit reaches past the first window;
after a restart (a save's, or a crash's: the disk tier journals each page's window with it)
the windows come back with the paths (without them the match backs off); the restart runs
for Gemma 3, sliding-window Mistral and Qwen2. Greedy tokens
always equal the cache-off run's, and every page of both pools is accounted for."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import numpy as np
import pytest

from engine_helpers import check_pages, collect, make_engine, run_scenario, wait_idle
from radixserve.cache.miss_reasons import MissReason
from radixserve.cache.tiers import DISK
from radixserve.cache.window_memory import WindowedMemory
from radixserve.engine.sampling_params import SamplingParams
from radixserve.storage.journal import PageAdded, journal_files, read_journal
from radixserve.storage.store_index import decode_index

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from hybrid_models import WINDOW, build_family  # noqa: E402

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
CHECKPOINT = 6 * WINDOW                  # kept windows: the first, 96, each end
DONOR = list(range(10, 10 + 8 * WINDOW))                    # 128 tokens
# The donor, two prompts of their own that push it out of a small pool, then the donor's
# prefix again, diverging at the checkpoint far past the first window.
OTHERS = [[(t * (i + 3) + 17 * i) % 251 + 5 for t in DONOR] for i in range(2)]
PROMPTS = [DONOR + [200, 201], *OTHERS, DONOR[:6 * WINDOW] + [230, 231, 232]]
POOL = 2 * (len(DONOR) + 2 + GREEDY.max_tokens + 16)
DISK_BYTES = 8 << 20        # a small disk tier: its invariant check stays quick


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """name -> (tiny model, its cache-off greedy tokens for PROMPTS), built once each."""
    built = {}

    def get(name: str):
        if name not in built:
            model = build_family(name, tmp_path_factory.mktemp(f"tiers-{name}")).loaded
            built[name] = model, [r.token_ids[0] for r in run_in_turn(
                make_engine(model, page_size=4, disable_radix_cache=True), PROMPTS)]
        return built[name]
    return get


@pytest.fixture(scope="module")
def gemma3(families):
    return families("gemma3")[0]


@pytest.fixture(scope="module")
def uncached(families):
    return families("gemma3")[1]


def run_in_turn(engine, prompts):
    async def scenario(engine):
        out = []
        for p in prompts:
            out.append(await collect(engine.generate(p, GREEDY)))
            check_pages(engine)         # idle between requests: both pools conserved
        return out
    return run_scenario(engine, scenario, check=check_pages)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_demoted_path_comes_back_with_its_windows(gemma3, uncached, tmp_path, tier):
    flags = (dict(kv_host_tokens=8 * POOL) if tier == "host"
             else dict(kv_disk_dir=str(tmp_path), kv_disk_bytes=DISK_BYTES))
    # Prefill chunks of 32 tokens: a running request holds few windows, so the windowed
    # pool (as large as the full one here) keeps every path's kept windows.
    engine = make_engine(gemma3, page_size=4, kv_cache_tokens=POOL, chunked_prefill_size=32,
                         kv_window_checkpoint=CHECKPOINT, **flags)
    assert isinstance(engine.memory, WindowedMemory)
    got = run_in_turn(engine, PROMPTS)
    assert [r.token_ids[0] for r in got] == uncached
    flow = getattr(engine.stats().tiers, "l2" if tier == "host" else "l3")
    assert flow.demoted_tokens > 0 and flow.loaded_tokens > 0
    # The windows of the checkpoint at 96 came back with the load: a hit past the first
    # window, the whole shared prefix.
    assert got[-1].final.usage.cached_tokens == 6 * WINDOW


def save(gemma3, tmp_path, prompts) -> dict:
    """Serve `prompts` with --kv-disk-dir (its shutdown saves); -> the flags to restart."""
    flags = dict(page_size=4, kv_disk_dir=str(tmp_path), kv_disk_bytes=DISK_BYTES,
                 kv_window_checkpoint=CHECKPOINT)
    first = make_engine(gemma3, **flags)
    run_in_turn(first, prompts)
    report = first.persistence.last_save
    assert report.pages_written > 0 and report.windows_written > 0
    return flags


# Gemma 3 (local/global/local), Mistral (every layer windowed), Qwen2 (layer 1 windowed).
@pytest.mark.parametrize("family", ["gemma3", "mistral", "qwen2"])
def test_after_a_restart_the_saved_windows_let_the_path_hit(families, family, tmp_path):
    """The save writes the windows beside the pages; the restart reads them into the
    windowed pool under the restored disk-tier ids, so the match loads the path and ends
    at the checkpoint at 96, as it did before the restart."""
    model, uncached = families(family)
    again = make_engine(model, **save(model, tmp_path, PROMPTS[:1]))
    assert isinstance(again.memory, WindowedMemory)
    (got,) = run_in_turn(again, PROMPTS[-1:])
    assert again.persistence.restored.windows > 0
    assert again.stats().kv_disk.recovery["restored_windows"] == again.persistence.restored.windows
    assert got.token_ids[0] == uncached[-1]
    assert got.final.usage.cached_tokens == 6 * WINDOW
    assert again.stats().tiers.l3.loaded_tokens >= 6 * WINDOW


def test_a_restart_without_the_window_files_backs_off(gemma3, uncached, tmp_path):
    """Window files gone (as after a kill the disk tier's journal recovers: windows are
    saved by a save only): the restored path is matched, found without windows, not
    loaded, and recomputed (reason window_missing)."""
    flags = save(gemma3, tmp_path, PROMPTS[:1])
    index = decode_index((tmp_path / "index.bin").read_bytes())
    window_keys = {k for n in index.nodes for k in n.window_keys if k}
    assert window_keys
    for path in (tmp_path / "pages").iterdir():
        if int(path.name.split(".")[0], 16) in window_keys:
            path.unlink()
    again = make_engine(gemma3, **flags)
    (got,) = run_in_turn(again, PROMPTS[-1:])
    assert got.token_ids[0] == uncached[-1]
    assert again.persistence.restored.windows == 0
    assert again.stats().tiers.l3.cached_tokens >= len(DONOR)     # restored on disk
    assert got.final.usage.cached_tokens == 0
    assert got.final.usage.miss.reason == MissReason.WINDOW_MISSING
    assert again.stats().tiers.l3.loaded_tokens == 0        # nothing loaded in vain


def serve_then_crash(model, flags: dict, prompts) -> None:
    """Serve `prompts` with the disk tier, wait until its writes are on disk, then stop
    without a save (as after kill -9: only the journal names the pages since)."""
    engine = make_engine(model, **flags)

    async def scenario():
        await engine.start()
        for p in prompts:
            await collect(engine.generate(p, GREEDY))
            check_pages(engine)
        await wait_idle(engine)
        await asyncio.to_thread(engine.tiers.writer.drain)     # the files and records
        engine.tiers.moves_done()
        check_pages(engine)
        assert engine.tiers.lower.nodes[DISK]
        engine.persistence.restored = None          # no save at shutdown
        await engine.shutdown()

    asyncio.run(scenario())
    assert engine.persistence.saves == 0


def journal_windows(directory: Path) -> dict[tuple[int, ...], int]:
    """The journal's window files: page tokens -> its window's key."""
    return {tuple(r.token_ids): r.window_key
            for _, path in journal_files(directory / "journal")
            for r in read_journal(path).records
            if isinstance(r, PageAdded) and r.window_key}


@pytest.fixture
def crashed(gemma3, tmp_path):
    """The donor pushed to disk by two other prompts, then a crash; -> the flags."""
    flags = dict(page_size=4, kv_cache_tokens=POOL, chunked_prefill_size=32,
                 kv_window_checkpoint=CHECKPOINT, kv_disk_dir=str(tmp_path),
                 kv_disk_bytes=DISK_BYTES, kv_disk_journal_sync_ms=0)
    serve_then_crash(gemma3, flags, PROMPTS[:3])
    return flags


def test_after_a_crash_the_journaled_windows_let_the_path_hit(gemma3, uncached, crashed,
                                                             tmp_path):
    """The disk tier writes each demoted page's window beside it, named by its journal
    record: after a crash without a save the restart restores the windows with the
    pages, and the donor's prefix hits to its checkpoint, as before the crash."""
    assert journal_windows(tmp_path)
    again = make_engine(gemma3, **crashed)
    (got,) = run_in_turn(again, PROMPTS[-1:])
    assert again.persistence.saves == 1               # (its own shutdown's)
    recovery = again.stats().kv_disk.recovery
    assert recovery["journal_records"] > 0 and recovery["restored_windows"] > 0
    assert got.token_ids[0] == uncached[-1]
    assert got.final.usage.cached_tokens == 6 * WINDOW
    assert again.stats().tiers.l3.loaded_tokens >= 6 * WINDOW


def test_a_corrupt_journaled_window_backs_off_never_a_wrong_reply(gemma3, uncached, crashed,
                                                                  tmp_path):
    """One flipped byte in the window file the checkpoint at 96 reads: the restart finds
    it failing its check, that point is not usable, and the match backs off to an
    earlier one (window_missing); the reply still equals the cache-off run's."""
    key = journal_windows(tmp_path)[tuple(DONOR[6 * WINDOW - 4:6 * WINDOW])]
    path = tmp_path / "pages" / f"{key:016x}.page"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    again = make_engine(gemma3, **crashed)
    (got,) = run_in_turn(again, PROMPTS[-1:])
    assert again.persistence.store.corrupt_pages == 1
    assert got.token_ids[0] == uncached[-1]
    assert got.final.usage.cached_tokens < 6 * WINDOW
    assert got.final.usage.miss.reason == MissReason.WINDOW_MISSING


def test_windows_the_pool_lost_are_read_back_from_their_files(gemma3, uncached, crashed):
    """After the restart every restored window is dropped from the windowed pool (as a
    short pool drops demoted nodes' windows first, or a restart with more windows on disk
    than free pages): the match finds the checkpoint's windows in their files, reads them
    back with the load, and hits to 96 as before; greedy equal, pools conserved."""
    again = make_engine(gemma3, **crashed)

    async def scenario(engine):
        windows = engine.memory.windows
        assert windows.lower                    # restored under disk-tier ids
        assert engine.memory.drop_windows(np.fromiter(windows.lower, np.int64)) > 0
        check_pages(engine)
        got = await collect(engine.generate(PROMPTS[-1], GREEDY))
        check_pages(engine)
        return got

    got = run_scenario(again, scenario)
    assert got.token_ids[0] == uncached[-1]
    assert got.final.usage.cached_tokens == 6 * WINDOW
    assert again.memory.stored.loaded > 0
