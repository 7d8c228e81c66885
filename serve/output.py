"""A request's generated tokens as text: the thinking / answer split, incremental
detokenization for streaming, ``stop`` strings, and the token counts of ``usage``.

:class:`OutputParser` is fed the tokens of one request in order, in chunks of any size (one
engine dispatch each), and returns the text that became final with each chunk:

* **split** (chat): tokens from the think-open to the think-close go to ``"reasoning"``,
  the rest to ``"content"``; the markers themselves are dropped from the text.  The phase is
  tracked as in ``eagle3_jax.budget`` (the prompt may end inside the thinking phase), so
  ``reasoning_tokens`` counts exactly what ``generate`` reports as ``thinking_tokens``.
  Without a split (completions) every token goes to ``"text"``, markers included.
* **incremental detokenization**: each field decodes a short window of its recent tokens and
  emits the new suffix, never an incomplete UTF-8 character (a window that decodes to a
  trailing U+FFFD waits for the next token); the text joined over the chunks equals
  the text of a non-streamed request.
* **stop strings**: the text is cut before the first occurrence of any of them (in either
  field), ``stopped`` is set and the counts stop at the token that completed the match; a
  tail that could still grow into a stop string is held back from the stream until it
  cannot.  Stop token ids (EOS, the request's ``stop_token_ids``) end a request on device;
  they count as completion tokens but add no text.
"""

from __future__ import annotations

import dataclasses

from eagle3_jax import budget

FIELDS_SPLIT = ("reasoning", "content")
FIELDS_RAW = ("text",)


@dataclasses.dataclass
class _Field:
    """One output text: its token ids, the decoded text, the decode window and what was sent."""

    ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    prefix: int = 0  # decode window start (context for the tokenizer's spacing rules)
    read: int = 0  # ids before this are in ``text``
    sent: int = 0  # characters of ``text`` handed out

    def copy(self) -> "_Field":
        return dataclasses.replace(self, ids=list(self.ids))


