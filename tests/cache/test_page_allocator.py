"""PageAllocator: unique ids, no side effect on failure, double frees refused."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.cache import OutOfPages, PageAccountingError, PageAllocator


def test_alloc_gives_distinct_ids_until_empty():
    a = PageAllocator(10)
    got = np.concatenate([a.alloc(3), a.alloc(0), a.alloc(7)])
    assert got.dtype == np.int32 and sorted(got.tolist()) == list(range(10))
    assert a.num_free == 0 and a.free_page_ids().size == 0


def test_out_of_pages_changes_nothing():
    a = PageAllocator(4)
    a.alloc(3)
    with pytest.raises(OutOfPages) as e:
        a.alloc(2)
    assert (e.value.requested, e.value.available) == (2, 1)
    assert a.num_free == 1 and a.alloc(1).size == 1


def test_free_returns_pages_for_reuse_and_accepts_lists():
    a = PageAllocator(4)
    ids = a.alloc(4)
    a.free(ids[:2])
    a.free([int(ids[2])])
    a.free(np.array([ids[3]], dtype=np.int64))
    assert sorted(a.free_page_ids().tolist()) == [0, 1, 2, 3]
    assert sorted(a.alloc(4).tolist()) == [0, 1, 2, 3]


def test_double_free_is_refused_without_side_effect():
    a = PageAllocator(6)
    ids = a.alloc(4)
    a.free(ids[:1])
    with pytest.raises(PageAccountingError, match="already free"):
        a.free(ids[:2])                                  # ids[0] is free already
    with pytest.raises(PageAccountingError, match="twice in one call"):
        a.free(np.array([ids[1], ids[2], ids[1]], dtype=np.int32))
    assert a.num_free == 3
    a.free(ids[1:])                                      # still allocated: fine
    assert sorted(a.free_page_ids().tolist()) == list(range(6))


def test_single_page_frees_are_checked_like_any_other():
    a = PageAllocator(4)
    ids = a.alloc(4)
    a.free(ids[2:3])
    with pytest.raises(PageAccountingError, match="already free"):
        a.free([int(ids[2])])
    assert a.num_free == 1
    a.free(np.array([ids[0]], dtype=np.int64))
    assert sorted(a.alloc(2).tolist()) == sorted([int(ids[0]), int(ids[2])])
    assert a.num_free == 0


@pytest.mark.parametrize("bad", [[-1], [6], [0, 99], np.array([-5], dtype=np.int64),
                                 np.array([0, -1], dtype=np.int32), np.array([6], dtype=np.int32)])
def test_out_of_range_ids_are_refused(bad):
    a = PageAllocator(6)
    a.alloc(6)
    with pytest.raises(PageAccountingError, match="outside"):
        a.free(bad)
    assert a.num_free == 0


def test_non_integer_ids_are_refused():
    a = PageAllocator(2)
    a.alloc(2)
    with pytest.raises(PageAccountingError):
        a.free(np.array([0.0, 1.0]))


@settings(max_examples=150, derandomize=True, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 6), st.lists(st.integers(-1, 7), max_size=5)),
                max_size=40))
def test_against_a_set_model(ops):
    """Random allocs and frees (some of them bad) against a plain set of free ids."""
    a = PageAllocator(7)
    free = set(range(7))
    for is_alloc, n, ids in ops:
        if is_alloc:
            if n > len(free):
                with pytest.raises(OutOfPages):
                    a.alloc(n)
            else:
                got = a.alloc(n).tolist()
                assert len(set(got)) == n and set(got) <= free
                free -= set(got)
        else:
            bad = (any(not 0 <= i < 7 for i in ids) or len(set(ids)) != len(ids)
                   or any(i in free for i in ids))
            if bad:
                with pytest.raises(PageAccountingError):
                    a.free(np.array(ids, dtype=np.int32))
            else:
                a.free(np.array(ids, dtype=np.int32))
                free |= set(ids)
        assert a.num_free == len(free)
        assert sorted(a.free_page_ids().tolist()) == sorted(free)


@pytest.mark.parametrize("seed", range(6))
def test_bulk_frees_against_a_set_model(seed):
    """Frees of hundreds of ids (the sorted path) and single ids, good and bad, mixed with
    allocations, against a plain set of free ids: a refused free changes nothing."""
    rng = np.random.default_rng(seed)
    n = 3000
    a = PageAllocator(n)
    free = set(range(n))
    held: list[int] = []
    for _ in range(60):
        if rng.random() < 0.5 and len(free) > 0:
            got = a.alloc(int(rng.integers(0, min(len(free), 900) + 1))).tolist()
            assert len(set(got)) == len(got) and set(got) <= free
            free -= set(got)
            held += got
            continue
        k = int(rng.integers(1, len(held) + 1)) if held else 0
        ids = [held[i] for i in rng.permutation(len(held))[:k]]
        fault = int(rng.integers(0, 4)) if ids else 0
        if fault == 1 and not free:
            fault = 0
        if fault == 1:                               # one id that is free already
            ids.insert(int(rng.integers(0, len(ids) + 1)), int(rng.choice(list(free))))
        elif fault == 2:                             # one id twice
            ids.append(ids[int(rng.integers(0, len(ids)))])
        elif fault == 3:                             # out of range
            ids.append(int(rng.choice([-1, n, n + 7])))
        arr = np.array(ids, dtype=np.int32)
        if fault:
            with pytest.raises(PageAccountingError):
                a.free(arr)
        else:
            a.free(arr)
            free |= set(ids)
            held = [i for i in held if i not in set(ids)]
        assert a.num_free == len(free)
        assert sorted(a.free_page_ids().tolist()) == sorted(free)


def test_never_freed_ids_come_as_read_only_views_and_freed_ones_as_copies():
    a = PageAllocator(10)
    first = a.alloc(3)                       # pristine: a view of the initial ids
    assert not first.flags.writeable and sorted(first.tolist()) == [0, 1, 2]
    a.free(first[:1].copy())                 # a free writes the stack above the top
    again = a.alloc(1)
    assert again.tolist() == first[:1].tolist()
    before = first.tolist()
    more = a.alloc(4)                        # below the freed slot: still pristine ids
    a.free(np.concatenate([again, more]))
    assert first.tolist() == before          # handed-out ids never change underneath
    got = sorted(a.alloc(a.num_free).tolist())
    assert got == sorted(set(range(10)) - set(first[1:].tolist()))
