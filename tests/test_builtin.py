"""The built-in pair: task generation and grading, Llama export, the shipped files, the
main job (`eagle3-jax generate "PROMPT"`), the bench, and a scaled-down run of the recipe."""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import eagle3_jax
from eagle3_jax import builtin
from eagle3_jax.config import TargetConfig
from eagle3_jax.decode import encode_chat
from eagle3_jax.models.target import Target


def _hand(family, prompt):  # a hand-written task: the grader gets no answer, only the prompt
    return {"family": family, "prompt": prompt, "steps": [], "answer": ""}


QA = _hand("qa", "Facts: Kamo is 12 years old. Bosu is 31 years old. Tirel is 27 years old. "
                 "Question: Who is older, Kamo or Bosu?")
MATH = _hand("math", "Start at 40 and subtract 6, 5 times.")
CODE = _hand("code", "What does this program print?\nx = 20\ny = 3\nfor i in range(4):\n    x = x - y\n"
                     "if x < 10:\n    x = x - 5\nelse:\n    x = x + 5\nprint(x)")
TOOL = _hand("tool", "A box holds 12 kamo. How many kamo are in 30 boxes?")
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'


@pytest.mark.parametrize("task, right, wrong", [
    (QA, "<think>\nKamo is 12.\n</think>\nThe answer is Bosu.", ["The answer is Kamo.", "Bosu.", "The answer is Tirel."]),
    (MATH, "<think>\nStep 1: 40 - 6 = 34.\n</think>\nThe answer is 10.",
     ["The answer is 70.", "<think>\nThe answer is 10.\n</think>\n", "The answer is 10"]),
    (CODE, "<think>\nx = 20 and y = 3.\n</think>\nThe answer is 3.", ["The answer is 8.", "The answer is 13."]),
    (TOOL, "<think>\nThat is 12 * 30.\n</think>\n" + CALL % "12 * 30" + "\nThe answer is 360.",
     ["<think>\n</think>\nThe answer is 360.",                               # no call at all
      CALL.replace("}}<", "}<") % "12 * 30" + "\nThe answer is 360.",         # invalid JSON
      CALL.replace("calculator", "lookup") % "12 * 30" + "\nThe answer is 360.",  # wrong tool
      CALL % "12 * 31" + "\nThe answer is 360.",                               # wrong arguments
      CALL % "12 * 30" + "\nThe answer is 372."]),                             # wrong final answer
])
def test_graders_check_hand_written_answers(task, right, wrong):
    assert builtin.grade(task, right)
    for text in wrong:
        assert not builtin.grade(task, text), text


def test_qa_grader_reads_every_question_kind():
    facts = "Facts: Kamo is 12 years old. Bosu is 31 years old. Tirel is 27 years old. Question: "
    for q, right in (("How old is Tirel?", "27"), ("Who is older, Tirel or Kamo?", "Tirel"),
                     ("Who is younger, Bosu or Tirel?", "Tirel")):
        task = _hand("qa", facts + q)
        assert builtin.grade(task, f"The answer is {right}.") and not builtin.grade(task, "The answer is 12.")
    for q in ("Where does Kamo live?", "Who is the oldest?"):
        with pytest.raises(ValueError, match="not a qa question"):
            builtin.expected_answer(_hand("qa", facts + q))


@pytest.mark.parametrize("a, op, b, line", [
    (36, "<", 39, "Is 36 < 39? Tens 3 = 3, ones 6 < 9: yes"),
    (73, "<", 78, "Is 73 < 78? Tens 7 = 7, ones 3 < 8: yes"),
    (29, ">", 35, "Is 29 > 35? Tens 2 < 3: no"),
    (81, ">", 19, "Is 81 > 19? Tens 8 > 1: yes"),
    (44, ">", 44, "Is 44 > 44? Tens 4 = 4, ones 4 = 4: no"),
    (47, "<", 46, "Is 47 < 46? Tens 4 = 4, ones 7 > 6: no"),
])
def test_compare_line_goes_digit_by_digit(a, op, b, line):
    assert builtin.compare_line(a, op, b) == line


