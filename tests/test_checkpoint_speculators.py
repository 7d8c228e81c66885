"""vLLM's ``speculators`` EAGLE-3 layout and its variants (issue 62), checked against that
library itself: drafters built by ``speculators`` 0.9.0 with random weights for each variant
are saved by the library, loaded here, and their hidden states and draft logits compared
with the library's own forward on the same inputs, step by step as its training-time test
feeds them back (float32, within 1e-5); our export is loaded back by the library with
identical tensors; every variant drafts with greedy output identical to vanilla decoding on
the built-in target; and the checkpoints that must be refused are refused by key.

The library is a test-only reference, installed with ``pip install --no-deps
speculators==0.9.0`` (README, the second command): its requirements pull torchvision and
torchaudio builds that do not load with the test extra's torch.
"""

import dataclasses
import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

speculators = pytest.importorskip("speculators", reason="pip install --no-deps speculators==0.9.0 (see README)")
import torch  # noqa: E402
from speculators.config import SpeculatorsConfig, VerifierConfig  # noqa: E402
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig  # noqa: E402
from speculators.proposals.greedy import GreedyTokenProposalConfig  # noqa: E402
from transformers import LlamaConfig, Qwen3Config  # noqa: E402

import eagle3_jax  # noqa: E402
from eagle3_jax import builtin  # noqa: E402
from eagle3_jax.config import DrafterConfig  # noqa: E402
from eagle3_jax.decode import Slots  # noqa: E402
from eagle3_jax.train.ttt import ttt_step  # noqa: E402
from eagle3_jax.speculation import Speculation  # noqa: E402
from eagle3_jax.tree import TreeConfig  # noqa: E402

# the built-in target's shapes (eagle3_jax/assets/builtin/target): 16 layers, captured 2, 8, 13
H, I, HEADS, KV, D, VOCAB, DRAFT_VOCAB, EPS = 128, 344, 2, 1, 64, 910, 512, 1e-5
IDS = [2, 8, 13]
TOL = 1e-5

VARIANTS = {
    "plain": {},
    "norm_before_residual": {"norm_before_residual": True},
    "fc_norm": {"fc_norm": True},
    "norm_before_fc": {"norm_before_fc": True},
    "norm_output": {"norm_output": True},
    "two_layers": {"layers": 2},
    "qwen3": {"family": "qwen3"},
    "sliding": {"family": "qwen3", "layers": 2, "window": 8},
    "two_captured": {"ids": [2, 13]},
    "everything": {"family": "qwen3", "layers": 3, "norm_before_residual": True, "fc_norm": True, "norm_output": True},
}


