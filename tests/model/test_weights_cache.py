"""The dequantized-weights cache: used on the second load, bit-identical, keyed by the GGUF's
content and the dtype, and a corrupt or partial entry is rebuilt, never served."""

from __future__ import annotations

import pytest
import torch
from tiny_models import hf_config, random_hf_model, write_gguf

from radixserve.model import load_model
from radixserve.model.weights_cache import WeightsCache
from radixserve.phase_timer import PhaseTimer

Q8 = ("blk.0.ffn_down.weight", "blk.1.attn_output.weight")   # quantized: dequantization matters


@pytest.fixture
def gguf_path(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, random_hf_model(hf_config("llama")), q8_names=Q8)
    return path


@pytest.fixture
def cache(tmp_path):
    return WeightsCache.at(tmp_path / "cache")


def load_with(path, cache, dtype="float32"):
    """(the loaded model, the cache's outcomes) of one load."""
    timer = PhaseTimer()
    loaded = load_model(str(path), dtype=dtype, weights_cache=cache, timer=timer)
    outcomes = [n.removeprefix("weights cache: ") for n in timer.notes if n.startswith("weights")]
    return loaded, outcomes


def load(path, cache, dtype="float32"):
    """(state dict, the cache's outcomes) of one load."""
    loaded, outcomes = load_with(path, cache, dtype)
    return loaded.model.state_dict(), outcomes


def assert_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def forbid_dequantization(monkeypatch):
    import gguf.quants

    def refuse(*args, **kwargs):
        raise AssertionError("dequantized although the cache holds the weights")
    monkeypatch.setattr(gguf.quants, "dequantize", refuse)


def entries(cache):
    return sorted(p.name for p in cache.directory.iterdir())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_second_load_is_a_hit_with_bit_identical_weights(gguf_path, cache, monkeypatch, dtype):
    uncached, _ = load(gguf_path, None, dtype)
    first, outcome1 = load(gguf_path, cache, dtype)
    assert outcome1 == ["stored"] and len(entries(cache)) == 1
    forbid_dequantization(monkeypatch)
    second, outcome2 = load(gguf_path, cache, dtype)
    assert outcome2 == ["hit"]
    assert_identical(second, uncached)
    assert_identical(first, uncached)


def replace_with(entry, data: bytes) -> None:
    """Swap in new content under the same name (never rewrite a mapped file in place)."""
    tmp = entry.with_name("damaged.tmp")
    tmp.write_bytes(data)
    tmp.replace(entry)


def corrupt_data(entry):
    data = bytearray(entry.read_bytes())
    data[-5] ^= 0x40                    # one bit of the last tensor
    replace_with(entry, bytes(data))


def truncate(entry):
    replace_with(entry, entry.read_bytes()[: entry.stat().st_size // 2])


def garble_header(entry):
    data = bytearray(entry.read_bytes())
    data[8:40] = b"x" * 32
    replace_with(entry, bytes(data))


@pytest.mark.parametrize("damage", [corrupt_data, truncate, garble_header])
def test_a_damaged_entry_is_rebuilt_not_served(gguf_path, cache, damage):
    reference, _ = load(gguf_path, None)
    load(gguf_path, cache)
    [name] = entries(cache)
    damage(cache.directory / name)
    rebuilt, outcome = load(gguf_path, cache)
    assert outcome == ["stored"]                   # detected: dequantized and written again
    assert_identical(rebuilt, reference)
    assert entries(cache) == [name]                # replaced in place, no temp file left
    _, outcome = load(gguf_path, cache)
    assert outcome == ["hit"]


def test_an_entry_for_another_key_is_not_served(gguf_path, cache, tmp_path):
    """A file renamed over the entry (same name, other content) is refused by its key."""
    other = tmp_path / "other.gguf"
    write_gguf(other, random_hf_model(hf_config("llama"), seed=1), q8_names=Q8)
    load(other, cache)
    load(gguf_path, cache)
    mine = next(p for p in cache.directory.iterdir() if p.name.startswith("tiny"))
    theirs = next(p for p in cache.directory.iterdir() if p.name.startswith("other"))
    theirs.replace(mine)
    reference, _ = load(gguf_path, None)
    served, outcome = load(gguf_path, cache)
    assert outcome == ["stored"]
    assert_identical(served, reference)


def test_key_follows_the_file_content_and_the_dtype(gguf_path, cache):
    key = cache.entry(gguf_path, torch.float32).key
    assert cache.entry(gguf_path, torch.float32).key == key
    assert cache.entry(gguf_path, torch.bfloat16).key != key
    load(gguf_path, cache)
    write_gguf(gguf_path, random_hf_model(hf_config("llama"), seed=7), q8_names=Q8)
    assert cache.entry(gguf_path, torch.float32).key != key
    reference, _ = load(gguf_path, None)
    served, outcome = load(gguf_path, cache)        # same path, new content: a miss
    assert outcome == ["stored"]
    assert_identical(served, reference)


def test_an_unwritable_cache_still_loads(gguf_path, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    cache = WeightsCache.at(blocker / "cache")
    reference, _ = load(gguf_path, None)
    served, outcome = load(gguf_path, cache)
    assert outcome == ["not stored"]
    assert_identical(served, reference)


def test_key_follows_the_loading_code(gguf_path, cache, monkeypatch):
    """Editing the code that builds the parameters (here: a changed fingerprint) retires
    old entries instead of serving parameters laid out by the old code; writing the new
    entry deletes the retired one, and leaves other dtypes' entries alone."""
    from radixserve.model import weights_cache
    load(gguf_path, cache)
    load(gguf_path, cache, "bfloat16")
    old = cache.entry(gguf_path, torch.float32)
    monkeypatch.setattr(weights_cache, "code_fingerprint", lambda: "0123456789abcdef")
    new = cache.entry(gguf_path, torch.float32)
    assert new.key != old.key
    _, outcome = load(gguf_path, cache)
    assert outcome == ["stored"]
    assert new.path.exists() and not old.path.exists()
    assert len(entries(cache)) == 2                      # the bf16 entry stays


def test_a_hit_maps_the_entry_and_keeps_tied_embeddings_tied(tmp_path, cache):
    path = tmp_path / "tied.gguf"
    write_gguf(path, random_hf_model(hf_config("llama", tie_word_embeddings=True)))
    reference, _ = load(path, None)
    load(path, cache)
    loaded, outcome = load_with(path, cache)
    model = loaded.model
    assert outcome == ["hit"]
    assert model.lm_head.weight is model.embed_tokens.weight
    assert_identical(model.state_dict(), reference)
    [entry] = cache.directory.iterdir()
    mapped = file_mappings(entry)
    assert mapped, "the entry file is not mapped"
    for name, p in model.named_parameters():             # no copy: views of the mapping
        assert any(lo <= p.data_ptr() < hi for lo, hi in mapped), name


def file_mappings(path) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of `path` (/proc/self/maps)."""
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip() == str(path):
                lo, hi = fields[0].split("-")
                ranges.append((int(lo, 16), int(hi, 16)))
    return ranges


def test_cache_directory_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "env-cache"))
    assert WeightsCache.at().directory == tmp_path / "env-cache"
    assert WeightsCache.at(tmp_path / "flag").directory == tmp_path / "flag"
