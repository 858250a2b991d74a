"""A paged cache's pages as ids, apart from what they store: `PrefixCache`, the full pages known to hold a chain of
token ids, kept for later requests until evicted; `PagePool`, the allocator that hands pages out, counts the requests
holding each and tells which ones a request must not write."""

from collections import OrderedDict
from dataclasses import dataclass

from .errors import OutOfPagesError


@dataclass(eq=False)  # hashed by identity: a key names its parent entry itself, never a page id that is reused later
class CachedPage:
    """A full page whose K/V rows are known to hold `key`'s tokens."""

    page: int
    key: tuple  # (the previous page's CachedPage or None for a first page, the page's token ids as a tuple)


class PrefixCache:
    """Full pages of `page_size` tokens, each keyed by its token ids chained to the key of the page before it (exact
    tuples, never a hash: equal keys mean equal tokens from the first position on, so equal K/V).

    A keyed page that no request holds is evictable: it stays cached until `evict` takes it for another use, the least
    recently released first.
    """

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.entries = {}  # key -> CachedPage
        self.by_page = {}  # page id -> its CachedPage
        self.evictable = OrderedDict()  # keyed page ids no request holds, least recently released first

    def __contains__(self, page) -> bool:
        """Whether the page carries a key."""
        return page in self.by_page

    def entry(self, page) -> CachedPage | None:
        """The page's entry, None for a page without a key."""
        return self.by_page.get(page)

    def lookup(self, token_ids) -> list:
        """The entries of the cached pages holding the longest run of full pages of `token_ids` from its start, in
        order."""
        entries, parent = [], None
        for start in range(0, len(token_ids) - self.page_size + 1, self.page_size):
            parent = self.entries.get((parent, tuple(token_ids[start : start + self.page_size])))
            if parent is None:
                break
            entries.append(parent)
        return entries

    def register(self, pages, tokens, start: int, stop: int) -> None:
        """Keys the full pages pages[start:stop] of a request's row, page i holding tokens[i * page_size : (i + 1) *
        page_size], each chained to the key of the page before it. Stops at a page whose key another page has (the
        same tokens computed twice: the first stays their cached copy), since the pages after it have no key to chain
        to."""
        size = self.page_size
        parent = self.by_page.get(pages[start - 1]) if start else None
        if start and parent is None:
            return
        for i in range(start, stop):
            entry = self.by_page.get(pages[i])
            if entry is None:
                key = (parent, tuple(tokens[i * size : (i + 1) * size]))
                if key in self.entries:
                    return
                entry = self.entries[key] = self.by_page[pages[i]] = CachedPage(pages[i], key)
            parent = entry

    def hold(self, page) -> None:
        """A request holds the page: it is not evictable (a no-op for one that is not)."""
        self.evictable.pop(page, None)

    def release(self, page) -> None:
        """The last request holding the keyed page let it go: evictable, the most recently released."""
        self.evictable[page] = None

    def evict(self) -> int:
        """The least recently released evictable page, its key dropped (it never matches again)."""
        page, _ = self.evictable.popitem(last=False)
        del self.entries[self.by_page.pop(page).key]
        return page


class PagePool:
    """Page ids 0 .. num_pages - 1: the unused ones, and per page the number of requests holding it (`refs`). A page
    no request holds is free: back to `unused`, or, keyed, left in `prefix` until `allocate` evicts it."""

    def __init__(self, num_pages: int, prefix: PrefixCache):
        # Popped from the end: low page ids first, so a fresh request gets consecutive pages.
        self.unused = list(range(num_pages - 1, -1, -1))
        self.refs = [0] * num_pages
        self.prefix = prefix

    @property
    def num_free(self) -> int:
        """Pages `allocate` can hand out: unused ones and the keyed pages no request holds."""
        return len(self.unused) + len(self.prefix.evictable)

    def allocate(self) -> int:
        """A page held once: an unused one, else the least recently released keyed page, evicted."""
        if not self.num_free:
            raise OutOfPagesError("no page is free")
        page = self.unused.pop() if self.unused else self.prefix.evict()
        self.refs[page] = 1
        return page

    def hold(self, pages) -> None:
        """One more hold on each page (a request starting on pages that are cached or another's)."""
        for page in pages:
            self.prefix.hold(page)
            self.refs[page] += 1

    def release(self, pages) -> None:
        """Drops one hold on each page; a page no request holds is free again (a keyed one stays cached). Release a
        request's last pages first, so those are evicted before the pages they follow."""
        for page in pages:
            self.refs[page] -= 1
            if self.refs[page] == 0:
                if page in self.prefix:
                    self.prefix.release(page)
                else:
                    self.unused.append(page)

    def shared(self, page) -> bool:
        """Whether another request or the prefix cache holds the page, so that a request must copy it before writing
        (copy on write)."""
        return self.refs[page] > 1 or page in self.prefix