def test_compare_line_refuses_what_it_cannot_compare():
    for a, op, b in ((9, "<", 40), (40, "<", 100), (40, "<=", 41), (40, "", 41)):
        with pytest.raises(ValueError, match="two two-digit numbers"):
            builtin.compare_line(a, op, b)


def test_tool_check_parts_and_tools():
    check = builtin.tool_check(TOOL, CALL % "30 * 12" + "\nThe answer is 360.")  # any equivalent expression
    assert check == {"valid_json": True, "right_tool": True, "right_arguments": True, "right_answer": True, "success": True}
    check = builtin.tool_check(TOOL, CALL % "12 * 31" + "\nThe answer is 372.")
    assert check["valid_json"] and check["right_tool"] and not check["right_arguments"] and not check["success"]
    assert builtin.call_tool({"name": "calculator", "arguments": {"expression": "12 * 30 + 4"}}) == "364"
    key, price = next(iter(builtin.price_table().items()))
    assert builtin.call_tool({"name": "lookup", "arguments": {"table": "price", "key": key}}) == str(price)
    for bad in ({"name": "calculator", "arguments": {"expression": "__import__('os')"}},
                {"name": "calculator", "arguments": {}}, {"name": "lookup", "arguments": {"table": "age", "key": key}},
                {"name": "lookup", "arguments": {"table": "price", "key": "nothing"}}, {"name": "shell", "arguments": {}}):
        assert builtin.call_tool(bad).startswith("error: ")
    assert builtin.parse_call("no call") is None and builtin.parse_call("<tool_call>[1]</tool_call>") is None


def test_tasks_are_reproducible_answered_right_and_short_and_long():
    tasks = builtin.make_tasks(400, seed=3)
    assert tasks == builtin.make_tasks(400, seed=3) and tasks != builtin.make_tasks(400, seed=4)
    assert [t.family for t in builtin.make_tasks(3, seed=3, families=("code", "qa"))] == ["code", "qa", "code"]
    for bad in (("qa", "poem"), ()):
        with pytest.raises(ValueError, match="families must name some of"):
            builtin.make_tasks(3, seed=3, families=bad)
    for fam in builtin.FAMILIES:
        mine = [t for t in tasks if t.family == fam]
        assert len(mine) == 100
        lengths = [len(t.steps) for t in mine]
        short, long = {"qa": (1, 3), "math": (1, 10), "code": (5, 10), "tool": (2, 4)}[fam]  # thinking lines
        assert min(lengths) == short and max(lengths) >= long, (fam, lengths)
    for t in tasks:
        assert t.answer == builtin.expected_answer(t)  # the generator agrees with the independent solver
        whole = t.response() + ("\n" + t.final_line() if t.family == "tool" else "")
        assert builtin.grade(t, whole) and builtin.grade(dataclass_dict(t), whole)
        assert builtin.grade(t, whole.replace(t.steps[-1], ""))  # the answer decides, not the thinking
        if t.family == "code":  # the if-block copied, then two two-digit numbers compared as compare_line writes it
            cond = re.search(r"if x ([<>]) (\d+):", t.prompt)
            block = t.prompt[cond.start():t.prompt.index("\nprint(x)")].split("\n")
            assert list(t.steps[-1 - len(block):-1]) == block
            line = t.steps[-1]
            x = int(re.match(r"Is (\d+) ", line)[1])
            assert 10 <= x <= 99 and line.startswith(builtin.compare_line(x, cond[1], int(cond[2])))
    thinking, answer = builtin.split_response(tasks[1].response())
    assert thinking.startswith("Step 1: ") and answer == tasks[1].final_line()
    assert [m["role"] for m in tasks[3].messages()] == ["user", "assistant", "tool", "assistant"]


