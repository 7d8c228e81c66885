"""Test helpers: tiny Hugging Face models built offline from configs (torch is the reference)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).parent / "fixtures"
ROOT = Path(__file__).parent.parent


def cpu_devices_env(n: int) -> dict:
    """The environment of a subprocess that sees ``n`` CPU devices: this one's (the suite's cheap
    compile settings, see conftest), with the device count added to its ``XLA_FLAGS`` and the
    project on ``PYTHONPATH``."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n}".strip()
    return {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}


@contextlib.contextmanager
def full_optimization():
    """XLA's full optimization for the programs compiled inside (the suite compiles with the cheap
    pipeline, ``jax_disable_most_optimizations``, see conftest): for a test, or a module fixture,
    whose programs run far longer than they take to compile."""
    import jax

    before = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", before)


BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=8,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-5, tie_word_embeddings=False)

FAMILY_CONFIGS = {
    "llama3_scaled": dict(model_type="llama", head_dim=16, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64)),
    "llama_tied": dict(model_type="llama", tie_word_embeddings=True, rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    "qwen2": dict(model_type="qwen2", rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
    "qwen3": dict(model_type="qwen3", head_dim=32, rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
    "mistral": dict(model_type="mistral", sliding_window=None, rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
}


def build_hf_model(kind: str, directory: Path, *, seed: int = 0, max_shard_size=None, **overrides):
    """Builds a random transformers model of ``kind``, saves it to ``directory`` and returns it (eval, f32)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = {**BASE, **FAMILY_CONFIGS[kind], **overrides}
    model_type = spec.pop("model_type")
    config = AutoConfig.for_model(model_type, **spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # every tensor random (HF init zeroes biases and sets norms to 1)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, **kw)
    return model


def hf_forward(model, ids: np.ndarray):
    """Returns (logits [B,T,V], hidden_states list) from the torch reference."""
    import torch

    with torch.no_grad():
        out = model(torch.as_tensor(ids), output_hidden_states=True)
    return out.logits.numpy(), [h.numpy() for h in out.hidden_states]


def oracle_drafter(target, prompts, continuation_len: int, seed: int = 0):
    """A drafter that proposes the target's own greedy continuation (plus random runners-up).

    It knows each row's greedy sequence in advance, so its top-1 at drafter position
    ``j`` is the greedy token at target position ``j + 2``: long acceptance paths.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import eagle3_jax
    from eagle3_jax.config import DrafterConfig, RopeConfig
    from eagle3_jax.kv_cache import init_cache

    tc = target.config
    res = eagle3_jax.generate(target, None, prompts, max_new_tokens=continuation_len)
    width = max(len(p) for p in prompts) + continuation_len + 64
    table = np.zeros((len(prompts), width), np.int32)
    for b, (p, c) in enumerate(zip(prompts, res.tokens)):
        seq = list(p) + c
        table[b, : len(seq)] = seq

    class Oracle(nnx.Module):
        def __init__(self):
            self.config = DrafterConfig(vocab_size=tc.vocab_size, draft_vocab_size=tc.vocab_size, hidden_size=tc.hidden_size,
                                        intermediate_size=8, num_heads=1, num_kv_heads=1, head_dim=2, rms_norm_eps=1e-6,
                                        rope=RopeConfig(), target_hidden_size=tc.hidden_size)
            self.table = nnx.Variable(jnp.asarray(table))
            self.noise = nnx.Variable(jax.random.normal(jax.random.key(seed), (64, tc.vocab_size)))

        def __call__(self, hidden, tokens, positions, *, cache=None, region_mask_BxTxR=None, write_offset=0):
            B, T = tokens.shape
            row = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
            out = jnp.zeros((B, T, tc.hidden_size)).at[..., 0].set(positions).at[..., 1].set(row)
            return out, cache

        def step(self, hidden, tokens, positions, *, cache=None, region_mask_BxTxR=None, region_kv=None):
            out, _ = self(hidden, tokens, positions)
            kv = jnp.zeros(tokens.shape + (1, 1))
            return out, (kv, kv)

        def logits(self, out):
            pos = out[..., 0].astype(jnp.int32) + 2
            row = out[..., 1].astype(jnp.int32)
            want = self.table[...][row, jnp.minimum(pos, width - 1)]
            return 10.0 * jax.nn.one_hot(want, tc.vocab_size) + self.noise[...][pos % 64]

        def to_target_ids(self, ids):
            return ids

        def init_cache(self, batch, max_len):
            return init_cache(1, batch, 1, 1, 1)

    return Oracle(), res.tokens



FAKE_TIER_LEN = 2  # the stand-in experiment's one static tier: a chain of 2
FAKE_PROMPTS = [[1, 2], [3, 4], [5, 6]]  # its prompts, one batch each


class FakeGenerate:
    """``generate`` without a model, for the two-budget experiment's bookkeeping
    (``tests/test_experiment*.py``): every prompt makes 4 tokens (the prefill's and one round of
    3, on ``tier`` where it speculates), in ``seconds(B, mode name, repeat)`` per call; each call
    is recorded (B, mode name, first tokens of the prompts, what the adaptive policy had learned
    when it started), and an adaptive call learns one more round (a counter under the key
    ``"fake"``)."""

    def __init__(self, tier, chunks: int, seconds=lambda b, name, r: 1.0):
        self.tier, self.seconds, self.chunks, self.calls, self.made = tier, seconds, chunks, [], {}

    def __call__(self, target, drafter, prompts, *, max_new_tokens, thinking_budget, temperature,
                 time_first_token=False, warm_up=False, speculation=None, round_ms=None, **kw):
        from types import SimpleNamespace

        from eagle3_jax import experiment
        from eagle3_jax import speculation as policy
        from eagle3_jax.speculation import Speculation, tier_name

        name = experiment.mode_name(speculation)
        key = (thinking_budget, name, temperature)
        repeat = self.made.get(key, 0) // self.chunks
        self.made[key] = self.made.get(key, 0) + 1
        learned = policy.snapshot().get("fake")
        self.calls.append((thinking_budget, name, [p[0] for p in prompts], learned))
        if isinstance(speculation, Speculation):
            assert round_ms is not None and len(round_ms) == len(speculation.tiers)
            policy.remember("fake", (learned or 0) + 1)
        seconds = self.seconds(thinking_budget, name, repeat)
        stats = {"seconds": seconds, "rounds": [1] * len(prompts), "accept_lengths": [[2] for _ in prompts],
                 "proposed": 2 * len(prompts), "accepted": 2 * len(prompts), "committed": 4 * len(prompts),
                 "forced_rounds": 0}
        if time_first_token:
            stats["first_token_seconds"] = seconds / 10
        if speculation is not None:
            stats["tier_per_round"] = [tier_name(self.tier)]
        n = len(prompts)
        return SimpleNamespace(tokens=[[p[0]] * 4 for p in prompts], stats=stats, thinking_tokens=[0] * n,
                               answer_tokens=[4] * n, thinking_status=["none"] * n)


def fake_experiment(monkeypatch, tier=None, chunks: int = len(FAKE_PROMPTS)):
    """A fixture's body (``yield from``): installs a ``FakeGenerate`` in ``eagle3_jax.experiment``
    (yielded; its ``seconds`` may be replaced) and round costs that make its calls of 1 s exactly
    (its first token a tenth of its time, vanilla's 3 steps of 300 ms, a speculative mode's one
    round of 900 ms); the policy's learned state is left as it was found."""
    from eagle3_jax import experiment
    from eagle3_jax import speculation as policy

    from eagle3_jax.tree import TreeConfig

    gen = FakeGenerate(TreeConfig.chain(FAKE_TIER_LEN) if tier is None else tier, chunks)
    monkeypatch.setattr(experiment, "generate", gen)
    monkeypatch.setattr(experiment, "round_costs", lambda target, drafter, batch, modes, **kw: {
        experiment.mode_name(m): dict.fromkeys(experiment.tier_names(m), 300.0 if m is None else 900.0)
        for m in modes})
    before = policy.snapshot()
    policy.forget()
    yield gen
    policy.restore(before)


def assert_refused(error, fn, path, named):
    """``fn(path)`` raises ``error`` whose message names the file and each of ``named``."""
    import pytest

    with pytest.raises(error) as e:
        fn(path)
    assert str(path) in str(e.value)
    for part in named:
        assert part in str(e.value), str(e.value)


def builtin_tokenizer():
    """The built-in target's tokenizer (transformers', from its directory)."""
    from transformers import AutoTokenizer

    from eagle3_jax import builtin

    return AutoTokenizer.from_pretrained(str(builtin.TARGET_DIR), local_files_only=True)


class FakeSlots:
    """A stand-in for ``decode.Slots``: ``num_slots`` rows of ``max_len`` tokens; a running
    request gets ``token`` once per round up to its ``max_new_tokens`` (then it is done), except
    while ``hold`` is set (its rounds make nothing: it keeps its slot).  Records the inserts."""

    thinking = None

    def __init__(self, token: int, eos: int, num_slots: int = 2, max_len: int = 96):
        import threading

        self.token, self.num_slots, self.max_len = token, num_slots, max_len
        self.stop_ids = (eos,)
        self.request_len, self.max_prompt_len = max_len - 1, max_len - 32
        self.hold = threading.Event()
        self.inserts: list[tuple[list[int], dict]] = []
        self._rows: list[dict | None] = [None] * num_slots
        self._tickets = iter(range(1 << 30))

    @classmethod
    def of(cls, tok, **kw) -> "FakeSlots":
        """Slots whose rounds make ``tok``'s ``x``, ending at its EOS."""
        return cls(tok.convert_tokens_to_ids("x"), tok.eos_token_id, **kw)

    def max_new_tokens_for(self, prompt_len: int) -> int:
        return self.request_len - prompt_len if prompt_len <= self.max_prompt_len else 0

    def row_buckets(self):
        out = [1]
        while out[-1] < self.num_slots:
            out.append(min(2 * out[-1], self.num_slots))
        return out

    def warm_buckets(self):
        return [1]

    def prompt_bucket(self, prompt_len: int) -> int:
        return self.max_len

    def reset_policy(self):
        pass

    def insert(self, slot, prompt_ids, *, max_new_tokens, **kw):
        self.inserts.append((list(prompt_ids), {"max_new_tokens": max_new_tokens, **kw}))
        self._rows[slot] = {"tokens": [self.token], "max": max_new_tokens, "ticket": next(self._tickets)}
        return self._rows[slot]["ticket"]

    def run(self, rounds: int):
        import time

        time.sleep(0.002)  # a dispatch takes time (the engine thread does not spin)
        for row in self._rows:
            if row is not None and not self.hold.is_set():
                row["tokens"] = (row["tokens"] + [self.token] * rounds)[: row["max"]]

    def poll(self, lag: int = 0):
        from eagle3_jax.decode import SlotView

        return [SlotView(False, [], False, None, 0, 0, "none", {}, -1) if r is None else
                SlotView(len(r["tokens"]) < r["max"], list(r["tokens"]), len(r["tokens"]) >= r["max"],
                         "length" if len(r["tokens"]) >= r["max"] else None, 0, len(r["tokens"]), "none", {},
                         r["ticket"]) for r in self._rows]

    def release(self, slot: int):
        self._rows[slot] = None


def fake_server(tok, slots, *, max_queue: int = 4, app_tokenizer=None, **cfg):
    """A ``ServerThread`` (not started) over a real engine on ``slots`` (a :class:`FakeSlots`):
    model ``fake``, greedy by default, ``cfg`` the other ``ServerConfig`` fields; prompts are
    tokenized with ``app_tokenizer`` (default ``tok``)."""
    from eagle3_jax.serve.app import create_app
    from eagle3_jax.serve.engine import Engine
    from eagle3_jax.serve.schemas import ServerConfig
    from eagle3_jax.serve.server import ServerThread

    engine = Engine(slots, tok, max_queue=max_queue).start()
    return ServerThread(create_app(engine, ServerConfig("fake", len(tok), temperature=0.0, **cfg),
                                   tokenizer=tok if app_tokenizer is None else app_tokenizer))


def post(server, body, path="/v1/completions", **kw):
    """POSTs ``body`` (a dict or list as JSON, else as it is) to a running server."""
    import json

    import httpx

    content = json.dumps(body) if isinstance(body, (dict, list)) else body
    return httpx.post(server.url + path, content=content, timeout=30, **kw)


def api_error(r, status: int, code: str | None = None, param: str | None = None) -> dict:
    """The OpenAI-shaped error of response ``r``, checked: its status, code and parameter."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert code is None or err["code"] == code, err
    assert err["param"] == param, err
    return err


def run_fake_experiment(tmp_path, **kw):
    """``run_experiment`` on ``FAKE_PROMPTS`` with no model (under ``fake_experiment``): budgets 0
    and unlimited, step 2 at unlimited, the chain of ``FAKE_TIER_LEN`` as its one static tier,
    greedy only, into ``tmp_path / "exp"`` (``kw`` overrides)."""
    from eagle3_jax import experiment
    from eagle3_jax.tree import TreeConfig

    kw = {"budgets": (0, None), "chosen": (None,), "tiers": (TreeConfig.chain(FAKE_TIER_LEN),),
          "sampled_temperature": None, "out_dir": tmp_path / "exp", "progress": False, **kw}
    return experiment.run_experiment(None, None, None, FAKE_PROMPTS, **kw)



def chi2_pvalue(a, b, bins):
    """The χ² test's p-value that samples ``a`` and ``b`` come from one distribution, counted
    over the values ``bins`` and one bin for every other value (empty bins dropped)."""
    from scipy.stats import chi2_contingency

    table = np.array([[np.sum(x == v) for v in bins] + [np.sum(~np.isin(x, bins))] for x in (a, b)])
    table = table[:, table.sum(0) > 0]
    return chi2_contingency(table)[1]


def random_candidates(rng, cfg):
    """Candidate lists with the structure ``tree.expand`` produces (beam-major, cumulative
    scores) for the tree budget ``cfg``: ``(scores, tokens, parents)``, each ``[1, C]``."""
    import jax.numpy as jnp

    k = cfg.top_k
    scores = np.sort(-rng.exponential(size=k))[::-1]
    all_s, all_p = [scores], [np.full(k, -1)]
    beam_cand, beam_s = np.arange(k), scores
    for i in range(cfg.depth):
        child = np.sort(-rng.exponential(size=(k, k)), axis=1)[:, ::-1]
        cu = (beam_s[:, None] + child).reshape(-1)
        all_s.append(cu)
        all_p.append(np.repeat(beam_cand, k))
        best = np.argsort(-cu, kind="stable")[:k]
        beam_cand, beam_s = k + i * k * k + best, cu[best]
    C = cfg.num_candidates
    return (jnp.asarray(np.concatenate(all_s))[None], jnp.arange(C, dtype=jnp.int32)[None] + 100,
            jnp.asarray(np.concatenate(all_p), jnp.int32)[None])


TINY_VOCAB, TINY_DRAFT_VOCAB, TINY_HIDDEN = 64, 32, 16  # tiny_drafter's and tiny_target's sizes


def _fill(model, shapes: dict, seed: int):
    """Random values from numpy (no jax compilation) for a model built with ``nnx.eval_shape``."""
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    for name, shape in shapes.items():
        if shape is not None:
            getattr(model, name).set_value(jnp.asarray(rng.normal(size=shape), jnp.float32))
    model.inv_freq.set_value(jnp.asarray(model.config.rope.inv_freq(model.config.head_dim)))
    return model


def tiny_drafter(seed: int, hidden: int = TINY_HIDDEN, target_hidden: int = TINY_HIDDEN, own_embedding: bool = False):
    """A random drafter with a vocabulary map (draft id i -> target id 2i), built without compiling."""
    import jax.numpy as jnp
    from flax import nnx

    from eagle3_jax.config import DrafterConfig, RopeConfig
    from eagle3_jax.models.drafter import Drafter, param_shapes

    cfg = DrafterConfig(vocab_size=TINY_VOCAB, draft_vocab_size=TINY_DRAFT_VOCAB, hidden_size=hidden,
                        intermediate_size=24, num_heads=2, num_kv_heads=1, head_dim=8, rms_norm_eps=1e-5,
                        rope=RopeConfig(), target_hidden_size=target_hidden)
    model = nnx.eval_shape(lambda: Drafter(cfg, jnp.zeros((TINY_VOCAB, hidden))))
    _fill(model, {**param_shapes(cfg), "embed": (TINY_VOCAB, hidden)}, seed)
    model.d2t.set_value(jnp.arange(TINY_DRAFT_VOCAB, dtype=jnp.int32))
    model.own_embedding = own_embedding
    return model


def tiny_target(seed: int = 0):
    """A random 8-layer Llama target of ``TINY_HIDDEN`` and ``TINY_VOCAB``, built without compiling."""
    from flax import nnx

    from eagle3_jax.config import TargetConfig
    from eagle3_jax.models.target import Target, param_shapes

    cfg = TargetConfig.from_dict(dict(model_type="llama", hidden_size=TINY_HIDDEN, num_hidden_layers=8,
                                      intermediate_size=24, num_attention_heads=2, num_key_value_heads=1,
                                      vocab_size=TINY_VOCAB, max_position_embeddings=64, eos_token_id=[1]))
    return _fill(nnx.eval_shape(lambda: Target(cfg)), param_shapes(cfg), seed)


def golden_drafters(target=None) -> dict:
    """The official EAGLE-3 drafters of ``tests/fixtures`` by name (``drafter_tiny`` and
    ``drafter_tiny_trained``), on ``target`` (default: the golden ``target_tiny``, loaded)."""
    import eagle3_jax

    target = eagle3_jax.load_target(FIXTURES / "target_tiny") if target is None else target
    return {name: eagle3_jax.load_drafter(FIXTURES / name, target=target) for name in ("drafter_tiny", "drafter_tiny_trained")}


def random_records(n: int = 24, T: int = 20, seed: int = 0) -> dict:
    """``n`` training records of ``T`` random token ids (of the golden target's 1024) with a
    random loss mask (about 90% of positions on)."""
    rng = np.random.default_rng(seed)
    return {"input_ids": rng.integers(0, 1024, (n, T)).astype(np.int32), "loss_mask": rng.random((n, T)) < 0.9}


def row_records(rows, seq_len: int = 6) -> dict:
    """Records whose row ``i`` is token ``rows[i]`` repeated ``seq_len`` times (even tokens
    masked in), each of length ``seq_len``: which rows a shard holds reads off ``input_ids[:, 0]``."""
    ids = np.asarray(rows, np.int32)[:, None] + np.zeros((1, seq_len), np.int32)
    return {"input_ids": ids, "loss_mask": ids % 2 == 0, "lengths": np.full(len(rows), seq_len, np.int32)}


def plain_ttt_loss(drafter, features_BxTx3H, input_ids_BxT, target_logits_BxTxV, loss_mask_BxT, *, length,
                   step_weight):
    """The TTT loss before the fit step's memory work: the draft-vocabulary label logits
    gathered from the whole float32 target logits, each step's logits made for the whole sequence."""
    import jax
    import jax.numpy as jnp

    from eagle3_jax import layers
    from eagle3_jax.train.ttt import shift_left, ttt_attention

    cfg = drafter.config
    B, T = input_ids_BxT.shape
    draft_ids = drafter.to_target_ids(jnp.arange(cfg.draft_vocab_size))
    target_logits = jax.lax.stop_gradient(target_logits_BxTxV.astype(jnp.float32))
    label_logits, in_vocab = target_logits[..., draft_ids], drafter.t2d[jnp.argmax(target_logits, -1)]
    loss_mask = loss_mask_BxT.astype(jnp.float32)
    h = drafter.fuse(features_BxTx3H)
    p = drafter.attn_params()
    keys, values, losses, accs = [], [], [], []
    for s in range(length):
        label = shift_left(label_logits, 1 + s)
        predicted_mask = shift_left(loss_mask, 2 + s)
        mask = predicted_mask * shift_left(in_vocab.astype(jnp.float32), 1 + s)
        cos, sin = drafter.rope(jnp.broadcast_to(jnp.arange(T) + s, (B, T)))
        q, k, v = layers.qkv(p, drafter.layer_input(h, shift_left(input_ids_BxT, 1 + s)), cos, sin,
                             num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                             eps=cfg.rms_norm_eps)
        keys.append(k)
        values.append(v)
        h = drafter.layer_output(h, ttt_attention(q, keys, values, cfg.head_dim ** -0.5).reshape(B, T, -1) @ p["wo"])
        logits = drafter.logits(h)
        soft_ce = -(jax.nn.softmax(label, -1) * jax.nn.log_softmax(logits, -1)).sum(-1)
        losses.append((soft_ce * mask).sum() / jnp.maximum(mask.sum(), 1.0))
        hit = (jnp.argmax(logits, -1) == jnp.argmax(label, -1)).astype(jnp.float32)
        accs.append((hit * mask).sum() / jnp.maximum(predicted_mask.sum(), 1.0))
    losses, accs = jnp.stack(losses), jnp.stack(accs)
    return (step_weight ** jnp.arange(length) * losses).sum(), {"loss_s": losses, "acc_s": accs}


def plain_fit_step_fn(tgraph, dgraph, cfg, opt):
    """The fit step before its memory work (online; ``cfg`` a ``FitConfig``): the target's
    whole logits, one batch, :func:`plain_ttt_loss` (the reference of
    ``tests/test_train_trainer.py`` and ``scripts/fit_memory.py``)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    def step(params, opt_state, frozen, tstate, input_ids, loss_mask):
        target = nnx.merge(tgraph, tstate)
        hidden, feats, _ = target.trunk(input_ids, jnp.broadcast_to(jnp.arange(input_ids.shape[1]), input_ids.shape))
        logits = jax.lax.stop_gradient(target.head(hidden))

        def loss_fn(p):
            if cfg.compute_dtype != "float32":
                p = jax.tree.map(lambda x: x.astype(cfg.compute_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, p)
            return plain_ttt_loss(nnx.merge(dgraph, p, frozen), feats, input_ids, logits, loss_mask,
                                  length=cfg.ttt_length, step_weight=cfg.step_weight)

        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss, **metrics}

    return step
