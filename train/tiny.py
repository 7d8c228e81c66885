"""A tiny, fully offline training run: a synthetic arithmetic chat task, a byte-level BPE
tokenizer trained here to the golden target's vocabulary (1024), the whole pipeline with
``configs/tiny.yaml``, then τ of the exported drafter vs an untrained one on held-out prompts.

    python -m eagle3_jax.train.tiny --conversations 600 --work-dir runs/tiny fit.steps=1200 fit.save_every=200
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np

import eagle3_jax
from eagle3_jax.decode import encode_chat
from eagle3_jax.train import pipeline

ROOT = Path(__file__).resolve().parent.parent
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def arithmetic_conversations(n: int, seed: int = 0) -> list[dict]:
    """ShareGPT-style conversations about small sums (the answers get regenerated)."""
    rng = np.random.default_rng(seed)
    convs = []
    for _ in range(n):
        a, b = (int(x) for x in rng.integers(0, 100, 2))
        convs.append({"conversations": [{"from": "human", "value": f"What is {a} + {b}?"},
                                        {"from": "gpt", "value": f"{a} + {b} = {a + b}."}]})
    return convs


def build_tokenizer(directory: Path, corpus: list[str], vocab_size: int = 1024, added_tokens: tuple[str, ...] = (),
                    split_digits: bool = False, roles: tuple[str, ...] = ("user", "assistant", "system")):
    """A byte-level BPE tokenizer trained offline on ``corpus`` to ``vocab_size``, with the chat
    template (a ``<|role|>`` special token per role in ``roles``); ``added_tokens`` (e.g. ``<think>``) are
    whole tokens that decoding keeps; ``split_digits``: one token per digit."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]) \
        if split_digits else byte_level
    tok.decoder = decoders.ByteLevel()
    specials = ["<|pad|>", *(f"<|{r}|>" for r in roles), "<|end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(added_tokens), special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens(list(added_tokens))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>", pad_token="<|pad|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    return fast


def arithmetic_corpus() -> list[str]:
    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = ["".join(rng.choice(letters, size=rng.integers(2, 9))) for _ in range(3000)]
    corpus = [f"What is {a} + {b}? {a} + {b} = {a + b}." for a in range(100) for b in range(0, 100, 7)]
    return corpus + [" ".join(words[i: i + 12]) for i in range(0, len(words), 12)]


def held_out_taus(target, drafters: dict, tokenizer, *, prompts: int = 32, max_new_tokens: int = 48, trees=None) -> dict:
    """τ per drafter and tree on held-out arithmetic prompts (greedy)."""
    trees = trees or (eagle3_jax.TreeConfig(16, 4, 4), eagle3_jax.TreeConfig(60, 7, 10))
    held = [encode_chat(tokenizer, [{"role": "user", "content": c["conversations"][0]["value"]}])
            for c in arithmetic_conversations(prompts, seed=99)]
    out = {}
    for name, d in drafters.items():
        for tree in trees:
            stats = eagle3_jax.generate(target, d, held, max_new_tokens=max_new_tokens, tree=tree).stats
            out[f"{name} {tree.total_tokens},{tree.depth},{tree.top_k}"] = {
                "tau": stats["tau"], "acceptance_rate": stats["acceptance_rate"]}
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description="tiny offline drafter training run")
    p.add_argument("--conversations", type=int, default=600)
    p.add_argument("--work-dir", type=os.path.expanduser, default="runs/tiny")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. fit.steps=1200")
    args = p.parse_args(argv)
    work = Path(args.work_dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    tok = build_tokenizer(work / "tok", arithmetic_corpus())
    with open(work / "conv.jsonl", "w") as f:
        for c in arithmetic_conversations(args.conversations, seed=0):
            f.write(json.dumps(c) + "\n")
    cfg = pipeline.load_config(ROOT / "configs" / "tiny.yaml", [
        f"target={ROOT / 'tests' / 'fixtures' / 'target_tiny'}", f"tokenizer={work / 'tok'}",
        f"data={work / 'conv.jsonl'}", f"work_dir={work / 'run'}", *args.overrides])
    start = time.time()
    pipeline.run("all", cfg)
    print(f"pipeline: {time.time() - start:.0f} s")
    target = eagle3_jax.load_target(cfg.target)
    drafters = {"trained": eagle3_jax.load_drafter(work / "run" / "export", target=target),
                "untrained": pipeline.new_drafter(target, np.load(work / "run" / "vocab.npz")["d2t"],
                                                  draft_vocab_size=cfg.draft_vocab_size)}
    for key, value in held_out_taus(target, drafters, tok).items():
        print(f"{key}: tau {value['tau']:.3f}, acceptance per position {[round(x, 2) for x in value['acceptance_rate']]}")


if __name__ == "__main__":
    main()
