"""kill -9 of a writer mid-save, at seeded random moments: every reopening restores a
consistent index whose pages all read back with their own content, or ignores what it
cannot use with a warning. The writer prints a line after each step; the test kills it
after the k-th line (an event, not a guessed delay)."""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from radixserve.storage import DiskPageStore

from .store_helpers import contents_of, fingerprint, payload_for

ROOT = Path(__file__).resolve().parents[2]


def run_and_kill(directory: Path, seed: int, after_lines: int) -> list[str]:
    """Start the writer, SIGKILL it once it printed `after_lines` lines; -> those lines."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.storage.crash_writer",
                             str(directory), str(seed)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        while len(lines) < after_lines:
            line = proc.stdout.readline()
            assert line, f"writer exited early: {proc.wait()} {proc.stderr.read()}"
            lines.append(line.strip())
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    return lines


def check_consistent(directory: Path) -> int:
    """Reopen the store; -> restored nodes. Fails unless every restored node's parent is
    restored before it and each of its pages reads back with the content its edge names
    -- or, for a key written again after the index, is refused as stale, never served."""
    store = DiskPageStore(directory, fingerprint())
    assert store.usable, store.refusal
    index = store.read_index()
    nodes = index.nodes if index else []
    seen = {}
    for n in nodes:
        assert n.parent_id is None or seen[n.parent_id] == n.namespace
        seen[n.node_id] = n.namespace
        for key, content in zip(n.page_keys, contents_of(n.token_ids)):
            stale_before = store.stale_pages
            page = store.read_page(key)
            if page is None:
                assert store.stale_pages == stale_before + 1
            else:
                assert page == payload_for(content, len(page))
    assert store.corrupt_pages == 0
    assert set(store.page_keys()) <= {k for n in nodes for k in n.page_keys}
    assert not [p for p in directory.rglob("*.tmp")]
    assert store.used_bytes() == sum(p.stat().st_size for p in store.pages_dir.iterdir())
    store.close()
    return len(nodes)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_kill_9_mid_save_always_reopens_consistently(tmp_path, seed, caplog):
    rng = random.Random(seed)
    directory = tmp_path / "kv"
    restored = []
    for attempt in range(6):           # the same directory: each run resumes the last one
        caplog.clear()
        run_and_kill(directory, seed * 100 + attempt, rng.randint(2, 60))
        with caplog.at_level(logging.WARNING, logger="radixserve.storage"):
            restored.append(check_consistent(directory))
        for record in caplog.records:  # what a kill can leave is ignored, with a warning
            assert any(what in record.getMessage() for what in (
                "not restored", "ignored and removed", "written by another save")), \
                record.getMessage()
    print("restored nodes after each kill:", restored)
    assert max(restored) > 0           # saves did complete and were restored
