"""The thinking budget B inside the decode loop: which committed tokens are thinking, where a
round's accepted run is cut at B, and the forced end-of-thinking sequence.

A sequence is in one of three phases: ``BEFORE`` (no think-open seen), ``THINKING`` (after a
think-open, until the think-close) or ``AFTER`` (after the close).  The phase is decided on
committed tokens only, so a drafted close token that is rejected ends nothing.

The budget counts *thinking content*: committed tokens emitted in ``THINKING`` other than the
close token.  When the next content token would exceed the limit (``B`` in hard mode,
``B + grace`` in soft mode), that token is replaced by the first token of the end-of-thinking
sequence ``E`` and the rest of ``E`` is forced through the target and the drafter in the next
rounds as if generated (each forced token is committed without being verified); sampling
resumes after the last one.  Forced tokens never count toward the budget.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

BEFORE, THINKING, AFTER = 0, 1, 2
STATUSES = ("none", "closed", "budget_exhausted", "incomplete")
MODES = ("hard", "soft")


def check_mode(mode) -> str:
    """``mode`` if it is one of :data:`MODES`, else an error naming ``thinking_mode``."""
    if not isinstance(mode, str) or mode not in MODES:
        raise (ValueError if isinstance(mode, str) else TypeError)(
            f"thinking_mode must be 'hard' or 'soft', got {mode!r}")
    return str(mode)


@dataclasses.dataclass(frozen=True)
class ThinkingConfig:
    """Static part of the thinking budget (the per-sequence budgets are arrays).

    ``open_id`` / ``close_id``: the think-open / think-close token ids; ``end_ids``: the
    end-of-thinking sequence forced at the budget (must contain ``close_id``, with no
    ``open_id`` after its last ``close_id``: forcing it ends the thinking); ``mode``:
    ``"hard"`` (force at B) or ``"soft"`` (force at B + ``grace``, the model may close first).
    """

    open_id: int
    close_id: int
    end_ids: tuple[int, ...]
    mode: str = "hard"
    grace: int = 0

    def __post_init__(self):
        check_mode(self.mode)
        if self.close_id not in self.end_ids:
            raise ValueError(f"end_thinking_ids={list(self.end_ids)} must contain the think-close id {self.close_id}")
        if self.open_id == self.close_id:
            raise ValueError(f"think-open and think-close ids are the same ({self.open_id})")
        # forced at the budget, E must leave the sequence after its thinking: one that opened
        # it again would be over budget at once, and where the next token is cut would depend
        # on how rounds fall (a round commits its token after E unchecked; a step cuts it)
        last = {t: i for i, t in enumerate(self.end_ids)}
        if last.get(self.open_id, -1) > last[self.close_id]:
            raise ValueError(f"end_thinking_ids={list(self.end_ids)} opens thinking again: the think-open id "
                             f"{self.open_id} comes after its last think-close id {self.close_id}")

    @property
    def slack(self) -> int:
        """Tokens past B that the model may still think (soft mode's grace)."""
        return self.grace if self.mode == "soft" else 0


def initial_phase(prompt_ids, cfg: ThinkingConfig) -> int:
    """The phase after the prompt: ``THINKING`` when its last think marker is an open (chat
    templates often end the prompt with ``<think>``), ``AFTER`` after a close, else ``BEFORE``."""
    for tok in reversed(list(prompt_ids)):
        if tok == cfg.open_id:
            return THINKING
        if tok == cfg.close_id:
            return AFTER
    return BEFORE


def phases(tokens_BxP, phase_B, cfg: ThinkingConfig):
    """Phase before each of ``P`` tokens emitted in order from ``phase``, and the phase after
    them all (every token counted; callers mask by count)."""
    P = tokens_BxP.shape[1]
    j = jnp.arange(P)[None]
    last_open = _cummax(jnp.where(tokens_BxP == cfg.open_id, j, -1))
    last_close = _cummax(jnp.where(tokens_BxP == cfg.close_id, j, -1))
    seen = jnp.maximum(last_open, last_close)
    after = jnp.where(seen < 0, phase_B[:, None], jnp.where(last_open > last_close, THINKING, AFTER))
    before = jnp.concatenate([phase_B[:, None], after[:, :-1]], 1)
    return before, after


def _cummax(x_BxP):
    out = [x_BxP[:, 0]]
    for i in range(1, x_BxP.shape[1]):
        out.append(jnp.maximum(out[-1], x_BxP[:, i]))
    return jnp.stack(out, 1)


def is_thinking(tokens_BxP, before_BxP, cfg: ThinkingConfig):
    """Tokens reported as thinking: emitted in ``THINKING`` (the close included) and the
    think-open itself."""
    return (before_BxP == THINKING) | ((tokens_BxP == cfg.open_id) & (before_BxP != THINKING))


def cut(tokens_BxP, count_B, phase_B, content_B, budget_B, forcing_B, cfg: ThinkingConfig):
    """Where the thinking budget cuts a round's ``count`` emitted tokens: returns ``(keep_B,
    hit_B)``, the tokens kept before the one replaced by ``E[0]`` (``count`` when nothing is
    cut) and whether it was cut.  ``budget < 0`` is unlimited; no cut while forcing."""
    P = tokens_BxP.shape[1]
    j = jnp.arange(P)[None]
    before, _ = phases(tokens_BxP, phase_B, cfg)
    content = (before == THINKING) & (tokens_BxP != cfg.close_id) & (j < count_B[:, None])
    total = content_B[:, None] + jnp.cumsum(content, 1)
    over = content & (total > budget_B[:, None] + cfg.slack) & (budget_B[:, None] >= 0) & ~forcing_B[:, None]
    hit = over.any(1)
    return jnp.where(hit, jnp.argmax(over, 1), count_B), hit


def account(tokens_BxP, n_B, phase_B, content_B, thinking_B, cfg: ThinkingConfig):
    """Updates ``(phase, content, thinking)`` after ``n`` emitted tokens; also returns whether
    the first of them is thinking (the phase a round belongs to)."""
    P = tokens_BxP.shape[1]
    j = jnp.arange(P)[None]
    before, after = phases(tokens_BxP, phase_B, cfg)
    live = j < n_B[:, None]
    thinking = is_thinking(tokens_BxP, before, cfg) & live
    content = (before == THINKING) & (tokens_BxP != cfg.close_id) & live
    phase = jnp.where(n_B > 0, jnp.take_along_axis(after, jnp.maximum(n_B - 1, 0)[:, None], 1)[:, 0], phase_B)
    return phase, content_B + content.sum(1), thinking_B + thinking.sum(1), thinking[:, 0]


def status(phase: int, forced: bool, entered: bool) -> str:
    """``none`` (no thinking phase), ``closed`` (by the model), ``budget_exhausted`` (forced)
    or ``incomplete`` (the sequence ended while thinking)."""
    if phase == THINKING:
        return "incomplete"
    if forced:
        return "budget_exhausted"
    return "closed" if entered else "none"
