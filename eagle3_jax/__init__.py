"""eagle3-jax: EAGLE-3 speculative decoding on JAX.

Public API::

    target = eagle3_jax.load_target("path/to/hf_model")
    logits, features = target.features(input_ids)
    drafter = eagle3_jax.load_drafter("path/to/eagle3", target=target)
    out = eagle3_jax.generate(target, drafter, prompts, max_new_tokens=128)
"""

from eagle3_jax.checkpoint import load_drafter, load_target, save_drafter, save_target
from eagle3_jax.config import DrafterConfig, RopeConfig, TargetConfig
from eagle3_jax.decode import GenerateResult, generate
from eagle3_jax.models.drafter import Drafter
from eagle3_jax.models.target import Target
from eagle3_jax.speculation import Speculation
from eagle3_jax.tree import TreeConfig
from eagle3_jax.verify import SamplingConfig
from eagle3_jax.vocab import build_vocab_map

__all__ = [
    "Drafter", "DrafterConfig", "GenerateResult", "RopeConfig", "SamplingConfig", "Speculation", "Target",
    "TargetConfig",
    "TreeConfig", "build_vocab_map", "generate", "load_drafter", "load_target", "save_drafter",
    "save_target",
]
