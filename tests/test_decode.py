"""Decoding (``eagle3_jax.decode``): ``generate`` against the official EAGLE-3 (golden greedy
outputs and acceptance), lossless (greedy token identity with vanilla decoding, the sampled
distribution by χ²), phases and early stops, on a simulated mesh, and through the CLI.  The
loop's compiled HLO: test_decode_loop.py; request validation: test_decode_request.py; the
cache of compiled programs: test_decode_programs.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import eagle3_jax
from eagle3_jax import decode, verify as verify_mod
from eagle3_jax.tree import TreeConfig
from helpers import FIXTURES, chi2_pvalue, golden_drafters, oracle_drafter

ROOT = Path(__file__).parent.parent


@pytest.fixture(scope="module")
def target():
    return eagle3_jax.load_target(FIXTURES / "target_tiny")


@pytest.fixture(scope="module")
def drafters(target):
    return golden_drafters(target)


@pytest.fixture(scope="module")
def pair(target, drafters):
    """The tiny target and its trained drafter."""
    return target, drafters["drafter_tiny_trained"]



@pytest.mark.parametrize("fname,dname", [("eagenerate_greedy.npz", "drafter_tiny"),
                                         ("eagenerate_greedy_trained.npz", "drafter_tiny_trained")])
def test_greedy_generation_matches_official(target, drafters, fname, dname):
    gold = np.load(FIXTURES / fname)
    prompts = [gold[f"p{i}_prompt"].tolist() for i in range(5)]
    res = eagle3_jax.generate(target, drafters[dname], prompts, max_new_tokens=64)
    for i, p in enumerate(prompts):
        official = gold[f"p{i}_ea_output_ids"][len(p):]
        assert res.tokens[i] == official[:64].tolist()
        ours, theirs = np.array(res.stats["accept_lengths"][i]), gold[f"p{i}_round_accept_length"]
        n = min(len(ours), len(theirs))
        assert n >= len(theirs) - 3
        np.testing.assert_array_equal(ours[:n], theirs[:n])
    if dname == "drafter_tiny_trained":
        assert res.stats["tau"] > 2.0


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1024, size=int(L)).tolist() for L in rng.integers(4, 30, size=n)]


@pytest.mark.parametrize("tree", [TreeConfig(60, 7, 10), TreeConfig(16, 4, 4), TreeConfig(8, 3, 2), TreeConfig.chain(4)])
def test_oracle_drafter_is_lossless_batch4(target, tree):
    prompts = _prompts(4, seed=1)
    oracle, vanilla = oracle_drafter(target, prompts, 40)
    res = eagle3_jax.generate(target, oracle, prompts, max_new_tokens=40, tree=tree)
    assert res.tokens == vanilla
    assert max(max(a) for a in res.stats["accept_lengths"]) == min(tree.path_len - 1, tree.depth + 1)
    assert res.stats["tau"] > 2.5


@pytest.mark.parametrize("tree,batch", [(TreeConfig(60, 7, 10), 1), (TreeConfig(8, 3, 2), 4)])
def test_random_drafter_is_lossless(target, drafters, tree, batch):
    prompts = _prompts(batch, seed=2)
    vanilla = eagle3_jax.generate(target, None, prompts, max_new_tokens=48).tokens
    res = eagle3_jax.generate(target, drafters["drafter_tiny"], prompts, max_new_tokens=48, tree=tree)
    assert res.tokens == vanilla


def test_early_stops_are_identical(target):
    prompts = _prompts(4, seed=3)
    oracle, vanilla = oracle_drafter(target, prompts, 40)
    stop = vanilla[1][17]  # a token in the middle of a sequence: stops it mid-round
    want = eagle3_jax.generate(target, None, prompts, max_new_tokens=37, stop_token_ids=[stop]).tokens
    got = eagle3_jax.generate(target, oracle, prompts, max_new_tokens=37, stop_token_ids=[stop], tree=TreeConfig(16, 4, 4))
    assert got.tokens == want
    assert want[1][-1] == stop and len(want[1]) <= 18
    assert all(len(t) == 37 or t[-1] == stop for t in got.tokens)
    assert got.stats["new_tokens"] == sum(map(len, want))


def test_phases_leave_every_row_as_one_loop_over_the_batch(target, drafters):
    """A batch of 8 whose answers end at different times decodes in phases of 8, 4 and 2 rows
    (the rows still decoding gathered into fewer): every row's tokens and round records are
    those of one loop over the whole batch (vanilla greedy; speculative sampled, each row's key
    travelling with it)."""
    prompts = _prompts(8, seed=4)
    vanilla = eagle3_jax.generate(target, None, prompts, max_new_tokens=64).tokens
    long_rows = set(vanilla[6]) | set(vanilla[7])  # rows 0-5 stop early (each at a token of its own), 6 and 7 do not
    stops = sorted({next(t for t in vanilla[r][3 + 6 * r:] if t not in long_rows) for r in range(6)})
    assert decode.phase_rows(8, 64) == (8, 4, 2)
    runs = [(None, 0.0), (drafters["drafter_tiny_trained"], 0.8)]

    def results(phases=True):
        decode.clear_compiled()
        return [eagle3_jax.generate(target, d, prompts, max_new_tokens=64, stop_token_ids=stops, temperature=t, seed=3,
                                    tree=TreeConfig(8, 3, 2), phases=phases) for d, t in runs]

    phased = results()
    lengths = sorted(map(len, phased[0].tokens))
    assert lengths[-2:] == [64, 64] and lengths[5] < 40  # two rows decode alone for 24+ steps
    one_loop = decode.prepare(target, None, prompts, max_new_tokens=64, temperature=0.0, top_p=1.0, top_k=0,
                              tree=TreeConfig(8, 3, 2), seed=3, stop_token_ids=stops, tokenizer=None, phases=False)
    assert one_loop.statics.phases == (8,)
    for got, want in zip(phased, results(phases=False)):
        assert got.tokens == want.tokens
        assert got.stats["accept_lengths"] == want.stats["accept_lengths"]
    assert phased[0].tokens == [v[:len(t)] for v, t in zip(vanilla, phased[0].tokens)]


# ------------------------------------------------------------------ sampling is lossless
def _sampling_run(target, drafter, prompt, n, seed):
    res = eagle3_jax.generate(target, drafter, [prompt] * n, max_new_tokens=3, temperature=0.8, top_p=0.95,
                              seed=seed, tree=TreeConfig(16, 4, 4))
    return np.array(res.tokens), res


@pytest.fixture(scope="module")
def vanilla_samples(target):
    """2000 vanilla samples of the golden prompt: the target's own distribution."""
    prompt = np.load(FIXTURES / "eagenerate_greedy_trained.npz")["p0_prompt"].tolist()
    return prompt, _sampling_run(target, None, prompt, 2000, seed=2)[0]


