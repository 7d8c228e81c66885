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
