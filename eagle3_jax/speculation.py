"""The speculative budget K as a controller: a set of tiers (no drafting, chains, trees) and a
policy that picks one per round on device, inside the decode loop.

Every drafting tier runs the same round (draft → verify → commit); ``None`` drafts nothing:
its rounds are plain target steps, run in bursts with one drafter catch-up after each.  All
tiers are compiled into the one decode loop, each as its own inner loop of rounds that runs
while the policy keeps it (``decode``), with the caches sized for the largest; the tier never
changes the output, only how fast it is computed.

The adaptive policy maximises expected committed tokens per millisecond:

* expected tokens per round: for chains, ``1 + Σ_i Π_{j≤i} a_j`` from running per-position
  acceptance rates ``a`` (exponentially decayed counts shared by all chain tiers, each
  position's updated only by the rounds that draft it, which age what it showed before by
  every round since it was last drafted, and shrunk toward the rate
  of all positions together; one offered fewer than ``THIN`` times in fewer than
  ``THIN_ROUNDS`` chain rounds is taken at no less than that rate, so that a longer chain whose
  deep positions a warm-up of one row judged is tried again when it might win and then judged
  on its own rounds); for trees, a running mean of their own committed tokens per round (until
  tried, an optimistic estimate, below); 1 for no drafting;
* milliseconds per round: ``round_ms`` per tier, measured once per compiled program on the
  program itself (each tier forced over the same new tokens of the call's own answers;
  ``decode``), or given;
* a warm-up of ``warmup`` rounds on the longest chain (they inform every draft position),
  then a switch at most every ``cooldown`` rounds, between tiers ``min_tier..max_tier`` of
  ``tiers``; an untried tree is estimated optimistically (each level as ``top_k``
  independent tries), so it is tried once when it might win and then judged on its own
  rounds; with ``None`` among the tiers it falls back to no drafting when no tier beats a
  plain step.  Away from the longest chain (on no drafting, a shorter chain or a tree) it
  tries that chain again after ``probe`` rounds (a tier just entered first keeping its
  ``cooldown``), since only its rounds inform the deep positions (and acceptance at all,
  after plain rounds): a wait that doubles, up to ``probe_max``, each time a try falls
  straight back, and restarts at ``probe`` once the chain was kept again: a poor stretch
  costs one short wait, a drafter (or a depth) that never pays costs a try every
  ``probe_max`` rounds.  With no chain among the tiers, the first drafting tier is tried
  again the same way, from no drafting only.
"""

from __future__ import annotations

import collections.abc
import dataclasses

import jax
import jax.numpy as jnp

from eagle3_jax import limits
from eagle3_jax.tree import TreeConfig

DECAY = 0.9  # weight of the past in the running acceptance counts and means, per round
PRIOR = 2.0  # pseudo-trials of a position's acceptance estimate at the rate of all positions
# A draft position offered fewer than THIN times (decayed), in fewer than THIN_ROUNDS of the
# chain rounds that drafted it (decayed; at most 1 / (1 - DECAY) = 10), is taken at no less
# than the rate of all positions: a miss in a warm-up of one row would otherwise keep a long
# chain out for good (its deep positions learn only from its own rounds).  The rounds bound
# ends the optimism where rows rarely reach the position (one row: offers that never add up
# to THIN).  Read when a program is traced: set them before compiling.
THIN = 4.0
THIN_ROUNDS = 8.0


