"""Tree packing: a row is a prefix trie over token ids, so a prefix shared by samples is forwarded once.

`TreeRow` is both the planner's state (`fits`/`add` price a sample by its *novel* tokens, so `token_budget`
bounds unique tokens) and the collator (`pack` lays the trie out depth-first). Nodes are keyed on
(token, next token): a fork happens one token early, so the logits of every node predict exactly one token. An
image's placeholder tokens are keyed by the image instead (`_keys`), so that samples share them only whole.
"""

from __future__ import annotations

import torch

from asyncrl.packing.images import DistinctImages, image_spans, row_images
from asyncrl.packing.row import PackedRow, Segment, loss_slots
from asyncrl.rollout.types import RolloutSample

END = -1
"""Next-token key of a sample's last token: its logits predict nothing, so any node with that token serves."""
ROOT = -1

Key = tuple[int, int]


class TreeRow:
    """Planner state and collator of one row: the trie of its samples' tokens."""

    def __init__(self, token_budget: int) -> None:
        self.token_budget = token_budget
        self.samples: list[RolloutSample] = []
        self.num_tokens = 0
        """Unique tokens: trie nodes, what the row forwards."""
        self._token: list[int] = []
        self._depth: list[int] = []
        self._parent: list[int] = []
        self._children: list[dict[Key, int]] = []
        self._roots: dict[Key, int] = {}
        self._sample_nodes: list[list[int]] = []
        self._cached: tuple[RolloutSample, int, int] | None = None
        self._images = DistinctImages()

    def fits(self, sample: RolloutSample) -> bool:
        return self.num_tokens + sample.num_tokens - self.shared_prefix(sample) <= self.token_budget

    def shared_prefix(self, sample: RolloutSample) -> int:
        """Leading tokens of the sample already in the trie (they cost nothing to add)."""
        cached = self._cached
        if cached is not None and cached[0] is sample and cached[1] == self.num_tokens:
            return cached[2]
        shared = len(self._walk(self._keys(sample), claim=False))
        self._cached = (sample, self.num_tokens, shared)
        return shared

    def add(self, sample: RolloutSample) -> None:
        tokens, keys = sample.sequence.token_ids, self._keys(sample)
        nodes = self._walk(keys, claim=True)
        parent = nodes[-1] if nodes else ROOT
        for i in range(len(nodes), len(tokens)):
            parent = self._new_node(parent, keys[i], tokens[i], depth=i)
            nodes.append(parent)
        self.samples.append(sample)
        self._sample_nodes.append(nodes)

    def pack(self, top_k: int) -> PackedRow:
        """DFS layout: unique tokens, depth as position ids, one segment per fork-free chain."""
        order = self._preorder()
        position = [0] * len(order)
        for index, node in enumerate(order):
            position[node] = index
        offsets = [[position[node] for node in nodes] for nodes in self._sample_nodes]
        return PackedRow(
            input_ids=torch.tensor([self._token[n] for n in order], dtype=torch.long),
            position_ids=torch.tensor([self._depth[n] for n in order], dtype=torch.long),
            segments=self._segments(order),
            samples=list(self.samples),
            images=row_images(self.samples, offsets),
            **loss_slots(self.samples, offsets, top_k),  # type: ignore[arg-type]
        )

    def _keys(self, sample: RolloutSample) -> list[Key]:
        """Each token's (token, next token) key. An image's placeholders (the same id for every image) are keyed
        (image, token after the image) instead, image = END - 1 - its index in the row's DistinctImages: samples
        share an image's tokens only when it is the same image, and a fork never splits an image, so each image's
        placeholders stay one run in the layout (the model fills a run with one whole image's features)."""
        tokens, images = sample.sequence.token_ids, sample.sequence.images
        if images is None:
            return list(zip(tokens, [*tokens[1:], END], strict=True))
        spans = image_spans(sample)
        keyed = list(tokens)
        for (start, end), index in zip(spans, self._images.indices(images), strict=True):
            keyed[start:end] = [END - 1 - index] * (end - start)
        keys = list(zip(keyed, [*keyed[1:], END], strict=True))
        for start, end in spans:
            keys[start:end] = [keys[end - 1]] * (end - start)
        return keys

    def _walk(self, keys: list[Key], *, claim: bool) -> list[int]:
        """Nodes of the longest prefix of ``keys`` in the trie; ``claim`` re-keys a reused leaf in place."""
        nodes: list[int] = []
        children = self._roots
        for key in keys:
            node = children.get(key)
            if node is None:
                node = _reusable(children, key)
                if node is None:
                    break
                if claim and key[1] != END:
                    del children[(key[0], END)]
                    children[key] = node
            nodes.append(node)
            children = self._children[node]
        return nodes

    def _new_node(self, parent: int, key: Key, token: int, depth: int) -> int:
        node = len(self._token)
        self._token.append(token)
        self._depth.append(depth)
        self._parent.append(parent)
        self._children.append({})
        (self._roots if parent == ROOT else self._children[parent])[key] = node
        self.num_tokens += 1
        return node

    def _preorder(self) -> list[int]:
        order: list[int] = []
        stack = list(reversed(self._roots.values()))
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(reversed(self._children[node].values()))
        return order

    def _segments(self, order: list[int]) -> list[Segment]:
        """Chains without a fork; each attends to its root-to-segment path (its parent's path, then itself)."""
        segments: list[Segment] = []
        path_ending_at: dict[int, torch.Tensor] = {}
        start = 0
        for index, node in enumerate(order):
            if len(self._children[node]) == 1:
                continue  # the chain goes on: in preorder, a lone child comes right after its parent
            own = torch.arange(start, index + 1)
            parent = self._parent[order[start]]
            kv_index = own if parent == ROOT else torch.cat([path_ending_at[parent], own])
            segments.append(Segment(start, index + 1, kv_index))
            path_ending_at[node] = kv_index
            start = index + 1
        return segments


def _reusable(children: dict[Key, int], key: Key) -> int | None:
    """A node that serves ``key`` although keyed differently: a last token reuses any node of its token,
    and a leaf that predicts nothing (next token END) can be claimed by a sample that continues past it."""
    token, next_token = key
    if next_token == END:
        return next((node for (t, _), node in children.items() if t == token), None)
    return children.get((token, END))
