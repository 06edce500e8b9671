"""The KV cache's pages as the host sees them: which are free, who holds each, and the prompts they cache.

The cache is a pool of ``num_pages`` pages of ``page_size`` token positions each (the arrays live on the devices,
:mod:`eval.engine.paged`); a request holds a list of pages, its page table, position p in page ``p // page_size``
of it. A page a finished request's prompt filled keeps its keys and values under the hash of its tokens and of
every token before them (a chain, as vLLM's automatic prefix caching keys them), so a later request whose prompt
starts with the same pages reads those pages instead of computing them again: a GRPO group's G completions and
requests sharing a system prompt hold one copy of it. A page nobody holds but that caches a prompt stays until
a new page is needed and no free one is left (least recently released first).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence


class PagePool:
    """Page bookkeeping: allocation, reference counts and the prefix cache (pages keyed by their token chain)."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"a page pool needs pages of at least one token (got {num_pages} x {page_size})")
        self.num_pages, self.page_size = num_pages, page_size
        self._free = list(range(num_pages - 1, -1, -1))  # popped from the end: page 0 first
        self._refs = [0] * num_pages
        self._hash_of: dict[int, Hashable] = {}
        self._by_hash: dict[Hashable, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached pages no request holds, oldest first

    def available(self) -> int:
        """Pages a request could be given now: the free ones and the idle cached ones."""
        return len(self._free) + len(self._idle)

    def chain(self, tokens: Sequence[int], salt: Hashable = None) -> list[Hashable]:
        """The hash of each full page of ``tokens`` and every token before it (``salt``: what else the keys and
        values depend on, e.g. the adapter that computed them)."""
        out: list[Hashable] = []
        parent: Hashable = ("root", salt)
        n = self.page_size
        for i in range(len(tokens) // n):
            parent = hash((parent, tuple(tokens[i * n:(i + 1) * n])))
            out.append(parent)
        return out

    def match(self, hashes: Sequence[Hashable]) -> list[int]:
        """The cached pages of the longest run of ``hashes`` from the start (held: their references taken)."""
        pages = []
        for h in hashes:
            page = self._by_hash.get(h)
            if page is None:
                break
            pages.append(page)
        for page in pages:
            self._hold(page)
        return pages

    def allocate(self, n: int) -> list[int]:
        """``n`` pages of no content for one request (raises if fewer are available: check :meth:`available`)."""
        if n > self.available():
            raise RuntimeError(f"{n} pages asked for, {self.available()} available")
        out = []
        for _ in range(n):
            if self._free:
                page = self._free.pop()
            else:  # the least recently released cached page gives up its prompt
                page, _ = self._idle.popitem(last=False)
                del self._by_hash[self._hash_of.pop(page)]
            self._refs[page] = 1
            out.append(page)
        return out

    def register(self, pages: Sequence[int], hashes: Sequence[Hashable]) -> None:
        """Record that ``pages[i]`` holds the page of hash ``hashes[i]`` (a prompt's full pages, once computed). A
        hash already cached keeps its page."""
        for page, h in zip(pages, hashes):
            if h not in self._by_hash and page not in self._hash_of:
                self._by_hash[h], self._hash_of[page] = page, h

    def release(self, pages: Sequence[int]) -> None:
        """A request lets go of its pages: each no one else holds becomes free, or idle if it caches a prompt."""
        for page in pages:
            self._refs[page] -= 1
            assert self._refs[page] >= 0, f"page {page} released more often than held"
            if self._refs[page] == 0:
                if page in self._hash_of:
                    self._idle[page] = None
                else:
                    self._free.append(page)

    def forget(self) -> None:
        """Drop every cached prompt (the weights that computed them changed): idle pages become free, held ones
        stay held."""
        for page in self._idle:
            self._free.append(page)
        self._idle.clear()
        self._by_hash.clear()
        self._hash_of.clear()

    def held(self) -> int:
        """Pages some request holds."""
        return sum(1 for r in self._refs if r > 0)

    def _hold(self, page: int) -> None:
        if self._refs[page] == 0:
            self._idle.pop(page, None)
        self._refs[page] += 1
