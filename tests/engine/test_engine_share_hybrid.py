"""--kv-share with a hybrid model (Gemma 3: sliding-window and full-attention layers).

A shared page carries the full-attention pool's bytes only; with a windowed pool
(`--kv-window-pool auto`, the default) a page's sliding-window layers live elsewhere, so a
loaded page would lack its windows. Sharing therefore stays off there (the engine computes,
publishes nothing, and says so), and works with `--kv-window-pool off`, where every layer's
KV is in the shared page. Greedy tokens equal the cache-off run's either way."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from engine_helpers import make_engine
from share_helpers import serve

from radixserve.cache.window_memory import WindowedMemory

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from hybrid_models import WINDOW, build_family  # noqa: E402

PROMPT = list(range(10, 10 + 6 * WINDOW)) + [7, 8, 9]      # 99 tokens: 6 windows
PAGE = 4


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return build_family("gemma3", tmp_path_factory.mktemp("share-gemma3")).loaded


def test_a_windowed_pool_shares_nothing_and_full_kv_is_shared(gemma3, tmp_path):
    (expected,) = serve(make_engine(gemma3, page_size=PAGE, disable_radix_cache=True),
                        [PROMPT], drain=False)

    windowed = make_engine(gemma3, page_size=PAGE, kv_share=f"dir:{tmp_path / 'w'}")
    assert isinstance(windowed.memory, WindowedMemory) and windowed.peers is None
    (got,) = serve(windowed, [PROMPT])
    assert got.token_ids[0] == expected.token_ids[0]
    assert windowed.stats().share is None
    assert not (tmp_path / "w").exists() or not any((tmp_path / "w").iterdir())

    a, b = (make_engine(gemma3, page_size=PAGE, kv_window_pool="off",
                        kv_share=f"dir:{tmp_path / 'full'}") for _ in range(2))
    assert a.peers is not None and a.runner.windowed is None
    serve(a, [PROMPT])
    pages = (len(PROMPT) - 1) // PAGE
    assert a.stats().share.published_pages == pages
    (loaded,) = serve(b, [PROMPT])
    assert b.stats().share.loaded_tokens == pages * PAGE
    assert loaded.final.usage.cached_tokens == pages * PAGE
    assert loaded.token_ids[0] == expected.token_ids[0]
