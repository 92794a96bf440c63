"""PagePool: free list, refcounts, chain-keyed prefix cache, LRU eviction of unreferenced pages."""

from __future__ import annotations

import random

import pytest

from dsa_trt.config import PAGE_SIZE
from dsa_trt.runtime.page_pool import PagePool, PoolExhausted, page_key, pages_for


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def cache_sequence(pool: PagePool, toks: list[int]) -> list[int]:
    """Allocate pages for toks and publish every full one, as the scheduler does after compute."""
    pages = pool.allocate(pages_for(len(toks)))
    parent = None
    for i in range(len(toks) // PAGE_SIZE):
        parent = page_key(parent, toks[i * PAGE_SIZE : (i + 1) * PAGE_SIZE])
        pool.cache_page(pages[i], parent)
    return pages


def test_page_key_is_a_stable_chain():
    a = tokens(PAGE_SIZE, 0)
    assert page_key(None, a) == page_key(None, list(a))  # content, not identity or hash()
    assert len(page_key(None, a)) == 16
    assert page_key(page_key(None, a), a) != page_key(None, a)  # same window, different prefix
    with pytest.raises(ValueError, match="only full pages"):
        page_key(None, a[:-1])


def test_allocate_free_refcounts():
    pool = PagePool(4)
    pages = pool.allocate(3)
    assert len(set(pages)) == 3 and all(pool.refcount(p) == 1 for p in pages)
    assert pool.num_free_pages == 1 and pool.can_allocate(1) and not pool.can_allocate(2)
    with pytest.raises(PoolExhausted, match="asked for 2 pages, only 1"):
        pool.allocate(2)
    pool.free(pages)
    assert pool.num_free_pages == 4 and pool.num_evictable_pages == 0  # uncached: straight back
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(pages[:1])


def test_lookup_longest_cached_prefix_bumps_refcounts():
    pool = PagePool(16)
    a = tokens(3 * PAGE_SIZE + 10, 1)
    pages = cache_sequence(pool, a)
    # Same first two pages, different third page, then a partial page.
    b = a[: 2 * PAGE_SIZE] + tokens(PAGE_SIZE + 5, 2)
    hit = pool.lookup(b)
    assert hit == pages[:2]
    assert [pool.refcount(p) for p in pages] == [2, 2, 1, 1]
    assert pool.stats.hit_pages == 2 and pool.stats.queried_pages == 3
    # A different first page breaks the chain even if the second window matches.
    c = tokens(PAGE_SIZE, 3) + a[PAGE_SIZE : 2 * PAGE_SIZE]
    assert pool.lookup(c) == []
    assert pool.match_prefix(a[: PAGE_SIZE - 1]) == ([], [])  # partial pages are never cached


def test_cached_pages_survive_free_and_are_reused():
    pool = PagePool(8)
    a = tokens(2 * PAGE_SIZE, 4)
    pages = cache_sequence(pool, a)
    pool.free(pages)
    assert pool.num_evictable_pages == 2 and pool.num_free_pages == 6 and pool.num_allocatable == 8
    hit = pool.lookup(a)
    assert hit == pages and all(pool.refcount(p) == 1 for p in hit)
    assert pool.num_evictable_pages == 0


def test_duplicate_prefix_stays_private():
    pool = PagePool(4)
    a = tokens(PAGE_SIZE, 5)
    first = cache_sequence(pool, a)
    second = pool.allocate(1)
    assert not pool.cache_page(second[0], page_key(None, a))
    pool.free(second)
    assert pool.num_free_pages == 3 and not pool.is_cached(second[0])  # straight back to the free list
    assert pool.lookup(a) == first


def test_lru_eviction_only_when_free_list_is_empty_and_only_unreferenced():
    pool = PagePool(4)
    old = tokens(PAGE_SIZE, 6)
    new = tokens(PAGE_SIZE, 7)
    held = tokens(PAGE_SIZE, 8)
    p_old, p_new, p_held = (cache_sequence(pool, t)[0] for t in (old, new, held))
    pool.free([p_old])  # released first -> least recently used
    pool.free([p_new])
    assert pool.num_free_pages == 1 and pool.num_evictable_pages == 2

    fresh = pool.allocate(1)  # the free list still has a page: nothing evicted
    assert fresh != [p_old] and pool.stats.evictions == 0 and pool.is_cached(p_old)
    assert pool.allocate(1) == [p_old]  # free list empty: the LRU cached page goes
    assert pool.stats.evictions == 1 and not pool.is_cached(p_old)
    assert pool.lookup(old) == [] and pool.lookup(new) == [p_new]  # hit takes p_new off the LRU
    with pytest.raises(PoolExhausted):
        pool.allocate(1)  # everything is referenced now: p_held and p_new must not be evicted
    assert pool.is_cached(p_held) and pool.is_cached(p_new)


def test_free_releases_tail_first():
    """Freeing a sequence puts its last page at the LRU head: a prefix's tail is evicted first."""
    pool = PagePool(3)
    a = tokens(3 * PAGE_SIZE, 9)
    pages = cache_sequence(pool, a)
    pool.free(pages)
    assert pool.allocate(1) == [pages[2]]
    assert pool.lookup(a) == pages[:2]


def test_sizing_and_reporting():
    per_token = 708 * 61  # fp8 MLA + indexer bytes, 61 layers
    pool = PagePool.from_memory(free_bytes=10 * 2**30, fraction=0.5, cache_bytes_per_token=per_token)
    assert pool.num_pages == (5 * 2**30) // (per_token * PAGE_SIZE)
    assert pool.tokens_that_fit() == pool.num_pages * PAGE_SIZE
    assert f"{pool.tokens_that_fit()} tokens" in pool.describe()
    with pytest.raises(ValueError, match="holds no page"):
        PagePool.from_memory(free_bytes=1000, fraction=1.0, cache_bytes_per_token=per_token)
    with pytest.raises(ValueError, match="fraction 1.5"):
        PagePool.from_memory(free_bytes=1000, fraction=1.5, cache_bytes_per_token=per_token)
    with pytest.raises(ValueError, match="num_pages = 0"):
        PagePool(0)
