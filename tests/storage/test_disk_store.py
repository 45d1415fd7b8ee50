"""DiskPageStore: round trips, checked pages, index damage, foreign directories."""

from __future__ import annotations

import hashlib
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from radixserve.storage import DiskPageStore, DiskStoreFull, StoreRefused
from radixserve.storage.disk_store import INDEX_FILE

from .store_helpers import PAGE_SIZE, fingerprint, node, payload_for, tokens_for


def page_file(store: DiskPageStore, key: int) -> Path:
    return store.pages_dir / f"{key:016x}.page"


def snapshot(directory: Path) -> dict[str, tuple[str, int]]:
    """Every file's content hash and mtime below `directory`."""
    return {str(p.relative_to(directory)): (hashlib.sha256(p.read_bytes()).hexdigest(),
                                            p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file()}


def filled_store(directory: Path, **kw) -> tuple[DiskPageStore, list[int]]:
    """A store holding a root node of 2 pages and a child of 1, indexed."""
    store = DiskPageStore(directory, fingerprint(), **kw)
    keys = [store.new_page_key() for _ in range(3)]
    for key in keys:
        store.write_page(key, payload_for(key))
    store.write_index(store.new_index([node(1, None, keys[:2]), node(2, 1, keys[2:])]))
    return store, keys


def test_pages_and_index_round_trip_across_reopen(tmp_path):
    store, keys = filled_store(tmp_path / "kv")
    assert store.usable and store.read_page(keys[0]) == payload_for(keys[0])
    assert store.used_bytes() == sum(p.stat().st_size for p in store.pages_dir.iterdir())
    store.close()
    again = DiskPageStore(tmp_path / "kv", fingerprint())
    assert again.page_keys() == sorted(keys) and again.used_bytes() == store.used_bytes()
    index = again.read_index()
    assert [(n.node_id, n.parent_id, n.page_keys) for n in index.nodes] == \
        [(1, None, keys[:2]), (2, 1, keys[2:])]
    assert index.nodes[1].token_ids == tokens_for(keys[2:])
    assert all(again.read_page(k) == payload_for(k) for k in keys)
    assert again.new_page_key() > max(keys)           # keys are never reused
    again.drop_page(keys[2])
    assert not page_file(again, keys[2]).exists() and again.read_page(keys[2]) is None
    assert again.corrupt_pages == 0


def test_a_key_written_again_after_the_index_is_never_served_under_the_old_name(tmp_path,
                                                                               caplog):
    """Drop a page the index names, write other content under its key, crash before the
    next index: the old index must not serve the new content."""
    store, keys = filled_store(tmp_path / "kv")
    store.drop_page(keys[2])
    store.write_page(keys[2], payload_for(999))
    with pytest.raises(ValueError, match="drop it first"):
        store.write_page(keys[2], payload_for(998))
    assert store.read_page(keys[2]) == payload_for(999)  # its own write, before any index
    store.close()                                        # "crash": no new index
    again = DiskPageStore(tmp_path / "kv", fingerprint())
    assert keys[2] in again.page_keys()                  # named by the old index
    with caplog.at_level(logging.WARNING, logger="radixserve.storage"):
        assert again.read_page(keys[2]) is None
    assert again.stale_pages == 1 and again.corrupt_pages == 0
    assert "written by another save" in caplog.records[-1].getMessage()
    assert again.read_page(keys[0]) == payload_for(keys[0])
    again.write_page(keys[2], payload_for(997))          # and a new index adopts it
    again.write_index(again.read_index())
    again.close()
    third = DiskPageStore(tmp_path / "kv", fingerprint())
    assert third.read_page(keys[2]) == payload_for(997) and third.stale_pages == 0


def test_flipped_byte_is_never_served(tmp_path, caplog):
    store, keys = filled_store(tmp_path / "kv")
    path = page_file(store, keys[1])
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="radixserve.storage"):
        assert store.read_page(keys[1]) is None
        assert store.read_page(keys[1]) is None       # dropped: missing now, not corrupt
    assert store.corrupt_pages == 1 and not path.exists()
    assert keys[1] not in store.page_keys()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "checksum mismatch" in warnings[0].getMessage()
    assert store.read_page(keys[0]) == payload_for(keys[0])


@pytest.mark.parametrize("cut", [0, 10, -1])
def test_truncated_page_is_dropped(tmp_path, cut):
    store, keys = filled_store(tmp_path / "kv")
    path = page_file(store, keys[0])
    data = path.read_bytes()
    path.write_bytes(data[:cut] if cut >= 0 else data[:cut])
    assert store.read_page(keys[0]) is None and store.corrupt_pages == 1


def test_restore_drops_nodes_whose_pages_are_gone(tmp_path, caplog):
    store, keys = filled_store(tmp_path / "kv")
    page_file(store, keys[0]).unlink()                # the root node's first page
    store.close()
    with caplog.at_level(logging.WARNING, logger="radixserve.storage"):
        again = DiskPageStore(tmp_path / "kv", fingerprint())
    assert again.read_index().nodes == []             # the child hangs from the lost root
    assert again.page_keys() == []                    # and its pages were removed
    assert any("not restored" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage"])
def test_damaged_index_is_ignored_with_a_warning(tmp_path, caplog, damage):
    store, keys = filled_store(tmp_path / "kv")
    store.close()
    path = tmp_path / "kv" / INDEX_FILE
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[:len(data) - 7]
    elif damage == "flip":
        data[-3] ^= 0x40
    else:
        data = bytearray(b"not an index at all")
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="radixserve.storage"):
        again = DiskPageStore(tmp_path / "kv", fingerprint())
    assert again.usable and again.read_index() is None
    assert again.page_keys() == [] and list(again.pages_dir.iterdir()) == []
    assert any("index is unreadable" in r.getMessage() for r in caplog.records)
    key = again.new_page_key()                        # still usable, and keys move on
    assert key > max(keys)
    again.write_page(key, payload_for(key))
    again.write_index(again.new_index([node(7, None, [key])]))
    assert again.read_index().nodes[0].page_keys == [key]