def build(variant: dict, seed: int = 0, window: int | None = None) -> Eagle3DraftModel:
    """A speculators ``Eagle3DraftModel`` of ``variant`` with random float32 weights (norms
    around 1, so that each one matters) and a random draft vocabulary."""
    torch.manual_seed(seed)
    family, layers = variant.get("family", "llama"), variant.get("layers", 1)
    window = window or variant.get("window")
    common = dict(vocab_size=VOCAB, hidden_size=H, intermediate_size=I, num_hidden_layers=layers,
                  num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=D, max_position_embeddings=512,
                  rms_norm_eps=EPS)
    if family == "qwen3":
        extra = {} if window is None else dict(use_sliding_window=True, sliding_window=window,
                                               layer_types=["full_attention"] + ["sliding_attention"] * (layers - 1))
        tl = Qwen3Config(**common, **extra)
    else:
        tl = LlamaConfig(**common)
    tl._attn_implementation = "eager"
    cfg = Eagle3SpeculatorConfig(
        transformer_layer_config=tl, draft_vocab_size=DRAFT_VOCAB,
        eagle_aux_hidden_state_layer_ids=variant.get("ids", IDS),
        **{k: variant.get(k, False) for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")},
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy", verifier=VerifierConfig(name_or_path=None, architectures=[])))
    model = Eagle3DraftModel(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (1.0 if name.startswith("embed") else 0.7 / p.shape[-1] ** 0.5))
    ids = np.sort(np.random.default_rng(seed).choice(VOCAB, DRAFT_VOCAB, replace=False))
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[torch.as_tensor(ids)] = True
    model.load_vocab_mappings(t2d, torch.as_tensor(ids - np.arange(DRAFT_VOCAB), dtype=torch.long))
    return model


def library_steps(model, feats, ids, steps: int):
    """The library's own forward (its training-time test, teacher-forced): per step, the
    hidden it feeds back and the draft logits, ``[steps, T, ...]`` each."""
    fed, logits = [], []

    def head(module, args, out):  # a hook returning something would replace the output
        logits.append(out)
        fed.append(args[0])

    hooks = [model.layers[-1].register_forward_hook(lambda m, i, o: fed.append(o) and None),
             model.lm_head.register_forward_hook(head)]
    try:
        with torch.no_grad():
            T = ids.shape[1]
            model(hidden_states=torch.as_tensor(feats), input_ids=torch.as_tensor(ids),
                  document_ids=torch.zeros((1, T), dtype=torch.long), position_ids=torch.arange(T)[None],
                  ttt_steps=steps)
    finally:
        for h in hooks:
            h.remove()
    # per step: the last layer's output, then lm_head's input (the normed hidden with norm_output)
    pick = 1 if model.config.norm_output else 0
    hidden = [fed[2 * s + pick][0].numpy() for s in range(steps)]
    return np.stack(hidden), np.stack([x[0].numpy() for x in logits])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``name -> (library model, directory it saved)`` for every variant."""
    out = {}
    for i, (name, variant) in enumerate(VARIANTS.items()):
        model = build(variant, seed=i)
        d = tmp_path_factory.mktemp(name)
        model.save_pretrained(str(d))
        out[name] = (model, d)
    return out


def inputs(variant: dict, T: int = 24, seed: int = 0):
    rng = np.random.default_rng(seed)
    n = len(variant.get("ids", IDS))
    return (0.5 * rng.normal(size=(1, T, n * H))).astype(np.float32), rng.integers(0, VOCAB, (1, T))


@pytest.mark.parametrize("name", VARIANTS)
def test_library_checkpoint_matches_the_librarys_forward(saved, name):
    """Loaded from the library's directory: the training-time-test unroll (``ttt_step``,
    what training runs) and the inference path (a prefill over the features, then draft
    steps on the drafter's own output against its cache, as the draft tree runs them) give
    the library's hidden states and logits at every step."""
    model, d = saved[name]
    drafter = eagle3_jax.load_drafter(d)
    cfg = drafter.config
    assert cfg.layout == "speculators" and cfg.num_layers == VARIANTS[name].get("layers", 1)
    steps = 4
    feats, ids = inputs(VARIANTS[name])
    T = ids.shape[1]
    want_h, want_logits = library_steps(model, feats, ids, steps)

    # training-time test: our tokens at step s are the drafter's index t + 1 + s (the library's
    # t + s); both pad past the end, ours one position earlier: the last 1 + s positions of
    # step s are padding in ours, and not compared
    ours = jnp.asarray(np.concatenate([np.zeros((1, 1), ids.dtype), ids[:, :-1]], 1))
    h = drafter.fuse(jnp.asarray(feats))
    keys = values = ((),) * cfg.num_layers
    diffs = {"hidden": 0.0, "logits": 0.0}
    for s in range(steps):
        h, k, v = ttt_step(drafter, s, h, ours, keys, values)
        keys = tuple((*a, b) for a, b in zip(keys, k))
        values = tuple((*a, b) for a, b in zip(values, v))
        n = T - 1 - s
        diffs["hidden"] = max(diffs["hidden"], float(np.abs(np.asarray(h[0, :n]) - want_h[s, :n]).max()))
        diffs["logits"] = max(diffs["logits"],
                              float(np.abs(np.asarray(drafter.logits(h)[0, :n]) - want_logits[s, :n]).max()))
    assert diffs["hidden"] <= TOL and diffs["logits"] <= TOL, (name, "ttt", diffs)

    # inference: prefix [0, t] from the features, then the chain at index t (sliding layers:
    # within their window, where the cache holds no key the window would drop)
    window = VARIANTS[name].get("window")
    for t in ((T // 2, T - 1) if window is None else (2, window - steps)):
        out, cache = drafter(jnp.asarray(feats[:, :t + 1]), jnp.asarray(ids[:, :t + 1]), jnp.arange(t + 1)[None],
                             cache=drafter.init_cache(1, T + steps if window is None else window))
        cache = dataclasses.replace(cache, lengths=cache.lengths + t + 1)
        np.testing.assert_allclose(out[0], want_h[0, :t + 1], atol=TOL, rtol=0)
        np.testing.assert_allclose(drafter.logits(out)[0], want_logits[0, :t + 1], atol=TOL, rtol=0)
        hid, region = out[:, t:t + 1], None
        for s in range(1, steps):
            token = jnp.asarray([[ids[0, t + s] if t + s < T else 0]])
            mask = jnp.ones((1, 1, steps), bool)
            hid, (k, v) = drafter.step(hid, token, jnp.asarray([[t + s]]), cache=cache, region_mask_BxTxR=mask,
                                       region_kv=region)
            region = (k, v) if region is None else (jnp.concatenate([region[0], k], -3), jnp.concatenate([region[1], v], -3))
            np.testing.assert_allclose(hid[0, 0], want_h[s, t], atol=TOL, rtol=0, err_msg=f"{name} step {s} t {t}")
            np.testing.assert_allclose(drafter.logits(hid)[0, 0], want_logits[s, t], atol=TOL, rtol=0)
    print(f"{name}: max |diff| hidden {diffs['hidden']:.2e} logits {diffs['logits']:.2e}")


@pytest.mark.parametrize("name", VARIANTS)
def test_our_export_loads_in_the_library_with_identical_tensors(saved, name, tmp_path):
    model, d = saved[name]
    drafter = eagle3_jax.load_drafter(d)
    out = eagle3_jax.save_drafter(drafter, tmp_path / "out", format="speculators", verifier=builtin.TARGET_DIR)
    back = Eagle3DraftModel.from_pretrained(str(out)).float()
    want, got = model.state_dict(), back.state_dict()
    skip = ("verifier_lm_head.weight", "verifier_norm.weight")
    assert {k for k in want if k not in skip} == {k for k in got if k not in skip}
    for k in want:
        if k not in skip:
            assert torch.equal(want[k], got[k]), k
    # the configuration means the same drafter to both
    assert eagle3_jax.load_drafter(out).config == drafter.config
    # and our own file, read as the library wrote it, is the same tensors
    ours, theirs = load_file(out / "model.safetensors"), load_file(d / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(np.array_equal(ours[k], theirs[k]) for k in ours)


def test_convert_both_ways(saved, tmp_path):
    """``eagle3-jax convert``: the library's plain drafter to the official layout and back."""
    from eagle3_jax.cli import main as program

    model, d = saved["plain"]
    assert program(["convert", str(d), str(tmp_path / "official"), "--to", "official"]) == 0
    cfg = json.loads((tmp_path / "official" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and "speculators_model_type" not in cfg
    assert "midlayer.hidden_norm.weight" in load_file(tmp_path / "official" / "model.safetensors")
    assert program(["convert", str(tmp_path / "official"), str(tmp_path / "back"), "--to", "speculators",
                    "--target", str(builtin.TARGET_DIR)]) == 0
    back = Eagle3DraftModel.from_pretrained(str(tmp_path / "back")).float()
    for k, v in model.state_dict().items():
        if not k.startswith("verifier_"):
            assert torch.equal(v, back.state_dict()[k]), k
    # a variant the official layout cannot hold is refused by name
    with pytest.raises(ValueError, match="norm_output=True.*format='speculators'"):
        eagle3_jax.save_drafter(eagle3_jax.load_drafter(saved["norm_output"][1]), tmp_path / "x", format="official")


@pytest.fixture(scope="module")
def target():
    return eagle3_jax.load_target(builtin.TARGET_DIR, dtype="float32")


@pytest.mark.parametrize("name", [n for n in VARIANTS if n != "two_captured"] + ["two_captured"])
def test_every_variant_drafts_losslessly_on_the_builtin_target(target, saved, name, tmp_path):
    """Greedy output identical to vanilla decoding (a random drafter of each variant)."""
    variant = VARIANTS[name]
    d = saved[name][1]
    if "window" in variant:  # a window past the cache: sliding layers that see their whole context
        d = tmp_path / "wide"
        build(variant, window=512).save_pretrained(str(d))
    if "ids" in variant:
        t = eagle3_jax.load_target(builtin.TARGET_DIR, dtype="float32", capture_layers=variant["ids"])
    else:
        t = target
    drafter = eagle3_jax.load_drafter(d, target=t)
    prompts = [[1, 17, 30, 44, 52, 9], [1, 80, 81, 82]]
    vanilla = eagle3_jax.generate(t, None, prompts, max_new_tokens=24).tokens
    res = eagle3_jax.generate(t, drafter, prompts, max_new_tokens=24, tree=TreeConfig(12, 4, 3))
    assert res.tokens == vanilla
    if name in ("two_captured", "two_layers"):  # plain steps, then the drafter's catch-up over their features
        plain = eagle3_jax.generate(t, drafter, prompts, max_new_tokens=24, speculation=Speculation.fixed(None))
        assert plain.tokens == vanilla



def test_the_slot_engine_serves_a_multi_layer_drafter(target, saved):
    """The server's engine (``Slots``) with a three-layer Qwen3 drafter ("everything"): two
    requests in two slots get vanilla decoding's tokens."""
    drafter = eagle3_jax.load_drafter(saved["everything"][1], target=target)
    prompts = [[1, 17, 30, 44, 52, 9], [1, 80, 81, 82]]
    vanilla = eagle3_jax.generate(target, None, prompts, max_new_tokens=24).tokens
    slots = Slots(target, drafter, num_slots=2, max_len=96, speculation=TreeConfig(12, 4, 3))
    for s, p in enumerate(prompts):
        slots.insert(s, prompt_ids=p, max_new_tokens=24)
    views = slots.poll()
    while not all(v.done for v in views):
        slots.run(4)
        views = slots.poll()
    assert [v.tokens for v in views] == vanilla


# ---------------------------------------------------------------------------- refusals


def _edit(src, dst, config=None, drop=()):
    shutil.copytree(src, dst)
    if config:
        raw = json.loads((dst / "config.json").read_text())
        config(raw)
        (dst / "config.json").write_text(json.dumps(raw))
    if drop:
        tensors = {k: v for k, v in load_file(dst / "model.safetensors").items() if k not in drop}
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_refusals_name_the_key(saved, target, tmp_path):
    plain = saved["plain"][1]
    cases = [
        (dict(config=lambda c: c.update(speculators_model_type="mtp")), ["speculators_model_type", "MTP"]),
        (dict(config=lambda c: c.update(speculators_model_type="eagle")), ["speculators_model_type", "not an EAGLE-3"]),
        (dict(config=lambda c: c.update(norm_before_fc=True, fc_norm=True)), ["'norm_before_fc'", "'fc_norm'"]),
        (dict(drop=("d2t", "t2d")), ["'d2t'", "draft_vocab_size"]),
        (dict(config=lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2, 8])),
         ["eagle_aux_hidden_state_layer_ids", "fc.weight"]),
        (dict(config=lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2, 8, 16])),
         ["eagle_aux_hidden_state_layer_ids", "outside the target's 16 decoder layers"]),
        (dict(config=lambda c: c["transformer_layer_config"].update(model_type="mistral")),
         ["transformer_layer_config.model_type"]),
    ]
    for i, (edit, words) in enumerate(cases):
        d = _edit(plain, tmp_path / str(i), **edit)
        with pytest.raises(ValueError) as e:
            eagle3_jax.load_drafter(d, target=target)
        assert all(w in str(e.value) for w in words), (words, str(e.value))
        assert str(d) in str(e.value)


def test_eagle1_and_mtp_checkpoints_are_refused(tmp_path):
    """Official-style directories of other heads: an EAGLE-1/2 drafter (``fc`` over
    ``[embedding ; feature]``, no ``hidden_norm``), by its architectures or by its weights,
    and an MTP head."""
    rng = np.random.default_rng(0)
    base = {"model_type": "llama", "hidden_size": H, "intermediate_size": I, "num_attention_heads": HEADS,
            "num_key_value_heads": KV, "head_dim": D, "vocab_size": VOCAB, "rms_norm_eps": EPS, "num_hidden_layers": 1}
    tensors = {"fc.weight": rng.normal(size=(H, 2 * H)).astype(np.float32),
               "layers.0.self_attn.q_proj.weight": rng.normal(size=(H, H)).astype(np.float32),
               "embed_tokens.weight": rng.normal(size=(VOCAB, H)).astype(np.float32)}
    cases = [({"architectures": ["EagleLlamaForCausalLM"]}, ["'architectures'", "EAGLE-1/EAGLE-2"]),
             ({"architectures": ["LlamaForCausalLM"]}, ["'fc.weight'", "EAGLE-1/EAGLE-2"]),
             ({"architectures": ["DeepseekV3ForCausalLM"], "num_nextn_predict_layers": 1},
              ["'num_nextn_predict_layers'", "MTP"])]
    for i, (extra, words) in enumerate(cases):
        d = tmp_path / str(i)
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**base, **extra}))
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ValueError) as e:
            eagle3_jax.load_drafter(d)
        assert all(w in str(e.value) for w in words), (words, str(e.value))


