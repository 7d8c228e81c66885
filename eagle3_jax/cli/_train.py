"""The ``train`` command: a step of :mod:`eagle3_jax.train.pipeline` on a YAML config
(the ``train`` extra loads when it runs)."""

from __future__ import annotations


def cmd_train(args) -> int:
    """``eagle3-jax train STEP``: one step of the training pipeline (or ``all``) on the
    ``--config`` with its ``key=value`` overrides."""
    from eagle3_jax.train import pipeline  # the train extra (orbax, grain)

    cfg = pipeline.load_config(args.config, args.overrides)
    pipeline.run(args.step, cfg, resume=not args.no_resume)
    return 0
