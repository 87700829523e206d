"""Prefix cache: finished requests' cache rows, reused by requests whose prompt starts the same way.

A multi-turn chat or an agent replaying a growing transcript sends, turn after turn, the previous prompt +
the answer + a new message. When a request finishes, its slot's row (the target cache and the proposer's
state, ``lengths`` = the tokens it committed: prompt + answer but the last token) is kept here, keyed by
those tokens. A new request starts from the entry sharing its longest prefix and prefills only the rest.

Which prefixes of an entry are usable:
- dense targets keep any prefix: K/V of positions ``< m`` do not depend on later tokens, so setting
  ``lengths = m`` truncates (``prefix_truncatable``);
- hybrid targets' recurrent (GDN) state exists only after the entry's last token: the prompt must extend
  the whole entry. So for them the engine also keeps a snapshot after every prefill chunk of a prompt
  (the seed's "extra buffer" strategy): prompts that share a head start from its last chunk boundary;
- a drafter's context ring truncates like K/V while it has not wrapped (entry length ≤ ring slots).

At least one prompt token is always left to prefill (its logits give the first new token). Entries live
on the device; least recently used ones are evicted beyond ``budget_bytes``.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np


@dataclasses.dataclass
class Entry:
    tokens: np.ndarray  # [L] int32, the committed tokens the row holds
    row: Any  # batch-1 target cache, lengths = L
    prow: Any  # batch-1 proposer state (None without a proposer)
    nbytes: int
    truncatable: bool  # any prefix of it is usable (else only the whole entry)


@dataclasses.dataclass
class PrefixStats:
    lookups: int = 0
    hits: int = 0
    prompt_tokens: int = 0  # prompt tokens of every lookup
    hit_tokens: int = 0  # of those, taken from the cache instead of prefilled
    entries: int = 0
    bytes: int = 0
    evictions: int = 0


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class PrefixCache:
    """LRU of finished rows under a memory budget (host bookkeeping; the rows stay on the device)."""

    def __init__(self, budget_bytes: int):
        self.budget = int(budget_bytes)
        self.entries: collections.OrderedDict[int, Entry] = collections.OrderedDict()
        self.stats = PrefixStats()
        self._next_id = 0

    def lookup(self, prompt: Sequence[int], usable: Any) -> tuple[Entry | None, int]:
        """The entry to start ``prompt`` from and how many of its tokens to keep (0: none).
        ``usable(entry, shared) → m`` says how much of ``shared`` common tokens the entry can give."""
        prompt = np.asarray(prompt, np.int32)
        best, best_m, best_id = None, 0, None
        for key, entry in self.entries.items():
            shared = min(common_prefix(entry.tokens, prompt), len(prompt) - 1)
            m = usable(entry, shared) if shared > 0 else 0
            if m > best_m:
                best, best_m, best_id = entry, m, key
        self.stats.lookups += 1
        self.stats.prompt_tokens += len(prompt)
        if best is not None:
            self.entries.move_to_end(best_id)
            self.stats.hits += 1
            self.stats.hit_tokens += best_m
        return best, best_m

    def insert(self, tokens: Sequence[int], row: Any, prow: Any, truncatable: bool) -> None:
        """Keep a finished row. Entries that are prefixes of it go when any prefix of it is usable."""
        tokens = np.asarray(tokens, np.int32)
        nbytes = sum(x.nbytes for x in jax.tree.leaves((row, prow)))
        if len(tokens) < 2 or nbytes > self.budget:
            return
        same = lambda e: len(e.tokens) == len(tokens) and common_prefix(e.tokens, tokens) == len(tokens)  # noqa: E731
        covered = lambda e: common_prefix(e.tokens, tokens) == len(e.tokens)  # noqa: E731
        for key in [k for k, e in self.entries.items() if (covered(e) if truncatable else same(e))]:
            self._drop(key)  # a row with the same tokens (or, truncatable, a prefix of them) is superseded
        self.entries[self._next_id] = Entry(tokens, row, prow, nbytes, truncatable)
        self._next_id += 1
        self.stats.bytes += nbytes
        while self.stats.bytes > self.budget:
            self._drop(next(iter(self.entries)))
            self.stats.evictions += 1
        self.stats.entries = len(self.entries)

    def _drop(self, key: int) -> None:
        self.stats.bytes -= self.entries.pop(key).nbytes
        self.stats.entries = len(self.entries)

    def clear(self) -> None:
        self.entries.clear()
        self.stats.bytes, self.stats.entries = 0, 0
