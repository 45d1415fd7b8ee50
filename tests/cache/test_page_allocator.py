"""PageAllocator: unique ids, no side effect on failure, double frees refused."""

from __future__ import annotations

import numpy as np
import pytest

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