def test_eval_tasks_never_occur_in_training_data():
    from eagle3_jax.builtin import recipe as recipe_mod

    shipped = builtin.eval_tasks()
    assert shipped == json.loads(json.dumps([dataclass_dict(t) for t in builtin.make_tasks(builtin.EVAL_TASKS,
                                                                                           builtin.EVAL_SEED)]))
    assert all(sum(t["family"] == f for t in shipped) >= 50 for f in builtin.FAMILIES)
    held = {t["prompt"] for t in shipped}
    r = recipe_mod.load_recipe()
    trained = [c[0]["content"] for n, seed in ((r.target_tasks, r.seed), (r.drafter_conversations, r.seed + 2),
                                               (20_000, r.seed + 1))  # target, drafter, tokenizer corpus
               for c, _ in recipe_mod.training_text(n, seed)]
    assert len(trained) == r.target_tasks + r.drafter_conversations + 20_000 and not held & set(trained)


def test_drills_are_answered_by_copying_from_the_prompt():
    """The recipe's training-only drills: every answer is copied from the prompt (a repeated
    list, the other half of a pair, facts restated by name), in the families' own words, or is a comparison
    worked digit by digit; they are added at the requested share and never cut short."""
    from eagle3_jax.builtin import recipe as recipe_mod

    rng = np.random.default_rng(0)
    words = set(builtin.task_words()) | {"<", ">"}
    kinds = set()
    for _ in range(300):
        t = recipe_mod.drill(rng)
        assert t.family == "drill"
        if m := re.fullmatch(r"Is (\d+) ([<>]) (\d+)\?", t.prompt):
            kinds.add("compare")
            a, op, b = int(m[1]), m[2], int(m[3])
            assert t.steps == (builtin.compare_line(a, op, b) + ".",)
            assert t.answer == ("yes" if (a < b if op == "<" else a > b) else "no")
            continue
        if m := re.fullmatch(r"Facts: (.+) Recall: (.+)\.", t.prompt):
            kinds.add("recall")
            facts = {f.split(" is ")[0]: f + "." for f in m[1].removesuffix(".").split(". ")}
            asked = m[2].split(", ")
            assert len(set(asked)) == len(asked) and t.steps == tuple(f"Fact: {facts[n]}" for n in asked)
            assert t.answer == facts[asked[-1]].split()[2]
            continue
        assert t.steps == () and t.response().startswith("<think>\n</think>\n")
        if m := re.fullmatch(r"Copy: (.+)\.", t.prompt):
            kinds.add("copy")
            assert t.answer == m[1] and set(m[1].split()) <= words and m[1].split()[-1] not in "<>"
        else:
            m = re.fullmatch(r"Pairs: (.+)\. What (goes with|comes before) (\w+)\?", t.prompt)
            pairs = [p.split(" ") for p in m[1].split(", ")]
            kinds.add(m[2])
            lookup = dict(pairs) if m[2] == "goes with" else {v: k for k, v in pairs}
            assert len(lookup) == len(pairs) and lookup[m[3]] == t.answer
    assert kinds == {"compare", "recall", "copy", "goes with", "comes before"}
    text = recipe_mod.training_text(400, 3, cut_fraction=0.5, drill_fraction=0.2)
    drills = [(c, cut) for c, cut in text if c[0]["content"].startswith(("Copy:", "Pairs:", "Is ")) or " Recall: " in c[0]["content"]]
    assert len(text) == 500 and len(drills) == 100 and not any(cut for _, cut in drills)
    with pytest.raises(ValueError, match="drill_fraction"):
        recipe_mod.training_text(4, 3, drill_fraction=1.0)


def dataclass_dict(task):
    return dataclasses.asdict(task)


