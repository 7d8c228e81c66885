"""The training pipeline's config (``eagle3-jax train STEP --config FILE [key=value ...]``):
:class:`PipelineConfig`, one frozen dataclass a YAML section (``regenerate``, ``drafter``,
``fit``, ``mesh``), read by :func:`load_config` through the project's one config loader
(:mod:`eagle3_jax.configfile`): every value typed by its field, ranges from
:mod:`eagle3_jax.limits`, unknown keys refused with the closest known ones.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import ClassVar

from eagle3_jax import configfile, limits
from eagle3_jax.config import DrafterConfig
from eagle3_jax.train.trainer import FitConfig


@dataclasses.dataclass(frozen=True)
class RegenerateConfig:
    """The target's own answers to the conversations' prompts (``enabled: false``: the data's)."""

    enabled: bool = True
    max_new_tokens: int = 512
    temperature: float = 0.0
    batch_size: int = 8
    tensor: int = 1  # tensor-parallel size over each process's devices (the rest split the batch)

    LIMITS: ClassVar[dict] = {"max_new_tokens": limits.MAX_NEW_TOKENS, "temperature": limits.TEMPERATURE,
                              "batch_size": limits.POSITIVE, "tensor": limits.POSITIVE}


# a fresh drafter's shape options: DrafterConfig's own fields, with its types and defaults
# (declared once, there)
DRAFTER_SHAPE = ("num_layers", "layer_family", "norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


def _drafter_section() -> type:
    """The ``drafter`` section's dataclass: ``init`` and ``seed``, then :data:`DRAFTER_SHAPE`
    as :class:`eagle3_jax.config.DrafterConfig` declares them."""
    hints = typing.get_type_hints(DrafterConfig)
    defaults = {f.name: f.default for f in dataclasses.fields(DrafterConfig)}

    def options(self) -> dict:
        """The shape options as :meth:`eagle3_jax.config.DrafterConfig.for_target` keywords."""
        return {name: getattr(self, name) for name in DRAFTER_SHAPE}

    fields = [("init", str | None, configfile.path()),  # a saved drafter to start from
              ("seed", int, dataclasses.field(default=0)),
              *[(name, hints[name], dataclasses.field(default=defaults[name])) for name in DRAFTER_SHAPE]]
    doc = """A fresh drafter's shape (ignored with ``init``): decoder layers, their family (llama, or
    qwen3 with q/k norms) and speculators' switches; anything but the official one-layer Llama
    drafter is exported in the speculators layout."""
    limits_ = {"seed": limits.NON_NEGATIVE, "num_layers": limits.POSITIVE, "layer_family": limits.DRAFTER_FAMILY}
    return dataclasses.make_dataclass("DrafterSection", fields, frozen=True, namespace={
        "__doc__": doc, "__module__": __name__, "__qualname__": "DrafterSection", "options": options,
        "LIMITS": limits_})


DrafterSection = _drafter_section()


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """The fit's device mesh (``data: -1``: all the devices the other axes leave)."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1

    LIMITS: ClassVar[dict] = {"data": limits.MESH_DATA, "fsdp": limits.POSITIVE, "tensor": limits.POSITIVE}

    def __post_init__(self):
        if self.data == 0:
            raise ValueError(f"mesh.data={self.data!r}: must be -1 (all devices) or >= 1")

    def sizes(self) -> dict:
        """``{"data": ..., "fsdp": ..., "tensor": ...}``: :func:`eagle3_jax.sharding.make_mesh`'s keywords."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """The whole config of ``eagle3-jax train`` (see docs/training.md)."""

    target: str | None = configfile.path()  # Hugging Face target directory
    tokenizer: str | None = configfile.path()  # defaults to the target directory
    data: str | None = configfile.path()  # ShareGPT JSON / JSONL
    work_dir: str | None = configfile.path()
    seq_len: int = 2048
    last_turn_only: bool = False
    draft_vocab_size: int = 32000
    dtype: str = "float32"  # target weights
    distributed: bool = False  # jax.distributed.initialize() (multi-host pods)
    regenerate: RegenerateConfig = RegenerateConfig()
    drafter: DrafterSection = DrafterSection()
    fit: FitConfig = FitConfig()  # checks its own ranges (eagle3_jax.train.trainer.FIT_LIMITS)
    mesh: MeshConfig = MeshConfig()
    topology: str = ""  # the TPU slice the config is meant for, e.g. v6e:2x4 (plan --topology's default)
    export_dir: str | None = configfile.path()  # default: work_dir/export

    LIMITS: ClassVar[dict] = {"seq_len": limits.MAX_LEN, "draft_vocab_size": limits.POSITIVE, "dtype": limits.DTYPE}


def load_config(path: str | Path, overrides=()) -> PipelineConfig:
    """YAML config ``path`` over the defaults, then ``a.b=value`` overrides; every value read
    as its field's type and range-checked.  Raises ``ValueError`` naming the key (unknown keys
    with the closest known ones) and where it came from."""
    return configfile.load(PipelineConfig, path, overrides)
