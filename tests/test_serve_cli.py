"""The ``eagle3-jax serve`` and ``replay`` commands (``eagle3_jax.cli._serve``): their
argument errors, one line each, and a busy port refused before any model loads."""

from __future__ import annotations

import socket

import pytest

from eagle3_jax import cli


@pytest.mark.parametrize("argv,needle", [
    (["serve", "--speculation", "wide"], "--speculation"),
    (["serve", "--port", "70000"], "--port"),
    (["serve", "--max-batch", "0"], "--max-batch"),
    (["serve", "--reasoning-effort-budgets", "1", "2"], "--reasoning-effort-budgets"),
    (["replay", "--requests", "4"], "--rate"),
    (["replay", "--rate", "0"], "--rate"),
    (["replay", "--rate", "2", "--json", "x.json", "--figure", "x.json"], "--json"),
    (["replay", "--rate", "2", "--target", "somewhere"], "--drafter"),
])
def test_serve_and_replay_arguments(argv, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1, err


def test_serve_refuses_a_busy_port_before_loading(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert cli.main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"--port {port}" in err and "cannot listen" in err
