"""Training: sharded step equals the single-device step, kill-and-resume is exact."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np

import eagle3_jax
from helpers import FIXTURES
from eagle3_jax.train.trainer import FitConfig, Trainer

ROOT = Path(__file__).parent.parent


def _records(n=24, T=20, seed=0):
    rng = np.random.default_rng(seed)
    return {"input_ids": rng.integers(0, 1024, (n, T)).astype(np.int32), "loss_mask": rng.random((n, T)) < 0.9}


def test_mesh_step_equals_single_device(tmp_path):
    script = textwrap.dedent(f"""
        import dataclasses, sys, numpy as np, jax
        sys.path.insert(0, {str(ROOT / 'tests')!r})
        import eagle3_jax
        from eagle3_jax.sharding import make_mesh
        from eagle3_jax.train.trainer import FitConfig, Trainer
        from test_train import _records
        from helpers import FIXTURES
        assert len(jax.devices()) == 8
        target = eagle3_jax.load_target(FIXTURES / "target_tiny")
        cfg = FitConfig(steps=2, batch_size=8, lr=1e-3, warmup_steps=1, ttt_length=3)
        out = {{}}
        # the 8-device mesh as jax.make_mesh makes it (Explicit axes by default), which the trainer takes as Auto
        explicit = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Explicit,) * 3)
        # "micro": two micro-batches of 4 rows, each split over the mesh's 4 batch shards
        for name, mesh, micro in (("single", make_mesh(1, 1, 1, devices=jax.devices()[:1]), 1), ("mesh", explicit, 1),
                                  ("micro", explicit, 2)):
            drafter = eagle3_jax.load_drafter(FIXTURES / "drafter_tiny", target=target)
            tr = Trainer(target, drafter, _records(), dataclasses.replace(cfg, micro_batches=micro),
                         work_dir={str(tmp_path)!r} + "/" + name, mesh=mesh)
            losses = [float(tr.train_step(next(tr.data_iter))["loss"]) for _ in range(2)]
            if name != "single":
                assert len(tr.params["wq"][...].sharding.device_set) > 1  # really sharded
            out[name] = (losses, jax.device_get(tr.params))
        for name in ("mesh", "micro"):
            np.testing.assert_allclose(out["single"][0], out[name][0], rtol=1e-5)
            for a, b in zip(jax.tree.leaves(out["single"][1]), jax.tree.leaves(out[name][1])):
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)  # Adam amplifies reduction-order noise on ~0 grads
        try:  # a micro-batch of 2 rows cannot split over 4 batch shards
            Trainer(target, eagle3_jax.load_drafter(FIXTURES / "drafter_tiny", target=target), _records(),
                    dataclasses.replace(cfg, micro_batches=4),
                    work_dir={str(tmp_path)!r} + "/refused", mesh=explicit)
            raise AssertionError("not refused")
        except ValueError as e:
            assert "fit.micro_batches=4" in str(e), e
        print("ok", out["mesh"][0])
    """)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "ok" in res.stdout


def test_kill_and_resume_is_exact(tmp_path):
    target = eagle3_jax.load_target(FIXTURES / "target_tiny")
    cfg = FitConfig(steps=6, batch_size=4, lr=1e-3, warmup_steps=2, ttt_length=2, save_every=2)

    def trainer(name):
        drafter = eagle3_jax.load_drafter(FIXTURES / "drafter_tiny", target=target)
        return Trainer(target, drafter, _records(), cfg, work_dir=tmp_path / name)

    straight = trainer("straight")
    straight.fit()
    first = trainer("resumed")
    first.fit(steps=4)  # "killed" after step 4: a new trainer picks up from the checkpoint
    second = trainer("resumed")
    second.fit(resume=True)
    assert second.step == straight.step == 6
    for a, b in zip(jax.tree.leaves(jax.device_get(straight.params)), jax.tree.leaves(jax.device_get(second.params))):
        np.testing.assert_array_equal(a, b)
    assert next(straight.data_iter)["input_ids"].tolist() == next(second.data_iter)["input_ids"].tolist()
    assert (tmp_path / "straight" / "best" / "model.safetensors").exists()
    eagle3_jax.load_drafter(tmp_path / "straight" / "best", target=target)


def test_end_to_end_pipeline(tmp_path):
    """prepare → regenerate → vocab → fit → export on the golden target with a BPE tokenizer
    built here; the exported drafter is official-format and beats an untrained one."""
    import json

    from safetensors.numpy import load_file

    from eagle3_jax.cli import main
    from eagle3_jax.train import pipeline
    from eagle3_jax.train.tiny import arithmetic_conversations, arithmetic_corpus, build_tokenizer, held_out_taus

    tok = build_tokenizer(tmp_path / "tok", arithmetic_corpus(), vocab_size=1024)
    assert len(tok) == 1024
    with open(tmp_path / "conv.jsonl", "w") as f:
        for c in arithmetic_conversations(160, seed=0):
            f.write(json.dumps(c) + "\n")
    overrides = [f"tokenizer={tmp_path / 'tok'}", f"data={tmp_path / 'conv.jsonl'}", f"work_dir={tmp_path / 'run'}",
                 f"target={FIXTURES / 'target_tiny'}", "seq_len=64", "regenerate.max_new_tokens=32",
                 "fit.steps=200", "fit.ttt_length=3", "fit.save_every=50", "fit.lr=0.003"]
    assert main(["train", "all", "--config", str(ROOT / "configs" / "tiny.yaml"), *overrides]) == 0

    export = tmp_path / "run" / "export"
    tensors = load_file(export / "model.safetensors")
    assert tensors["d2t"].dtype == np.int64 and tensors["t2d"].dtype == bool and "embed_tokens.weight" not in tensors
    assert tensors["fc.weight"].shape == (128, 384) and tensors["lm_head.weight"].shape == (256, 128)
    cfg = json.loads((export / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 256
    metrics = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {"loss", "acc_0", "acc_2", "sim_accept_len", "tokens_per_second"} <= set(metrics[-1])

    target = eagle3_jax.load_target(FIXTURES / "target_tiny")
    trained = eagle3_jax.load_drafter(export, target=target)
    untrained = pipeline.new_drafter(target, np.load(tmp_path / "run" / "vocab.npz")["d2t"], draft_vocab_size=256)
    taus = held_out_taus(target, {"trained": trained, "untrained": untrained}, tok, prompts=12, max_new_tokens=32,
                         trees=(eagle3_jax.TreeConfig(16, 4, 4),))
    assert taus["trained 16,4,4"]["tau"] > taus["untrained 16,4,4"]["tau"] + 0.1, taus


def test_offline_cache_trains_like_online(tmp_path):
    target = eagle3_jax.load_target(FIXTURES / "target_tiny")
    losses = {}
    for offline in (False, True):
        cfg = FitConfig(steps=3, batch_size=4, lr=1e-3, warmup_steps=1, ttt_length=2, offline=offline)
        drafter = eagle3_jax.load_drafter(FIXTURES / "drafter_tiny", target=target)
        tr = Trainer(target, drafter, _records(), cfg, work_dir=tmp_path / str(offline))
        losses[offline] = [float(tr.train_step(next(tr.data_iter))["loss"]) for _ in range(3)]
    assert (tmp_path / "True" / "offline" / "features.npy").exists()
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-5)
    # and what offline steps train on is the cache: zeroed, the same first step gives another loss
    cfg = FitConfig(steps=3, batch_size=4, lr=1e-3, warmup_steps=1, ttt_length=2, offline=True)
    drafter = eagle3_jax.load_drafter(FIXTURES / "drafter_tiny", target=target)
    tr = Trainer(target, drafter, _records(), cfg, work_dir=tmp_path / "zeroed")
    tr.cached = {name: np.zeros_like(table) for name, table in tr.cached.items()}
    assert abs(float(tr.train_step(next(tr.data_iter))["loss"]) - losses[True][0]) > 1e-3


def test_length_buckets_cut_batches():
    from eagle3_jax.train import data

    recs = _records(n=32, T=40)
    recs["lengths"] = np.array([10] * 16 + [35] * 16, np.int32)
    it = data.dataset(recs, batch_size=4, seed=0, buckets=(16, 32))
    shapes = {next(it)["input_ids"].shape for _ in range(16)}
    assert shapes == {(4, 16), (4, 40)}
