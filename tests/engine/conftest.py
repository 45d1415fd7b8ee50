"""Fixtures shared by the --kv-share engine test modules (computed once per session)."""

from __future__ import annotations

import pytest
from engine_helpers import QUESTIONS, chat_ids, make_engine
from share_helpers import serve


@pytest.fixture(scope="session")
def share_prompts(model_fp32):
    """Two chat prompts sharing a system prompt, and their greedy tokens, cache off."""
    engine = make_engine(model_fp32, disable_radix_cache=True)
    ps = [chat_ids(engine, q) for q in QUESTIONS[:2]]
    expected = [r.token_ids[0] for r in serve(engine, ps, drain=False)]
    return ps, expected


@pytest.fixture(scope="session")
def share_published(model_fp32, share_prompts, tmp_path_factory):
    """A directory holding the pages engine A computed for the first prompt."""
    root = tmp_path_factory.mktemp("share")
    a = make_engine(model_fp32, page_size=16, kv_share=f"dir:{root}")
    serve(a, share_prompts[0][:1])
    assert a.stats().share.published_pages == (len(share_prompts[0][0]) - 1) // 16
    return root
