"""Checkpoint I/O: Hugging Face safetensors targets, official / SpecForge / vLLM
EAGLE-3 drafters (``pytorch_model.bin`` read without torch, or safetensors) and vLLM
``speculators`` drafters with their variants, and drafter export in the official or the
speculators layout.

Names, shapes and layouts come from the models' parameter declarations (``declare(cfg)``).
Tensors are read one at a time straight onto the device; with a mesh (or shardings) each
parameter is assembled from per-device blocks read from the files.  PyTorch ``Linear``
weights ``[out, in]`` become Flax ``[in, out]``.

The package, by role:

- ``formats``: the weight dtypes, the finite-values check, drafter-or-target configs;
- ``torch_reader``: ``pytorch_model.bin`` read without torch, as untrusted input;
- ``sources``: safetensors files and shard sets; ``open_weights`` picks a directory's reader;
- ``fetch``: tensors checked and fetched, whole or as per-device blocks on a mesh;
- ``load``: ``load_target`` and ``load_drafter``;
- ``save``: ``save_target`` and ``save_drafter``, written whole through
  :func:`eagle3_jax.atomic.write_directory`.
- ``describe``: ``describe_checkpoint``, a directory described for ``eagle3-jax info``.
"""

from eagle3_jax.atomic import check_output_path
from eagle3_jax.checkpoint.describe import describe_checkpoint
from eagle3_jax.checkpoint.formats import DTYPES, is_drafter_config, resolve_dtype
from eagle3_jax.checkpoint.load import load_drafter, load_target
from eagle3_jax.checkpoint.save import save_drafter, save_target
from eagle3_jax.checkpoint.sources import MAX_INDEX_BYTES, SafetensorsSource, open_weights
from eagle3_jax.checkpoint.torch_reader import INFLATION_SLACK, MAX_INFLATION, MAX_PICKLE_BYTES, TorchPickleSource

__all__ = [
    "DTYPES", "INFLATION_SLACK", "MAX_INDEX_BYTES", "MAX_INFLATION", "MAX_PICKLE_BYTES", "SafetensorsSource",
    "TorchPickleSource", "check_output_path", "describe_checkpoint", "is_drafter_config", "load_drafter",
    "load_target", "open_weights", "resolve_dtype", "save_drafter", "save_target",
]