@dataclasses.dataclass(frozen=True)
class Speculation:
    """Speculative-budget tiers and the policy that picks one per round.

    ``tiers``: ``TreeConfig`` s and ``None`` (no drafting), each at most once; ``policy``: ``"adaptive"`` or
    ``"fixed"`` (always ``tiers[0]``); ``warmup``: rounds on the longest chain before adapting;
    ``cooldown``: the fewest rounds between switches; ``min_tier`` / ``max_tier``: the
    indices the policy may choose from; ``probe``: after this many rounds on other tiers,
    the longest chain is tried again for ``cooldown`` rounds (acceptance is only learned from
    drafting rounds, and a deep position only from rounds that reach it, so without probes
    one bad stretch would end drafting, or the long chain, for good; 0: never); each try that
    falls straight back doubles the wait, up to ``probe_max``.
    """

    tiers: tuple
    policy: str = "adaptive"
    warmup: int = 2
    cooldown: int = 4
    min_tier: int = 0
    max_tier: int | None = None
    probe: int = 16
    probe_max: int = 256

    def __post_init__(self):
        if not isinstance(self.tiers, collections.abc.Iterable):
            raise TypeError(f"speculation.tiers must be a sequence of TreeConfig or None, got {type(self.tiers).__name__}"
                            " (one tier: Speculation.fixed(tier))")
        tiers = tuple(self.tiers)
        object.__setattr__(self, "tiers", tiers)
        if not tiers:
            raise ValueError("speculation: need at least one tier")
        for i, t in enumerate(tiers):
            if t is not None and not isinstance(t, TreeConfig):
                raise TypeError(f"speculation.tiers[{i}] must be a TreeConfig or None, got {type(t).__name__}")
            if t in tiers[:i]:  # each tier is one inner loop of the policy's, found by its value
                raise ValueError(f"speculation.tiers[{i}] repeats tiers[{tiers.index(t)}] "
                                 f"({'no drafting' if t is None else tier_name(t)}): give each tier once")
        if self.policy not in ("adaptive", "fixed"):
            raise ValueError(f"speculation.policy={self.policy!r}: expected 'adaptive' or 'fixed'")

        for name, rng in limits.SPECULATION.items():  # integers (numpy's too), stored as ints
            v = getattr(self, name)
            if name == "max_tier" and v is None:
                continue
            rng = rng.at_least(self.probe) if name == "probe_max" else rng  # probe: checked first
            value, error = limits.problem(v, rng)
            if error:
                raise ValueError(f"speculation.{name} must be an integer >= {rng.lo}, got {v!r}")
            object.__setattr__(self, name, value)
        hi = len(tiers) - 1 if self.max_tier is None else self.max_tier
        if not 0 <= self.min_tier <= hi < len(tiers):
            raise ValueError(f"speculation: need 0 <= min_tier ({self.min_tier}) <= max_tier ({hi}) < {len(tiers)}")
        object.__setattr__(self, "max_tier", hi)

    @classmethod
    def fixed(cls, tier: TreeConfig | None) -> "Speculation":
        return cls((tier,), policy="fixed")

    @property
    def scratch(self) -> int:
        """Cache slots past the prefix that the largest tier needs."""
        return max(1 if t is None else t.scratch for t in self.tiers)

    @property
    def positions(self) -> int:
        """The most draft positions any tier offers."""
        return max(0 if t is None else t.path_len - 1 for t in self.tiers)

    @property
    def max_top_k(self) -> int:
        return max(1 if t is None else t.top_k for t in self.tiers)


def tier_name(tier: TreeConfig | None) -> str:
    if tier is None:
        return "none"
    if tier.top_k == 1 and tier.total_tokens == tier.path_len:
        return f"chain{tier.total_tokens - 1}"
    return f"{tier.total_tokens},{tier.depth},{tier.top_k}"


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Controller:
    """The policy's state in the loop (scalars and per-tier / per-position arrays)."""

    tier: jax.Array  # the tier of the next round
    since: jax.Array  # rounds since the last switch
    rounds: jax.Array  # rounds run
    hits: jax.Array  # [D] decayed accepted counts per draft position (chains)
    trials: jax.Array  # [D] decayed offered counts per draft position (chains)
    drafts: jax.Array  # [D] decayed count of the chain rounds that drafted each position
    idle: jax.Array  # [D] rounds since a chain round last drafted each position (at the longest
    #                   chain's last one: the rounds since that chain ran)
    mean: jax.Array  # [T] running committed tokens per round, per tier
    tried: jax.Array  # [T] bool
    wait: jax.Array  # rounds away from the longest chain before the next try of it
    probed: jax.Array  # bool: the current tier was entered by such a try
    round_ms: jax.Array  # [T] milliseconds per round, per tier


def fresh(spec: Speculation) -> dict:
    """What the policy knows before any round: nothing (``learned`` of a new controller)."""
    D, T = max(spec.positions, 1), len(spec.tiers)
    return {"rounds": jnp.int32(0), "hits": jnp.zeros((D,), jnp.float32), "trials": jnp.zeros((D,), jnp.float32),
            "drafts": jnp.zeros((D,), jnp.float32), "idle": jnp.zeros((D,), jnp.float32),
            "mean": jnp.zeros((T,), jnp.float32), "tried": jnp.zeros((T,), bool), "wait": jnp.int32(spec.probe),
            "tier": jnp.int32(0 if spec.policy == "fixed" else _warmup_tier(spec)), "since": jnp.int32(spec.cooldown),
            "probed": jnp.bool_(False)}


