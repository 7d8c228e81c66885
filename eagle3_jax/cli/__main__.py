"""``python -m eagle3_jax.cli``: the ``eagle3-jax`` program."""

import sys

from eagle3_jax.cli import program

sys.exit(program())
