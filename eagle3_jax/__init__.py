"""eagle3-jax: EAGLE-3 speculative decoding on JAX."""
from eagle3_jax.checkpoint import load_target
