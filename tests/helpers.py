"""Test helpers: tiny Hugging Face models built offline from configs (torch is the reference)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).parent / "fixtures"

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