class OutputParser:
    """Turns one request's generated tokens into text chunks (see the module docstring).

    Args:
      tokenizer: a Hugging Face tokenizer (only ``decode`` is used).
      split: route thinking tokens to ``"reasoning"`` and the rest to ``"content"`` (chat);
        else everything to ``"text"``.
      thinking: the engine's ``ThinkingConfig`` (open / close ids), or None when the model has
        no thinking markers (then nothing is reasoning).
      prompt_ids: the prompt (its last think marker decides the phase the output starts in).
      stop: stop strings (non-empty).
      stop_ids: token ids that end the request (no text).
    """

    def __init__(self, tokenizer, *, split: bool, thinking: budget.ThinkingConfig | None, prompt_ids=(),
                 stop: tuple[str, ...] = (), stop_ids=()):
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stop)!r}")
        self.tokenizer = tokenizer
        self.split = split
        self.thinking = thinking
        self.stop = tuple(stop)
        self.stop_ids = frozenset(int(i) for i in stop_ids)
        self.fields = {name: _Field() for name in (FIELDS_SPLIT if split else FIELDS_RAW)}
        self.phase = budget.initial_phase(prompt_ids, thinking) if thinking is not None else budget.BEFORE
        self.completion_tokens = 0
        self.reasoning_tokens = 0
        self.stopped = False  # a stop string matched: the request is over
        self.finished = False

    # -- routing ---------------------------------------------------------------------------

    def _route(self, tok: int) -> str | None:
        """Counts ``tok`` and returns the field its text goes to (None: no text)."""
        th = self.thinking
        if th is not None and tok == th.open_id and self.phase != budget.THINKING:
            thinking, self.phase, marker = True, budget.THINKING, True
        elif th is not None and tok == th.close_id:
            thinking, marker = self.phase == budget.THINKING, True
            self.phase = budget.AFTER
        else:
            thinking, marker = self.phase == budget.THINKING, th is not None and tok == th.open_id
        self.completion_tokens += 1
        self.reasoning_tokens += thinking
        if tok in self.stop_ids:
            return None
        if not self.split:
            return "text"
        if marker:
            return None
        return "reasoning" if thinking else "content"

    # -- decoding --------------------------------------------------------------------------

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _advance(self, f: _Field, flush: bool = False):
        """Moves the complete text of ``f``'s undecoded ids into ``f.text``."""
        if f.read == len(f.ids):
            return
        prefix_text = self._decode(f.ids[f.prefix: f.read])
        new_text = self._decode(f.ids[f.prefix:])
        if len(new_text) > len(prefix_text) and (flush or not new_text.endswith("\ufffd")):
            f.text += new_text[len(prefix_text):]
            f.prefix, f.read = f.read, len(f.ids)
        elif flush:
            f.prefix = f.read = len(f.ids)

    def _stop_at(self, f: _Field, start: int) -> int | None:
        """Where the first stop string begins in ``f.text[start:]`` (None: nowhere)."""
        hits = [p for p in (f.text.find(s, start) for s in self.stop) if p >= 0]
        return min(hits) if hits else None

    def _feed(self, tokens) -> bool:
        """Routes and decodes ``tokens``; True when a stop string now matches (text not cut)."""
        before = {name: len(f.text) for name, f in self.fields.items()}
        touched = set()
        for tok in tokens:
            name = self._route(int(tok))
            if name is not None:
                self.fields[name].ids.append(int(tok))
                touched.add(name)
        longest = max(map(len, self.stop), default=0)
        hit = False
        for name in touched:
            f = self.fields[name]
            self._advance(f)
            if self.stop and self._stop_at(f, max(0, before[name] - longest + 1)) is not None:
                hit = True
        return hit

    # -- public ----------------------------------------------------------------------------

    def feed(self, tokens) -> dict[str, str]:
        """Takes the next generated tokens; returns the new final text per field (only
        fields with new text).  After a stop string matched, further tokens are ignored."""
        if self.stopped or self.finished or not len(tokens):
            return {}
        tokens = [int(t) for t in tokens]
        if not self.stop:
            self._feed(tokens)
            return self._take()
        snapshot = (self.phase, self.completion_tokens, self.reasoning_tokens,
                    {n: f.copy() for n, f in self.fields.items()})
        if not self._feed(tokens):
            return self._take()
        # a stop string matched in this chunk: replay it token by token to find where
        self.phase, self.completion_tokens, self.reasoning_tokens, fields = snapshot
        self.fields = fields
        for tok in tokens:
            starts = {n: len(f.text) for n, f in self.fields.items()}
            if self._feed([tok]):
                longest = max(map(len, self.stop))
                for name, f in self.fields.items():
                    cut = self._stop_at(f, max(0, starts[name] - longest + 1))
                    if cut is not None:
                        f.text = f.text[:cut]
                        break
                self.stopped = True
                break
        return self._take()

    def finish(self) -> dict[str, str]:
        """Flushes what was held back (an incomplete character at the end, a tail that might
        have grown into a stop string); call once when the request is over."""
        if not self.finished:
            self.finished = True
            if not self.stopped:
                for f in self.fields.values():
                    self._advance(f, flush=True)
        return self._take()

    def _held(self, text: str) -> int:
        """Characters at the end of ``text`` that are a proper prefix of a stop string."""
        if self.finished or self.stopped:
            return 0
        return max((k for s in self.stop for k in range(len(s) - 1, 0, -1) if text.endswith(s[:k])), default=0)

    def _take(self) -> dict[str, str]:
        out = {}
        for name, f in self.fields.items():
            end = len(f.text) - self._held(f.text)
            if end > f.sent:
                out[name] = f.text[f.sent: end]
                f.sent = end
        return out

    @property
    def texts(self) -> dict[str, str]:
        """The whole text per field so far (held-back tails included)."""
        return {name: f.text for name, f in self.fields.items()}
