"""The approximate radix tree of one SGLang server: the prompts the gateway routed there, in pages.

SGLang keeps a radix tree of the KV it holds; the gateway cannot see it without KV events, so it
keeps its own guess, as SGLang's router does: every prompt routed to a server is inserted into that
server's tree, and the longest match of a new prompt says how much of it the server probably
still has. Pages (not single tokens) keep it small; the least recently routed pages are forgotten
beyond `max_pages`, as the server itself evicts.

Invariant, drawn: every node but the root holds one page of `page_size` tokens; a node is never
more recently used than its parent (a path is touched leaf first, root last), so the least recently
used node is always a leaf and eviction never cuts a path in two. `check_integrity()` checks it.
"""

from __future__ import annotations

from collections import OrderedDict

Page = tuple[int, ...]


class _Node:
    __slots__ = ("children", "key", "parent")

    def __init__(self, key: Page, parent: _Node | None) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[Page, _Node] = {}


class PrefixTree:
    def __init__(self, page_size: int, max_pages: int) -> None:
        self.page_size = page_size
        self.max_pages = max_pages
        self.root = _Node((), None)
        self._lru: OrderedDict[_Node, None] = OrderedDict()  # oldest first; the root is not in it

    @property
    def pages(self) -> int:
        return len(self._lru)

    def _pages_of(self, tokens: list[int]) -> list[Page]:
        size = self.page_size
        return [tuple(tokens[i: i + size]) for i in range(0, len(tokens) - size + 1, size)]

    def match(self, tokens: list[int]) -> int:
        """Leading tokens of `tokens` (whole pages) the tree holds."""
        node, matched = self.root, 0
        for page in self._pages_of(tokens):
            child = node.children.get(page)
            if child is None:
                break
            node, matched = child, matched + self.page_size
        return matched

    def insert(self, tokens: list[int]) -> None:
        node = self.root
        path = []
        for page in self._pages_of(tokens):
            child = node.children.get(page)
            if child is None:
                child = node.children[page] = _Node(page, node)
            path.append(child)
            node = child
        for touched in reversed(path):  # leaf first: parents end up more recent than children
            self._lru[touched] = None
            self._lru.move_to_end(touched)
        while len(self._lru) > self.max_pages:
            oldest, _ = self._lru.popitem(last=False)
            assert oldest.parent is not None and not oldest.children
            del oldest.parent.children[oldest.key]

    def paths(self) -> list[list[int]]:
        """Every root-to-leaf path, least recently used first: inserting them in this order rebuilds
        the tree with the same recency (the snapshot a fresh gateway replica starts from)."""
        out = []
        for node in self._lru:
            if node.children:
                continue
            pages = []
            walk: _Node | None = node
            while walk is not None and walk.parent is not None:
                pages.append(walk.key)
                walk = walk.parent
            out.append([t for page in reversed(pages) for t in page])
        return out

    def clear(self) -> None:
        self.root.children.clear()
        self._lru.clear()

    def check_integrity(self) -> None:
        order = {node: i for i, node in enumerate(self._lru)}
        seen = 0
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            seen += 1
            assert len(node.key) == self.page_size
            for child in node.children.values():
                assert order[child] < order[node], "a child is more recent than its parent"
                stack.append(child)
        assert seen == len(self._lru), "nodes and the LRU order disagree"