@pytest.mark.parametrize("change", [dict(page_size=16), dict(dtype="bfloat16"),
                                   dict(weights_sha256="cd" * 32),
                                   dict(kv_layout="NHD k=fp8_e4m3 v=fp8_e4m3")])
def test_fingerprint_mismatch_leaves_the_directory_untouched(tmp_path, caplog, change):
    store, keys = filled_store(tmp_path / "kv")
    store.write_page(store.new_page_key(), b"unindexed")   # would be removed if adopted
    store.close()
    before = snapshot(tmp_path / "kv")
    with caplog.at_level(logging.WARNING, logger="radixserve.storage"):
        other = DiskPageStore(tmp_path / "kv", fingerprint(**change))
    assert not other.usable
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "\n" not in lines[0]
    field, value = next(iter(change.items()))
    assert field.replace("_", " ") in lines[0] and "another model configuration" in lines[0]
    assert other.read_index() is None and other.read_page(keys[0]) is None
    with pytest.raises(StoreRefused):
        other.write_page(other.new_page_key(), b"x")
    with pytest.raises(StoreRefused):
        other.drop_page(keys[0])
    assert snapshot(tmp_path / "kv") == before
    assert DiskPageStore(tmp_path / "kv", fingerprint()).read_page(keys[0]) == \
        payload_for(keys[0])


def test_foreign_directory_is_refused_untouched(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    before = snapshot(tmp_path)
    store = DiskPageStore(tmp_path, fingerprint())
    assert not store.usable and "not a radixserve KV store" in store.refusal
    assert snapshot(tmp_path) == before


def test_second_process_on_the_same_directory_is_refused(tmp_path):
    store, _ = filled_store(tmp_path / "kv")
    code = ("import sys; sys.path.insert(0, '.'); "
            "from radixserve.storage import DiskPageStore; "
            "from tests.storage.store_helpers import fingerprint; "
            f"print(DiskPageStore({str(tmp_path / 'kv')!r}, fingerprint()).refusal)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2], check=True).stdout
    assert "another server is using it" in out
    store.close()


def test_capacity_and_index_checks(tmp_path):
    store = DiskPageStore(tmp_path / "kv", fingerprint(), capacity_bytes=2 * 4096 + 100)
    a, b, c = (store.new_page_key() for _ in range(3))
    store.write_page(a, payload_for(a))
    with pytest.raises(DiskStoreFull):
        store.write_page(b, payload_for(b, 2 * 4096))
    store.write_page(b, payload_for(b))
    assert store.page_keys() == [a, b]
    with pytest.raises(ValueError, match="not stored"):
        store.write_index(store.new_index([node(1, None, [a, c])]))
    with pytest.raises(ValueError, match="drop it first"):
        store.write_page(a, payload_for(a))
    store.drop_page(a)
    store.write_page(c, payload_for(c))               # the freed bytes are usable again
    assert store.used_bytes() <= store.capacity_bytes


def test_restore_checks_edges_and_parents(tmp_path):
    store = DiskPageStore(tmp_path / "kv", fingerprint())
    keys = [store.new_page_key() for _ in range(4)]
    for key in keys:
        store.write_page(key, payload_for(key))
    bad_len = node(3, None, keys[2:3])
    bad_len.token_ids = bad_len.token_ids[:-1]
    store.write_index(store.new_index([
        node(1, None, keys[:1], "tenant"), node(2, 1, keys[1:2], "tenant"),
        bad_len, node(4, 3, keys[3:]), node(5, 1, keys[3:], "other")]))
    nodes = store.read_index().nodes
    assert [(n.node_id, n.namespace) for n in nodes] == [(1, "tenant"), (2, "tenant")]
    assert PAGE_SIZE == store.fingerprint.page_size


def test_describe_mismatch_is_one_line():
    a, b = fingerprint(), fingerprint(page_size=16, dtype="bfloat16")
    assert a.describe_mismatch(a) is None
    line = a.describe_mismatch(b)
    assert line == "dtype float32 there, bfloat16 here; page size 4 there, 16 here"


def test_storage_imports_no_torch():
    code = ("import sys; sys.modules['torch'] = None; import radixserve.storage, "
            "radixserve.storage.disk_store; bad = [m for m in sys.modules "
            "if m.startswith('torch')]; assert not any(sys.modules[m] for m in bad), bad")
    subprocess.run([sys.executable, "-c", code], check=True,
                   cwd=Path(__file__).resolve().parents[2])


def test_model_fingerprint_of_the_default_model():
    from radixserve.file_hash import file_sha256
    from radixserve.model.registry import resolve_model_path
    from radixserve.storage import model_fingerprint

    path = resolve_model_path("smollm2-135m-instruct")
    kw = dict(model_path=path, dtype="torch.float32", page_size=16, kv_k="float32",
              kv_v="float32", num_layers=30, num_kv_heads=3, head_dim=64)
    fp = model_fingerprint(**kw)
    assert fp.weights_sha256 == file_sha256(path) and fp.dtype == "float32"
    assert fp.kv_layout == "NHD k=float32 v=float32" and len(fp.code) == 16
    assert model_fingerprint(**kw) == fp
    assert "kv layout" in fp.describe_mismatch(model_fingerprint(**{**kw, "kv_v": "int8"}))