def test_sliding_window_past_the_cache_is_refused(saved):
    drafter = eagle3_jax.load_drafter(saved["sliding"][1])
    assert drafter.config.layer_types == ("full_attention", "sliding_attention") and drafter.config.sliding_window == 8
    with pytest.raises(ValueError, match="sliding_window=8"):
        drafter.init_cache(1, 9)


def test_the_official_drafter_is_unchanged_by_the_variants():
    """The default configuration is the official drafter: its declaration is exactly the
    official state dict, and its layout is the official one."""
    from eagle3_jax.models.drafter import declare

    cfg = DrafterConfig(vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB, hidden_size=H, intermediate_size=I,
                        num_heads=HEADS, num_kv_heads=KV, head_dim=D, rms_norm_eps=EPS,
                        rope=eagle3_jax.RopeConfig(), target_hidden_size=H)
    assert cfg.is_official and cfg.layout == "official"
    names = sorted(p.checkpoint for _, p in declare(cfg).present())
    m = "midlayer."
    assert names == sorted(["fc.weight", m + "hidden_norm.weight", m + "input_layernorm.weight",
                            m + "post_attention_layernorm.weight", *(m + f"self_attn.{x}_proj.weight" for x in "qkvo"),
                            *(m + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")), "norm.weight",
                            "lm_head.weight", "embed_tokens.weight"])


def test_the_pipeline_trains_each_variant_and_exports_it_for_the_library(target, tmp_path):
    """The training config's drafter section takes the layer count, family and switches; a
    fresh drafter of them trains (finite loss and gradients through every layer and norm,
    the TTT unroll feeding its own output back) and exports in the speculators layout, which
    the library loads."""
    import jax
    from flax import nnx

    from eagle3_jax.train import pipeline
    from eagle3_jax.train.ttt import ttt_loss

    path = tmp_path / "c.yaml"
    path.write_text("target: t\ndata: d.jsonl\nwork_dir: w\ndraft_vocab_size: 512\n")
    cfg = pipeline.load_config(path, ["drafter.num_layers=2", "drafter.layer_family=qwen3", "drafter.fc_norm=true",
                                      "drafter.norm_output=true", "drafter.norm_before_residual=true"])
    with pytest.raises(ValueError, match="drafter.layer_family"):
        pipeline.load_config(path, ["drafter.layer_family=mistral"])
    ids = np.sort(np.random.default_rng(0).choice(VOCAB, DRAFT_VOCAB, replace=False))
    drafter = pipeline.new_drafter(target, ids - np.arange(DRAFT_VOCAB), draft_vocab_size=512,
                                   **pipeline.drafter_options(cfg))
    dc = drafter.config
    assert (dc.num_layers, dc.layer_family, dc.fc_norm, dc.norm_output, dc.layout) == (2, "qwen3", True, True, "speculators")
    rng = np.random.default_rng(1)
    B, T = 2, 16
    tokens = jnp.asarray(rng.integers(0, VOCAB, (B, T)))
    hidden, feats, _ = target.trunk(tokens, jnp.broadcast_to(jnp.arange(T), (B, T)))
    graph, params, rest = nnx.split(drafter, nnx.Param, ...)

    def loss(p):
        return ttt_loss(nnx.merge(graph, p, rest), feats, tokens, hidden, target.lm_head[...], jnp.ones((B, T)),
                        length=3, chunk=8)[0]

    value, grads = jax.value_and_grad(loss)(params)
    assert np.isfinite(float(value))
    for name in ("rest_wq", "rest_q_norm", "fc_norms", "q_norm", "hidden_norm", "norm"):
        g = jax.tree.leaves(grads[name])[0]
        assert np.isfinite(np.asarray(g)).all() and np.abs(np.asarray(g)).max() > 0, name
    out = eagle3_jax.save_drafter(drafter, tmp_path / "export", verifier=builtin.TARGET_DIR)
    assert json.loads((out / "config.json").read_text())["speculators_model_type"] == "eagle3"
    back = Eagle3DraftModel.from_pretrained(str(out)).float()
    assert back.config.norm_output and back.config.fc_norm and len(back.layers) == 2
    np.testing.assert_array_equal(back.state_dict()["layers.1.self_attn.q_norm.weight"].numpy(),
                                  np.asarray(drafter.rest_q_norm[...][0]))