def learned(ctl: Controller) -> dict:
    """What a later call starts from (its round costs are measured anew): the estimates (and
    the rounds since each draft position was drafted), and where the policy stands (its tier,
    the rounds since the last switch and since the longest chain ran, the wait before its
    next try), so that a drafter or a depth that never pays is tried every ``probe_max``
    rounds over all the calls, not at each call's start."""
    return {f.name: getattr(ctl, f.name) for f in dataclasses.fields(ctl) if f.name != "round_ms"}


def init(spec: Speculation, round_ms, prior: dict | None = None) -> Controller:
    """A controller for a new call, from ``prior`` (``learned`` of an earlier call with the
    same models and tiers: it goes on where that call stopped, with no second warm-up) or
    from nothing; picks its first tier."""
    prior = fresh(spec) if prior is None else prior
    ctl = Controller(**prior, round_ms=jnp.asarray(round_ms, jnp.float32))
    return ctl if spec.policy == "fixed" else _choose(ctl, spec)


def update(ctl: Controller, spec: Speculation, accepted_B, drafted_B) -> Controller:
    """Folds one round of tier ``ctl.tier`` (``accepted`` drafts per sequence, ``drafted``:
    the sequences that drafted in it) into the estimates, then picks the next tier."""
    if spec.policy == "fixed":
        return dataclasses.replace(ctl, rounds=ctl.rounds + 1)
    D, T = ctl.hits.shape[0], len(spec.tiers)
    w = drafted_B.astype(jnp.float32)
    n = jnp.maximum(w.sum(), 1.0)
    seen = w.sum() > 0
    depth = jnp.asarray([0 if t is None else t.path_len - 1 for t in spec.tiers])[ctl.tier]
    is_chain = jnp.asarray([t is not None and t.top_k == 1 for t in spec.tiers])[ctl.tier]
    i = jnp.arange(1, D + 1)[None]
    offered = (accepted_B[:, None] >= i - 1) & (i <= depth) & drafted_B[:, None]
    took = (accepted_B[:, None] >= i) & (i <= depth) & drafted_B[:, None]
    # a chain round informs only the positions it drafted: the estimates of deeper positions
    # wait for a longer chain instead of fading to the prior; when one drafts them again,
    # what they showed before is aged by every round since (so the new rounds, not a stretch
    # long past, decide whether that chain stays; the count of rounds that drafted them is
    # not, so that a position judged before is not taken as thin evidence again)
    drafted_pos = seen & is_chain & (i[0] <= depth)
    age = DECAY ** (ctl.idle + 1.0)
    hits = jnp.where(drafted_pos, age * ctl.hits + took.sum(0), ctl.hits)
    trials = jnp.where(drafted_pos, age * ctl.trials + offered.sum(0), ctl.trials)
    drafts = jnp.where(drafted_pos, DECAY * ctl.drafts + 1.0, ctl.drafts)  # not aged: judged before, not thin again
    idle = jnp.where(drafted_pos, 0.0, ctl.idle + 1.0)  # float32: DECAY ** idle reaches 0, no overflow
    obs = (w * (accepted_B + 1)).sum() / n
    this = jnp.arange(T) == ctl.tier
    mean = jnp.where(this & seen, jnp.where(ctl.tried, DECAY * ctl.mean + (1 - DECAY) * obs, obs), ctl.mean)
    ctl = dataclasses.replace(ctl, hits=hits, trials=trials, drafts=drafts, idle=idle, mean=mean, tried=ctl.tried | (this & seen),
                              rounds=ctl.rounds + 1, since=ctl.since + 1)
    return _choose(ctl, spec)


def expected_tokens(ctl: Controller, spec: Speculation):
    """Expected committed tokens per round of each tier (see the module doc)."""
    # each position's rate, shrunk toward the rate of all positions together (itself smoothed
    # toward 1/2): a position seen in a few rounds borrows from the others
    pooled = (ctl.hits.sum() + 1.0) / (ctl.trials.sum() + 2.0)
    a = (ctl.hits + PRIOR * pooled) / (ctl.trials + PRIOR)
    thin = (ctl.trials < THIN) & (ctl.drafts < THIN_ROUNDS)
    a = jnp.where(thin, jnp.maximum(a, pooled), a)  # thin evidence: optimistic, as for untried trees

    chain = 1.0 + jnp.cumsum(jnp.cumprod(a))  # chain[k - 1] = 1 + Σ_{i≤k} Π_{j≤i} a_j: a chain of k drafts
    widths = {t.top_k for t in spec.tiers if t is not None and t.top_k > 1}  # trees' optimistic estimates
    wide = {k: 1.0 + jnp.cumsum(jnp.cumprod(1.0 - (1.0 - a) ** k)) for k in widths}
    est = []
    for j, t in enumerate(spec.tiers):
        if t is None:
            est.append(jnp.float32(1.0))
        elif t.top_k == 1:
            est.append(chain[t.path_len - 2])
        else:  # untried: optimistic, as if each level offered top_k independent tries
            est.append(jnp.where(ctl.tried[j], ctl.mean[j], wide[t.top_k][t.path_len - 2]))
    return jnp.stack(est)