def test_sampling_matches_target_distribution(target, drafters, vanilla_samples):
    prompt, base = vanilla_samples
    spec, res = _sampling_run(target, drafters["drafter_tiny_trained"], prompt, 2000, seed=1)
    assert res.stats["accepted"] > 400  # the drafter's proposals are actually being accepted
    for pos in (1, 2):  # tokens produced by tree verification
        bins = np.unique(np.concatenate([spec[:, pos], base[:, pos]]), return_counts=True)
        top = bins[0][np.argsort(-bins[1])[:12]]
        assert chi2_pvalue(spec[:, pos], base[:, pos], top) > 1e-3


def test_biased_acceptance_is_detected(target, drafters, vanilla_samples, monkeypatch):
    """The same test fails when acceptance is deliberately biased (accept with 3·p)."""
    prompt, base = vanilla_samples
    monkeypatch.setattr(verify_mod, "_accepts", lambda u, remaining, p: u * remaining < 3 * p)
    jax.clear_caches()
    decode.PROGRAMS.clear()
    spec, _ = _sampling_run(target, drafters["drafter_tiny_trained"], prompt, 2000, seed=1)
    pvals = []
    for pos in (1, 2):
        bins = np.unique(np.concatenate([spec[:, pos], base[:, pos]]), return_counts=True)
        pvals.append(chi2_pvalue(spec[:, pos], base[:, pos], bins[0][np.argsort(-bins[1])[:12]]))
    monkeypatch.undo()
    jax.clear_caches()
    decode.PROGRAMS.clear()
    assert min(pvals) < 1e-3



def test_generate_on_meshes_equals_one_device():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "mesh_decode.py"), "--quick"], capture_output=True,
                         text=True, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    lines = [line for line in res.stdout.splitlines() if "tokens identical" in line and not line.startswith("phases")]
    assert len(lines) == 4, res.stdout
    assert lines[3].startswith("tiny-2l  tree8,2,3 {'data': 2, 'tensor': 4}"), res.stdout  # a two-layer drafter
    assert "-> (8, 2, 60, 1, 16) per device" in lines[0]  # data=2, tensor=4: batch and KV heads split
    assert "-> (8, 1, 60, 4, 16) per device" in lines[2]  # data=8: one row per device
    assert any(line.startswith("phases (8, 4, 2)") and "tokens identical" in line for line in res.stdout.splitlines()), \
        res.stdout


def test_cli_generate_prints_tokens_and_tau(capsys):
    from eagle3_jax.cli import main

    gold = np.load(FIXTURES / "eagenerate_greedy_trained.npz")
    ids = ",".join(map(str, gold["p0_prompt"]))
    assert main(["generate", "--target", str(FIXTURES / "target_tiny"), "--drafter", str(FIXTURES / "drafter_tiny_trained"),
                 "--prompt-ids", ids, "--max-new-tokens", "16", "--tree", "16,4,4", "--attention", "pallas"]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0].split()
    assert [int(x) for x in first] == gold["p0_ea_output_ids"][len(gold["p0_prompt"]):][:16].tolist()
    assert "tau" in out and "tok/s" in out