def _tiny_llama(vocab=96):
    cfg = TargetConfig.from_dict(dict(model_type="llama", hidden_size=64, num_hidden_layers=8, intermediate_size=96,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                                      max_position_embeddings=128, tie_word_embeddings=True, eos_token_id=[1]))
    model = Target(cfg, rngs=nnx.Rngs(0))
    # non-trivial norms, so that a transposed or swapped tensor cannot go unnoticed
    model.attn_norm.set_value(1 + 0.1 * jax.random.normal(jax.random.key(1), model.attn_norm.shape))
    return model


def test_save_target_round_trips_and_loads_in_transformers(tmp_path):
    import torch
    from transformers import LlamaForCausalLM

    model = _tiny_llama()
    eagle3_jax.save_target(model, tmp_path / "t")
    back = eagle3_jax.load_target(tmp_path / "t")
    for name in ("embed", "wq", "wk", "wo", "w_gate", "w_down", "attn_norm", "norm"):
        np.testing.assert_array_equal(np.asarray(getattr(back, name)[...]), np.asarray(getattr(model, name)[...]))
    ids = np.random.default_rng(0).integers(0, 96, (1, 12))
    ours, _ = model.features(ids)
    hf = LlamaForCausalLM.from_pretrained(str(tmp_path / "t")).eval()
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-4)
    eagle3_jax.save_target(model, tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    np.testing.assert_array_equal(np.asarray(eagle3_jax.load_target(tmp_path / "bf16").wq[...]),
                                  np.asarray(model.wq[...].astype(jnp.bfloat16)))


def test_save_target_refuses_what_it_cannot_write(tmp_path):
    cfg = TargetConfig.from_dict(dict(model_type="qwen2", hidden_size=32, num_hidden_layers=8, intermediate_size=64,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=64))
    with pytest.raises(ValueError, match="qwen2"):
        eagle3_jax.save_target(Target(cfg, rngs=nnx.Rngs(0)), tmp_path / "q")


# ---------------------------------------------------------------- the shipped pair
def test_shipped_pair_files_and_formats():
    from safetensors import safe_open

    assert builtin.available()
    size = sum(p.stat().st_size for p in builtin.ASSETS.rglob("*") if p.is_file())
    assert size <= 30 * 2 ** 20, f"{size / 2 ** 20:.1f} MB"
    tcfg = json.loads((builtin.TARGET_DIR / "config.json").read_text())
    assert tcfg["architectures"] == ["LlamaForCausalLM"] and tcfg["num_hidden_layers"] >= 16
    assert (builtin.TARGET_DIR / "tokenizer.json").exists()
    dcfg = json.loads((builtin.DRAFTER_DIR / "config.json").read_text())
    assert dcfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert dcfg["draft_vocab_size"] < dcfg["vocab_size"] == tcfg["vocab_size"]
    with safe_open(str(builtin.DRAFTER_DIR / "model.safetensors"), "np") as f:
        names = set(f.keys())
        assert f.get_tensor("d2t").dtype == np.int64 and f.get_tensor("t2d").dtype == bool
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= names


@pytest.fixture(scope="module")
def pair():
    return builtin.load()


def test_shipped_target_matches_transformers(pair):
    import torch
    from transformers import LlamaForCausalLM

    target, _, tok = pair
    ids = np.asarray([encode_chat(tok, [{"role": "user", "content": builtin.eval_tasks()[0]["prompt"]}])])
    ours, _ = target.features(ids)
    hf = LlamaForCausalLM.from_pretrained(str(builtin.TARGET_DIR), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours), ref, atol=2e-4, rtol=1e-4)


def test_shipped_pair_greedy_matches_vanilla(pair):
    target, drafter, tok = pair
    tasks = builtin.eval_tasks()[:4]  # one per family
    base = builtin.run_tasks(target, tok, tasks, max_new_tokens=64)
    fast = builtin.run_tasks(target, tok, tasks, drafter=drafter, max_new_tokens=64, tree=eagle3_jax.TreeConfig.chain(6))
    assert [(o["tokens"], o["final_tokens"]) for o in fast] == [(o["tokens"], o["final_tokens"]) for o in base]
    assert fast[0]["stats"]["tau"] > 2.0  # a trained drafter, not a random one (random: τ ≈ 1)
    assert all(tok.decode(o["tokens"]).startswith(builtin.THINK_OPEN) for o in base)