def _warmup_tier(spec: Speculation) -> int:
    """The longest allowed chain (its rounds inform every draft position of every chain), else
    the first allowed drafting tier, else ``min_tier``."""
    allowed = [(i, t) for i, t in enumerate(spec.tiers) if spec.min_tier <= i <= spec.max_tier]
    chains = [(t.path_len, i) for i, t in allowed if t is not None and t.top_k == 1]
    drafting = [i for i, t in allowed if t is not None]
    return max(chains)[1] if chains else (drafting[0] if drafting else spec.min_tier)


def _choose(ctl: Controller, spec: Speculation) -> Controller:
    T = len(spec.tiers)
    rate = expected_tokens(ctl, spec) / jnp.maximum(ctl.round_ms, 1e-6)
    allowed = (jnp.arange(T) >= spec.min_tier) & (jnp.arange(T) <= spec.max_tier)
    best = jnp.argmax(jnp.where(allowed, rate, -jnp.inf)).astype(jnp.int32)
    warming = ctl.rounds < spec.warmup
    warm_tier = jnp.int32(_warmup_tier(spec))
    switch = ((ctl.since >= spec.cooldown) | (ctl.rounds == spec.warmup)) & (best != ctl.tier)  # free after warm-up
    tier = jnp.where(warming, warm_tier, jnp.where(switch, best, ctl.tier))
    wait, probed = ctl.wait, ctl.probed
    warm = spec.tiers[_warmup_tier(spec)]
    if spec.probe and warm is not None and (warm.top_k == 1 or None in spec.tiers):
        if warm.top_k == 1:
            # only the longest chain's rounds inform its deep positions (and acceptance at all,
            # after plain steps): away from it for ``wait`` rounds, it is tried again
            gone, home, waited = ctl.tier != warm_tier, ctl.tier == warm_tier, ctl.idle[warm.path_len - 2]
        else:  # no chain: tried again from plain steps only (trees' rounds inform themselves)
            none = spec.tiers.index(None)
            gone, home, waited = ctl.tier == none, ctl.tier != none, ctl.since
        # a tier just entered keeps it for its cooldown first (or the wait, if shorter)
        probing = ~warming & gone & (waited >= ctl.wait) & (ctl.since >= jnp.minimum(spec.cooldown, ctl.wait))
        tier = jnp.where(probing, warm_tier, tier)
        # left straight from a try: wait twice as long; after it was kept: the shortest wait
        left = home & (tier != warm_tier) if warm.top_k == 1 else (tier == none) & home
        backoff = jnp.where(ctl.probed & (ctl.since <= spec.cooldown), jnp.minimum(2 * ctl.wait, spec.probe_max), spec.probe)
        wait = jnp.where(left, backoff, wait)
        probed = jnp.where(tier != ctl.tier, probing, probed)
    return dataclasses.replace(ctl, tier=tier, since=jnp.where(tier != ctl.tier, 0, ctl.since), wait=wait,
                               probed=probed)


# What the adaptive policy learned (acceptance, tokens per round per tier), per (models,
# tiers): a later call starts from it instead of warming up again.  Speed only, never output.
_LEARNED: dict = {}


_LEARNED_SIZE = 64  # (models, tiers) pairs kept, oldest dropped first


def remember(key, learned_state: dict):
    _LEARNED.pop(key, None)
    _LEARNED[key] = learned_state
    while len(_LEARNED) > _LEARNED_SIZE:
        _LEARNED.pop(next(iter(_LEARNED)))


def recall(key) -> dict | None:
    return _LEARNED.get(key)


def forget():
    """Drops every learned estimate: the next adaptive call warms up again."""
    _LEARNED.clear()


def snapshot() -> dict:
    """Everything the adaptive policy has learned (per models and tiers), as :func:`restore`
    takes it: to run one stream of calls on its own state while others run in between."""
    return dict(_LEARNED)


def restore(state: dict):
    """Makes ``state`` (a :func:`snapshot`; ``{}``: nothing learned, as :func:`forget`) what
    the adaptive policy has learned."""
    _LEARNED.clear()
    _LEARNED.update(state)
