"""The page pool and its prefix cache: which physical pages hold which tokens (docs/architecture.md §5).

One page id names the slot of 64 consecutive tokens of one sequence in EVERY cache pool of
every layer: the MLA latent entry (``mla_pools[l][page]``) and the indexer key entry
(``index_pools[l][page]``). So allocating, sharing, caching and freeing a page always moves
both caches together; there is no separate bookkeeping for the indexer.

Prefix cache: a FULL page is named by a chain key, blake2b(parent page's key ++ its 64 token
ids), so equal keys mean equal whole prefixes (not just equal 64-token windows) and the key is
stable across processes (unlike Python's ``hash``). Pages are reference counted; a cached page
whose count drops to 0 stays cached as *evictable* and is reused LRU only when the free list is
empty, so a finished request's prompt keeps serving hits until memory is actually needed. A
referenced page is never evicted.

Pure Python bookkeeping: no tensors, testable without a GPU.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from dsa_trt.config import PAGE_SIZE

PAGE_KEY_BYTES = 16  # 128-bit blake2b digest: collisions are out of reach for any pool size


class PoolExhausted(RuntimeError):
    """allocate() asked for more pages than are free or evictable; the scheduler checks first."""


def pages_for(num_tokens: int) -> int:
    """Pages needed to hold positions [0, num_tokens)."""
    return -(-num_tokens // PAGE_SIZE)


def page_key(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """Chain key of a full page: hashes the parent's key and the page's 64 token ids (int64 LE)."""
    if len(tokens) != PAGE_SIZE:
        raise ValueError(f"only full pages are cached: got {len(tokens)} tokens, need {PAGE_SIZE}")
    h = hashlib.blake2b(digest_size=PAGE_KEY_BYTES)
    h.update(parent or b"")
    h.update(struct.pack(f"<{PAGE_SIZE}q", *tokens))
    return h.digest()


@dataclass
class PoolStats:
    lookups: int = 0  # prefix lookups that were acted on (one per request admission)
    queried_pages: int = 0  # full pages those lookups could have hit
    hit_pages: int = 0  # pages reused from the cache instead of recomputed
    evictions: int = 0  # cached pages dropped to make room

    @property
    def hit_rate(self) -> float:
        return self.hit_pages / self.queried_pages if self.queried_pages else 0.0


class PagePool:
    """Free list + refcounts + prefix cache over ``num_pages`` page ids ``0 .. num_pages-1``.

    A page is in exactly one of three states: free (on the free list, no key), referenced
    (refcount > 0, maybe keyed), or evictable (refcount 0, keyed, in the LRU).
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages = {num_pages}: the pool needs at least one page")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._refs = [0] * num_pages
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest release first
        self._key_of: dict[int, bytes] = {}
        self._page_of: dict[bytes, int] = {}
        self.stats = PoolStats()

    @classmethod
    def from_memory(cls, free_bytes: int, fraction: float, cache_bytes_per_token: int) -> "PagePool":
        """Size the pool from free device memory after the engines load (docs/architecture.md §5).

        cache_bytes_per_token: both pools, all layers (``ModelConfig.cache_bytes_per_token``).
        """
        if not 0 < fraction <= 1:
            raise ValueError(f"cache memory fraction {fraction} must be in (0, 1]")
        num_pages = int(free_bytes * fraction) // (cache_bytes_per_token * PAGE_SIZE)
        if num_pages < 1:
            raise ValueError(
                f"{free_bytes * fraction / 2**30:.2f} GiB for the cache holds no page of {PAGE_SIZE} tokens "
                f"({cache_bytes_per_token * PAGE_SIZE} bytes); raise the fraction or free memory"
            )
        return cls(num_pages)

    # ------------------------------------------------------------------ capacity
    def tokens_that_fit(self) -> int:
        """Tokens the whole pool can hold (what the runtime reports after sizing)."""
        return self.num_pages * PAGE_SIZE

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_evictable_pages(self) -> int:
        return len(self._evictable)

    @property
    def num_allocatable(self) -> int:
        """Pages allocate() can hand out now: free plus evictable."""
        return len(self._free) + len(self._evictable)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_allocatable

    def describe(self) -> str:
        return (
            f"page pool: {self.num_pages} pages x {PAGE_SIZE} tokens = {self.tokens_that_fit()} tokens; "
            f"{self.num_free_pages} free, {self.num_evictable_pages} cached-evictable, "
            f"{self.num_pages - self.num_allocatable} in use; prefix hit rate {self.stats.hit_rate:.1%}, "
            f"{self.stats.evictions} evictions"
        )

    # ------------------------------------------------------------------ alloc / free
    def refcount(self, page: int) -> int:
        return self._refs[page]

    def is_cached(self, page: int) -> bool:
        return page in self._key_of

    def allocate(self, n: int) -> list[int]:
        """n fresh pages with refcount 1: free list first, then evict the least recently released."""
        if n > self.num_allocatable:
            raise PoolExhausted(f"asked for {n} pages, only {self.num_allocatable} free or evictable")
        out = []
        for _ in range(n):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._evictable.popitem(last=False)
                del self._page_of[self._key_of.pop(page)]
                self.stats.evictions += 1
            self._refs[page] = 1
            out.append(page)
        return out

    def free(self, pages: Iterable[int]) -> None:
        """Drop one reference from each page.

        Callers pass a sequence's pages in order; they are released back to front so the tail of
        a prefix, useless without its head, is the first evicted.
        """
        for page in reversed(list(pages)):
            if self._refs[page] <= 0:
                raise RuntimeError(f"page {page} freed with refcount {self._refs[page]} (double free)")
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._key_of:
                    self._evictable[page] = None
                else:
                    self._free.append(page)

    def acquire(self, pages: Iterable[int]) -> None:
        """Add a reference to each (cached) page: a prefix hit. Evictable pages leave the LRU."""
        for page in pages:
            if self._refs[page] == 0:
                if page not in self._evictable:
                    raise RuntimeError(f"page {page} is free; only cached pages can be acquired")
                del self._evictable[page]
            self._refs[page] += 1

    # ------------------------------------------------------------------ prefix cache
    def match_prefix(self, tokens: Sequence[int]) -> tuple[list[int], list[bytes]]:
        """Longest cached run of full pages at the start of ``tokens``: (page ids, their keys).

        No side effect, so the scheduler can check capacity before committing with acquire().
        """
        pages: list[int] = []
        keys: list[bytes] = []
        parent = None
        for i in range(len(tokens) // PAGE_SIZE):
            key = page_key(parent, tokens[i * PAGE_SIZE : (i + 1) * PAGE_SIZE])
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
            keys.append(key)
            parent = key
        return pages, keys

    def record_lookup(self, tokens_len: int, hit_pages: int) -> None:
        self.stats.lookups += 1
        self.stats.queried_pages += tokens_len // PAGE_SIZE
        self.stats.hit_pages += hit_pages

    def lookup(self, tokens: Sequence[int]) -> list[int]:
        """match_prefix + acquire + stats: the cached prefix's pages, now referenced by the caller."""
        pages, _ = self.match_prefix(tokens)
        self.acquire(pages)
        self.record_lookup(len(tokens), len(pages))
        return pages

    def cache_page(self, page: int, key: bytes) -> bool:
        """Publish a full, computed, referenced page under its chain key.

        Returns False (and leaves the page private) when another page already holds the same
        prefix, e.g. two requests computed it in the same step; the duplicate is freed normally.
        """
        if self._refs[page] <= 0:
            raise RuntimeError(f"page {page} must be referenced to be cached")
        if key in self._page_of or page in self._key_of:
            return False
        self._page_of[key] = page
        self._key_of[page] = key
        return True