def test_main_job_answers_a_prompt(capsys):
    from eagle3_jax.cli import main

    prompt = "A box holds 79 poukal. How many poukal are in 67 boxes?"  # the README's main job
    assert main(["generate", prompt, "--max-new-tokens", "96"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Thinking:\n") and "\nAnswer:\n" in out
    assert "Tool result: 5293\n" in out and out.rstrip().endswith("Final answer:\nThe answer is 5293.")
    assert re.search(r"tau [\d.]+ over \d+ rounds", out) and "speedup" in out and "identical to vanilla: True" in out


def test_bench_builtin_writes_json_and_figure(tmp_path, capsys):
    from eagle3_jax.cli import main

    js, png = tmp_path / "b.json", tmp_path / "b.png"
    assert main(["bench", "--num-prompts", "1", "--tree", "chain4", "--max-new-tokens", "32",
                 "--json", str(js), "--figure", str(png)]) == 0
    doc = json.loads(js.read_text())
    greedy, sampled = doc["reports"]
    assert greedy["settings"]["temperature"] == 0.0 and sampled["settings"]["temperature"] == 0.7
    e = greedy["eagle3"][0]
    assert e["identical_to_vanilla"] and e["accuracy"] == greedy["vanilla"]["accuracy"]
    assert e["draft_ms"] > 0 and e["verify_ms"] > 0 and len(e["acceptance_rate"]) == 4
    # the loop alone: vanilla's step and the round timed alike, in the same process
    assert greedy["vanilla"]["step_ms"] > 0 and e["loop_speedup"] > 0
    # each call also timed stopped after its prefill: a part of the whole call's time
    assert 0 < greedy["vanilla"]["first_token_share"] < 1 and 0 < e["first_token_seconds"] < e["seconds"]
    out = capsys.readouterr().out
    assert "ms in the loop" in out and "in the loop tau x step / round" in out
    assert "first token (prefill and launch)" in out
    assert doc["reports"][0]["peak_memory"]["bytes"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- the recipe, scaled down
def test_recipe_is_read_from_its_yaml(tmp_path):
    """configs/builtin_recipe.yaml gives every setting (typed, range-checked, unknown keys refused
    naming the file); --from-scratch swaps in its from_scratch steps and learning rate."""
    from eagle3_jax.builtin import recipe as recipe_mod

    r = recipe_mod.load_recipe()
    assert (r.init_target, r.target_steps, r.budgets, r.polish_lr) == ("train/base_target", 1500, (0, 16, 64), 1e-3)
    scratch = r.scratch()
    assert (scratch.init_target, scratch.target_steps, scratch.target_lr) == (None, 10_000, 3e-3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.seed = 1
    for overrides, named in ((["target_stepz=3"], ["did you mean 'target_steps'"]),
                             (["drill_fraction=1"], ["drill_fraction=1.0", "< 1"]),
                             (["from_scratch.target_lr=0"], ["from_scratch.target_lr", "> 0"])):
        with pytest.raises(ValueError) as e:
            recipe_mod.load_recipe(overrides)
        for part in named:
            assert part in str(e.value), str(e.value)
    short = tmp_path / "recipe.yaml"
    short.write_text("seed: 0\n")
    with pytest.raises(ValueError, match=f"{short}: 'vocab_size' is required"):
        recipe_mod.load_recipe(file=short)


def test_recipe_cli_refuses_bad_bases(tmp_path, capsys):
    from eagle3_jax.builtin import recipe as recipe_mod

    for argv, msg in ((["--from-scratch", "--init-target", str(tmp_path)], "exclude each other"),
                      (["--init-target", str(tmp_path / "nowhere")], "no saved target"),
                      (["--polish-steps", "-1"], "--polish-steps: expected 0 or more"),
                      (["--polish-lr", "0"], "--polish-lr: expected a positive")):
        with pytest.raises(SystemExit):
            recipe_mod.main(["--work-dir", str(tmp_path / "work"), *argv])
        assert msg in capsys.readouterr().err
    assert not (tmp_path / "work" / "tokenizer").exists()


def test_recipe_runs_end_to_end_scaled_down(tmp_path):
    """Every stage of `python -m eagle3_jax.builtin.recipe` on a tiny budget: the code path the shipped
    pair came from (tokenizer → target → export → drafter pipeline → metrics)."""
    from eagle3_jax.builtin import recipe as recipe_mod

    recipe = recipe_mod.load_recipe(["vocab_size=512", "hidden_size=64", "num_layers=8", "intermediate_size=128",
                                     "num_heads=2", "num_kv_heads=1", "target_tasks=300", "target_steps=3",
                                     "warmup_steps=1", "seq_len=64", "drafter_conversations=16", "eval_tasks=4",
                                     "budgets=0"])
    work = tmp_path / "work"
    work.mkdir()
    tok = recipe_mod.build_tokenizer(work, recipe)
    assert len(tok) == 512 and tok.convert_tokens_to_ids(builtin.THINK_CLOSE) != tok.unk_token_id
    model = recipe_mod.train_target(work, recipe, tok)
    recipe_mod.export_target(model, tok, work / "target")
    # the default recipe fine-tunes a saved target: at learning rate 0 it gives back the weights it loaded
    tuned = recipe_mod.train_target(tmp_path / "tune", dataclasses.replace(recipe, target_lr=0.0), tok, init=work / "target")
    loaded = eagle3_jax.load_target(work / "target", dtype="float32")
    same = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), nnx.to_pure_dict(nnx.state(tuned, nnx.Param)),
                        nnx.to_pure_dict(nnx.state(loaded, nnx.Param)))
    assert all(jax.tree.leaves(same))
    overrides = ["fit.steps=2", "fit.save_every=2", "fit.buckets=[64]", "regenerate.max_new_tokens=16",
                 "draft_vocab_size=128"]
    recipe_mod.train_drafter(work, recipe, overrides)
    # the continued fit starts from the fitted drafter: at a learning rate of 1e-12 it keeps its weights
    recipe_mod.polish_drafter(work, dataclasses.replace(recipe, polish_steps=2, polish_lr=1e-12), overrides)
    assert (work / "drafter_polish_run" / "best.json").exists()
    target = eagle3_jax.load_target(work / "target", dtype="float32")
    drafter = eagle3_jax.load_drafter(work / "drafter", target=target)
    fitted = eagle3_jax.load_drafter(work / "drafter_fit", target=target)
    close = jax.tree.map(lambda a, b: bool(jnp.allclose(a, b, atol=1e-6)), nnx.to_pure_dict(nnx.state(drafter, nnx.Param)),
                         nnx.to_pure_dict(nnx.state(fitted, nnx.Param)))
    assert jax.tree.leaves(close) and all(jax.tree.leaves(close))
    tasks = recipe_mod.write_eval_set(work / "eval.json", recipe)
    metrics = recipe_mod.evaluate(target, drafter, tok, tasks, recipe.budgets, max_new_tokens=16, trees=("chain4",))
    assert set(metrics["by_thinking_budget"]) == {"0", "unlimited"}
    assert set(metrics["by_thinking_budget"]["0"]) == {*builtin.FAMILIES, "all"}
    assert set(metrics["greedy"]["chain4"]["tau"]) == set(builtin.FAMILIES)
    assert all(v["identical_to_vanilla"] for v in metrics["greedy"].values())
