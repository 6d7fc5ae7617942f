"""Speculative decoding by prompt lookup: drafts from the row's own tokens, and what a row keeps of them.

A row that generates text often repeats what it has read (code being edited, a document being
quoted, a list being reformatted). `Drafter` looks the row's last few tokens up among its earlier
tokens (prompt and output) and proposes the tokens that followed them there. The engine feeds the
drafts in one call that gives the logits after each (the runner's prefill_all), samples every
position at once with the row's own sampling, and keeps the drafts up to the first position where
the sampled token differs, plus that token (`kept`). Since each position is sampled from the logits
after the tokens actually kept, the output has the distribution plain decoding gives it: a draft
is a guess at what the sampler will choose, never a choice of its own. With the same uniforms
(a seed), the same tokens.

Pure Python and numpy: no model, no device.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

NGRAMS = (3, 2)  # the lengths of the tail looked up, longest first
SEARCH_LIMIT = 1 << 16  # tokens before the tail that are searched (the most recent)


class Drafter:
    """A row's tokens so far (its prompt and what it emitted), grown as it goes, and the drafts
    they suggest."""

    def __init__(self) -> None:
        self._tokens = np.zeros(256, dtype=np.int64)
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def sync(self, tokens: Sequence[int]) -> None:
        """Takes a row's tokens so far (they only grow): those past what it has are appended."""
        self.extend(tokens[self._n :])

    def extend(self, tokens: Sequence[int]) -> None:
        """Appends the row's next tokens."""
        end = self._n + len(tokens)
        if end > self._tokens.shape[0]:
            grown = np.zeros(max(2 * self._tokens.shape[0], end), dtype=np.int64)
            grown[: self._n] = self._tokens[: self._n]
            self._tokens = grown
        self._tokens[self._n : end] = tokens
        self._n = end

    def propose(self, k: int) -> list[int]:
        """Up to k tokens to follow the row's: what followed the latest earlier occurrence of the
        longest of their tails of NGRAMS tokens found. [] when none is found."""
        if k <= 0:
            return []
        a = self._tokens[max(0, self._n - SEARCH_LIMIT) : self._n]
        L = a.shape[0]
        for n in NGRAMS:
            if L <= n:
                continue
            tail = a[L - n :]
            # starts j of earlier occurrences: a[j : j + n] == tail, with at least one token after
            hits = a[: L - n] == tail[0]
            for i in range(1, n):
                hits &= a[i : L - n + i] == tail[i]
            found = np.flatnonzero(hits)
            if found.size:
                start = int(found[-1]) + n
                return a[start : start + k].tolist()
        return []


def kept(drafts: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """The tokens a row generates from one speculative step: sampled[i] was chosen from the logits
    after drafts[:i] (sampled has one more than drafts), so they hold while each draft is what was
    sampled at its place, through the first sampled token that differs (or the one after the last
    draft)."""
    n = 0
    while n < len(drafts) and sampled[n] == drafts[n]:
        n += 1
    return list(sampled[: n + 1])


def next_len(drafted: int, accepted: int, most: int) -> int:
    """How many drafts a row asks for next: two more after a step that kept all it drafted, one
    fewer after one that did not (at least one, at most `most`), so that rows whose guesses
    miss feed fewer tokens that sampling throws away (Hugging Face's assisted generation's
    heuristic schedule)."""
    return min(most, drafted + 2) if accepted == drafted else max(1, drafted - 1)
