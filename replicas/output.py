"""One request's output: tokens -> text that is safe to show, and the reason it ends.

Owns detokenizing (never half a UTF-8 character), stop strings (text that could still become a
stop string is held back, so a client never sees the start of one), stop tokens, end of text,
max_tokens, and in JSON mode the row's place in its JSON object (json_grammar.py), which ends the
row when the object closes (with a pattern, its place in the pattern's text). Never touches the
model or the batch.
"""

from __future__ import annotations

from typing import NamedTuple

from .json_grammar import Constraint
from .sampling import SamplingParams
from .tokenizer import Tokenizer, Utf8Stream


class Step(NamedTuple):
    """What one sampled token produced: text now safe to emit, and the finish reason if it ended."""

    text: str
    finish: str | None = None  # "stop" | "length" | None


class OutputStream:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, constraint: Constraint | None = None):
        """constraint: a constrained request's (the engine's grammar's: JSON mode, or a pattern)."""
        self.params = params
        self.constraint = constraint
        # JSON mode: the constraint's state after the tokens so far; None: not in JSON mode, or ended
        self.json = self.constraint.start if self.constraint is not None else None
        self.utf8 = Utf8Stream(tokenizer)
        self.end_tokens = set(params.stop_token_ids)
        if tokenizer.eos_token_id is not None and not params.ignore_eos:
            self.end_tokens.add(tokenizer.eos_token_id)
        self.stops = tuple(params.stop)
        self.held = ""  # decoded text not yet emitted: it may be the start of a stop string
        self.count = 0  # tokens sampled so far, end tokens included

    def may_go_on(self) -> bool:
        """Whether max_tokens leaves room after the next token (before push); its token can still
        end the row (goes_on)."""
        return self.count + 1 < self.params.max_tokens

    def goes_on(self, token: int) -> bool:
        """Whether the row may go on after this token (before push): False when push will end it
        by an end token or max_tokens; a stop string can still end it where this says True."""
        return token not in self.end_tokens and self.may_go_on()

    def push(self, token: int) -> Step:
        """Takes the next sampled token (every row, every step: without stop strings, no search)."""
        self.count += 1
        if token in self.end_tokens:
            return Step(self.release(), "stop")
        self.held += self.utf8.push(token)
        cut = self._stop_at() if self.stops else None
        if cut is not None:
            text, self.held = self.held[:cut], ""
            return Step(text, "stop")
        if self.json is not None:
            self.json = self.constraint.advance(self.json, token)
            if self.json is not None and self.constraint.free(self.json):
                self.json = None  # the reply is text (tool_choice "auto"): it goes on unconstrained
            elif self.json is None or self.constraint.done(self.json):  # (None: a token the mask let through)
                self.json = None
                return Step(self.release(), "stop")
        if self.count >= self.params.max_tokens:
            return Step(self.release(), "length")
        if self.json is not None and self.constraint.stuck(self.json):  # no token goes on: cut short here
            self.json = None
            return Step(self.release(), "length")
        keep = self._possible_stop_start() if self.stops else 0
        if not keep:
            text, self.held = self.held, ""
            return Step(text)
        text, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        return Step(text)

    def release(self) -> str:
        """Everything held back, for a row that ends for a reason other than a stop string."""
        text, self.held = self.held + self.utf8.flush(), ""
        return text

    def _stop_at(self) -> int | None:
        found = [i for i in (self.held.find(s) for s in self.stops) if i >= 0]
        return min(found) if found else None

    def _possible_stop_start(self) -> int:
        """Length of the longest tail of the held text that begins some stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.held)), longest, -1):
                if self.held.endswith(stop[:n]):
                    longest = n
                    break
        return longest
