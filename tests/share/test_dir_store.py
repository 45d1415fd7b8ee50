"""The shared directory store: pages published once, found by key, checked on every read,
bounded, and safe with several processes publishing and reading at once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from radixserve.share.dir_store import SUFFIX, DirSharedStore
from radixserve.share.keys import ShareScope, entry_key
from radixserve.share.store import parse_share, share_arg

SCOPE = ShareScope(b"s" * 16)
OTHER_SCOPE = ShareScope(b"t" * 16)
ROOT = Path(__file__).resolve().parents[2]


def keys(n: int, scope: ShareScope = SCOPE) -> list[bytes]:
    return [entry_key(scope, i.to_bytes(16, "little")) for i in range(n)]


def page(i: int, size: int = 256) -> bytes:
    return bytes((i + j) % 251 for j in range(size))


def test_published_pages_come_back_in_order_and_a_gap_ends_the_run(tmp_path):
    store = DirSharedStore(tmp_path, capacity_bytes=1 << 20)
    ks = keys(5)
    for i in (0, 1, 2, 4):                      # page 3 missing
        assert store.publish(ks[i], page(i))
    assert not store.publish(ks[0], page(0))    # there already: one copy
    assert store.published(ks) == 3
    got = store.fetch(ks)
    assert got.payloads == [page(0), page(1), page(2)]
    assert got.lost == 1 and got.refused == 0
    assert store.counters.published_pages == 4 and store.counters.duplicate_pages == 1
    assert store.counters.bytes_fetched == got.bytes_moved > 3 * 256


@pytest.mark.parametrize("damage", ["flip", "truncate", "other-key"])
def test_a_damaged_or_misplaced_file_is_refused_and_removed(tmp_path, damage):
    store = DirSharedStore(tmp_path, capacity_bytes=1 << 20)
    ks = keys(3)
    for i, k in enumerate(ks):
        store.publish(k, page(i))
    path = tmp_path / f"{ks[1].hex()}{SUFFIX}"
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-7] ^= 0x40
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(bytes(data[:-10]))
    else:       # another model's page renamed into place: its key differs
        other = keys(2, OTHER_SCOPE)[1]
        store.publish(other, page(1))
        os.replace(tmp_path / f"{other.hex()}{SUFFIX}", path)
    got = store.fetch(ks)
    assert got.payloads == [page(0)]
    assert got.refused == 1 and store.counters.refused_pages == 1
    assert not path.exists()                    # never served again
    assert store.published(ks) == 1


def test_the_directory_stays_within_its_bound_least_recently_used_out(tmp_path):
    one = len(page(0)) + 40                     # a framed page (header 40 bytes)
    store = DirSharedStore(tmp_path, capacity_bytes=10 * one)
    ks = keys(30)
    for i in range(8):
        store.publish(ks[i], page(i))
    os.utime(tmp_path / f"{ks[0].hex()}{SUFFIX}", (0, 0))   # the oldest...
    assert store.fetch(ks[:1]).payloads == [page(0)]         # ...read: now the newest
    for i in range(8, 30):
        store.publish(ks[i], page(i))
        assert store.used_bytes() <= 10 * one
    files = {p.name for p in tmp_path.iterdir()}
    assert f"{ks[29].hex()}{SUFFIX}" in files
    assert store.counters.forgotten_pages >= 20


PUBLISHER = """
import sys
from radixserve.share.dir_store import DirSharedStore
from radixserve.share.keys import ShareScope, entry_key
store = DirSharedStore(sys.argv[1], capacity_bytes=1 << 30)
ks = [entry_key(ShareScope(b"s" * 16), i.to_bytes(16, "little")) for i in range(200)]
wins = sum(store.publish(k, bytes([i % 251]) * 4096) for i, k in enumerate(ks))
ok = sum(len(store.fetch([k]).payloads) for k in ks)
print(wins, ok, store.counters.refused_pages)
"""


def test_two_processes_publish_the_same_pages_at_once(tmp_path):
    """Both publish 200 pages and read them all back while the other writes: every read
    is a whole, checked page; each page is one file; no temporary file is left."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", PUBLISHER, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    outs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    for wins, ok, refused in outs:
        assert int(ok) == 200 and int(refused) == 0
    assert 200 <= sum(int(o[0]) for o in outs) <= 400   # a race may let both rename
    names = [p.name for p in tmp_path.iterdir()]
    assert len(names) == 200 and all(n.endswith(SUFFIX) for n in names)
    store = DirSharedStore(tmp_path, capacity_bytes=1 << 30)
    got = store.fetch(keys(200))
    assert got.payloads == [bytes([i % 251]) * 4096 for i in range(200)]


def test_the_flag_names_its_field():
    assert parse_share("dir:/x") == ("dir", "/x")
    assert parse_share("ray") == ("ray", None) and parse_share(None) == ("off", None)
    with pytest.raises(Exception, match="--kv-share"):
        share_arg("nfs:/x")
