"""eagle3_jax.limits: one table of ranges and one checker, worded ``name=value: problem``, that
the API, the CLI, the server and the configs all check their numbers with."""

import numpy as np
import pytest

from eagle3_jax import limits
from eagle3_jax.limits import Range, check


@pytest.mark.parametrize("value, rng, error, message", [
    (0, limits.MAX_NEW_TOKENS, ValueError, "max_new_tokens=0: must be >= 1"),
    (8.0, limits.MAX_NEW_TOKENS, TypeError, "max_new_tokens=8.0: expected an integer"),
    (True, limits.MAX_NEW_TOKENS, TypeError, "max_new_tokens=True: expected an integer"),
    (2 ** 32, limits.SEED, ValueError, "max_new_tokens=4294967296: must be >= 0 and < 4294967296"),
    (0, limits.TOP_P, ValueError, "max_new_tokens=0.0: must be > 0 and <= 1"),
    (float("nan"), limits.TEMPERATURE, ValueError, "max_new_tokens=nan: expected a finite number"),
    ("0.5", limits.TEMPERATURE, TypeError, "max_new_tokens='0.5': expected a finite number"),
    ("int8", limits.DTYPE, ValueError, "max_new_tokens='int8': expected one of float32, bfloat16, float16"),
    ([32, 0], Range(tuple, lo=1), ValueError, "max_new_tokens=(32, 0): must be >= 1 (each item)"),
    ([32, "x"], Range(tuple, lo=1), TypeError, "max_new_tokens=[32, 'x']: expected a list of integers"),
    (5, limits.TOKEN_ID.below(5), ValueError, "max_new_tokens=5: must be >= 0 and < 5"),
])
def test_check_names_the_value_and_says_why(value, rng, error, message):
    with pytest.raises(error) as e:
        check("max_new_tokens", value, rng)
    assert str(e.value) == message


def test_check_returns_the_value_as_its_kind():
    assert type(check("n", np.int32(3), limits.POSITIVE)) is int
    assert type(check("x", np.array(2.5), limits.TEMPERATURE)) is float
    assert type(check("x", 1, limits.TOP_P)) is float
    assert check("b", [8, np.int64(16)], Range(tuple, lo=1)) == (8, 16)
    assert check("flag", np.bool_(True), Range(bool)) is True


def test_the_front_doors_share_the_table(capsys):
    """generate, the CLI, the server's request model and the configs refuse a value by the same range."""
    from eagle3_jax.cli import main
    from eagle3_jax.serve.schemas import ChatRequest
    from eagle3_jax.train.trainer import FIT_LIMITS, FitConfig

    for field, rng in (("seed", limits.SEED), ("top_p", limits.TOP_P), ("max_tokens", limits.MAX_NEW_TOKENS),
                       ("thinking_budget", limits.THINKING_BUDGET)):
        got = {k: getattr(m, k) for m in ChatRequest.model_fields[field].metadata for k in ("ge", "gt", "le", "lt")
               if hasattr(m, k)}
        assert got == rng.pydantic(), field
    assert main(["generate", "--prompt-ids", "1", "--seed", str(2 ** 32)]) == 2
    assert "--seed: must be >= 0 and < 4294967296, got 4294967296" in capsys.readouterr().err
    assert FIT_LIMITS["compute_dtype"] is limits.DTYPE
    with pytest.raises(ValueError, match=r"^fit\.lr=0\.0: must be > 0$"):
        FitConfig(lr=0)
