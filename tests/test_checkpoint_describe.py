"""A checkpoint directory described (``eagle3_jax.checkpoint.describe``, ``eagle3-jax info``)."""

import json

from helpers import FIXTURES


def test_info_cli_describes_both(capsys):
    from eagle3_jax.cli import main

    assert main(["info", str(FIXTURES / "drafter_tiny"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kind"] == "EAGLE-3 drafter" and info["draft_vocab_size"] == 256 and info["fc_in_features"] == 384
    assert info["rope"]["theta"] == 10000.0
    assert main(["info", str(FIXTURES / "target_tiny"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kind"] == "target" and info["capture_layers"] == [2, 4, 5] and info["layers"] == 8
