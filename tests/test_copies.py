"""The copies agree. Each script carries its own copy of what its default path needs (the card's trade: reuse for
transparency, as cleanRL's files do), and no script imports another. These tests run every copy of a shared piece
on the same inputs and compare, so a copy cannot drift silently. What a piece must compute is checked against
independent references elsewhere (test_losses, test_families, test_prm, ...); here, that the copies compute the same,
on the five tokenizer families of tests/families.py where tokens are involved."""
import argparse
import ast
import json
import math
import os
import re

import pytest
import torch
import torch.distributed as dist

import common
import distill
import dpo
import families
import grpo
import online_dpo
import ppo
import prm
import process_rewards
import rm
import serve_rm
import sft
from conftest import ROOT, RewardServer

SCRIPTS = ("sft", "rm", "prm", "dpo", "online_dpo", "distill", "grpo", "ppo", "make_pairs", "serve_rm", "merge_lora")
TRAINING = (sft, rm, prm, dpo, online_dpo, distill, grpo, ppo)
CHAT = [f for f in families.FAMILIES if f != "gpt2"]  # GPT-2 ships no chat template


def imported(path):
    """The top-level names of every module a file imports, wherever the import stands (a function's too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_no_script_imports_another_script():
    """Copying one script to modify it changes nothing else: no script, plug-in or common.py imports a script (the toy
    world's files, toy.py and demo.py, are the example, not the product)."""
    product = [p for p in ROOT.glob("*.py") if p.stem not in ("toy", "demo", "smollm2", "toy_agent")]
    assert {p.stem for p in product} >= set(SCRIPTS)
    found = {p.name: sorted(imported(p) & set(SCRIPTS) - {p.stem}) for p in product}
    assert {name: scripts for name, scripts in found.items() if scripts} == {}


def flag_table(parser):
    """What --help and parsing see of each flag: names, default, nargs, choices, help, and its type's range."""
    def kind(t):  # common.ranged's parse: the same kind and range, whatever closure holds them
        return tuple(c.cell_contents for c in t.__closure__) if getattr(t, "__closure__", None) else t
    return [(a.option_strings, a.dest, a.default, a.nargs, a.choices, a.help, a.metavar, type(a).__name__,
             kind(a.type)) for a in parser._actions]


def test_training_flags_are_the_same_in_every_script():
    """add_training_args: the same flags, defaults, ranges and help in every training script."""
    tables = {m.__name__: flag_table(m.add_training_args(argparse.ArgumentParser())) for m in TRAINING}
    assert len(tables["sft"]) > 40
    for name, table in tables.items():
        assert table == tables["sft"], name


@pytest.fixture(scope="module")
def world_of_one():
    """A world-of-one gloo group, as a script's start makes it (one may be up already: it stays for the session)."""
    saved = dict(os.environ)  # init_distributed's RANK, LOCAL_RANK, MASTER_PORT, ...: DeepSpeed reads them in this
    if not dist.is_initialized():  # module's tests; later tests' subprocesses must not inherit them
        common.init_distributed(parsed())
    os.environ.setdefault("LOCAL_RANK", "0")
    yield
    os.environ.clear()
    os.environ.update(saved)


def parsed(**flags):
    args = sft.add_training_args(argparse.ArgumentParser()).parse_args([])
    for k, v in flags.items():
        setattr(args, k, v)
    return args


@pytest.mark.parametrize("flags", [{}, dict(zero_stage=3, bf16=True, adam_offload=True, overlap_comm=True,
                                             train_batch_size=32, micro_train_batch_size=4, max_norm=0.5)])
def test_deepspeed_configs_are_the_same(world_of_one, flags):
    """ds_config: every script's copy gives the same DeepSpeed config for the same flags (the written-out
    expectation of a few fields guards against every copy drifting together)."""
    args = parsed(**flags)
    configs = {m.__name__: m.ds_config(args) for m in TRAINING}
    for name, config in configs.items():
        assert config == configs["sft"], name
    expected_accumulation = args.train_batch_size // args.micro_train_batch_size
    assert configs["sft"]["gradient_accumulation_steps"] == expected_accumulation
    assert configs["sft"]["zero_optimization"]["stage"] == args.zero_stage
    with pytest.raises(SystemExit, match="not a multiple of --micro_train_batch_size 5"):
        sft.ds_config(parsed(train_batch_size=64, micro_train_batch_size=5))


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`")
def test_deepspeed_set_up_is_the_same(world_of_one, toy_world):
    """setup_deepspeed: the same optimizer settings and learning-rate schedule from every copy."""
    from transformers import AutoModelForCausalLM

    args = parsed(learning_rate=1e-3, lr_warmup_ratio=0.2, l2=0.01)
    schedules = {}
    for m in TRAINING:
        model = AutoModelForCausalLM.from_pretrained(toy_world / "model")
        engine = m.setup_deepspeed(model, args, m.ds_config(args), 10)
        group = engine.optimizer.param_groups[0]
        lrs = []
        for _ in range(10):
            lrs.append(engine.get_lr()[0])
            engine.lr_scheduler.step()
        schedules[m.__name__] = (type(engine.optimizer).__name__, group["betas"], group["weight_decay"], lrs)
    for name, schedule in schedules.items():
        assert schedule == schedules["sft"], name
    lrs = schedules["sft"][3]
    assert lrs[0] == 0.0 and lrs[2] == pytest.approx(1e-3)  # 2 warm-up steps, then the peak


def test_training_batches_are_the_same(world_of_one):
    """train_batches (resumable, seeded per epoch) and eval_shard: the same indices from every script's copy."""
    args = parsed(train_batch_size=8, micro_train_batch_size=2, max_epochs=3, seed=7)
    users = [m for m in TRAINING if hasattr(m, "train_batches")]
    assert {m.__name__ for m in users} >= {"sft", "rm", "prm", "dpo"}
    runs = {m.__name__: list(m.train_batches(30, args, start_step=2)) for m in users}
    for name, run in runs.items():
        assert run == runs["sft"], name
    assert len(runs["sft"]) == 3 * (30 // 8) - 2  # whole batches only, from step 2 on
    shards = {m.__name__: m.eval_shard(list(range(11)), 4) for m in TRAINING if hasattr(m, "eval_shard")}
    for name, shard in shards.items():
        assert shard == shards["sft"], name


@pytest.mark.parametrize("family", families.FAMILIES)
def test_sequences_batched_the_same(family_dirs, family):
    """batch_sequences (padded and packed) of every script's copy, and serve_rm's padded pad_batch, on one family's
    token ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(family_dirs[family] / "model")
    seqs = [torch.tensor(tok(t)["input_ids"]) for t in ["12+34=46", "Step 1: 7+5=12", "x"]]
    pad = 0 if tok.pad_token_id is None else tok.pad_token_id
    lists = lambda xs: [x if x is None else x.tolist() for x in xs]  # noqa: E731
    for packing in (False, True):
        want = lists(sft.batch_sequences(seqs, pad, packing))
        for m in (rm, prm):
            assert lists(m.batch_sequences(seqs, pad, packing)) == want, (m.__name__, packing)
    assert lists(serve_rm.pad_batch(seqs, pad)) == lists(sft.batch_sequences(seqs, pad, False))[:2]
    ids, mask, pos = sft.batch_sequences(seqs, pad, False)  # right-padded, positions counting real tokens
    assert ids[2, len(seqs[2]):].eq(pad).all() and mask.sum(-1).tolist() == [len(s) for s in seqs] and pos[0, 0] == 0


@pytest.mark.parametrize("family", families.FAMILIES)
def test_distill_tokenizes_dataset_completions_as_sft(family_dirs, family):
    """distill.py's off-policy records become the token ids sft.py trains on (its own tokenize_sample copy)."""
    from test_families import family_args

    for chat in ([False, True] if family in CHAT else [False]):
        args = family_args(family, apply_chat_template=chat)
        tok = common.load_tokenizer(family_dirs[family] / "model", args)
        records = [{"input": "12+34=", "output": "46"}, {"input": "Step 1: 7+5=", "output": "12\nThe answer: 12"}]
        for i, record in enumerate(records):
            want = sft.tokenize_sample(record, tok, args)
            got = distill.tokenize_sample(record, tok, args)
            assert len(got) == len(want)
            for g, w in zip(got, want):
                assert (g.tolist() if torch.is_tensor(g) else g) == (w.tolist() if torch.is_tensor(w) else w), i


@pytest.mark.parametrize("family", families.FAMILIES)
def test_distill_dataset_rollout_is_what_sft_trains_on(family_dirs, family, tmp_path):
    """distill.py's dataset_rollout (the off-policy share) from its own prompt records: each response is the tokens
    sft.py's tokenize_sample trains on for that prompt and completion (its unmasked labels, through the stop token),
    the first --generate_max_len of them (then not stopped), and follows the record's prompt ids as in sft.py's
    sequence, so the losses read the tokens SFT would have trained on."""
    from test_families import family_args

    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"input": i, "output": o}) + "\n"
                            for i, o in [("12+34=", "46"), ("Step 1: 7+5=", "12\nThe answer: 12"), ("x", " 99")]))
    for chat in ([False, True] if family in CHAT else [False]):
        for limit in (64, 3):  # 3 cuts the long completion
            # distill.py's main reads the completion as each prompt record's label
            args = family_args(family, apply_chat_template=chat, generate_max_len=limit, prompt_max_len=200,
                               input_key="input", label_key="output", input_template=None, seed=42)
            tok = common.load_tokenizer(family_dirs[family] / "model", args)
            records = distill.load_prompts(str(data), "train", tok, args)
            batch = distill.dataset_rollout(records, tok, args)
            for i, r in enumerate(records):
                ids, labels = sft.tokenize_sample({"input": r["input"], "output": r["label"]}, tok, args)
                want = labels[labels != -100][:limit].tolist()
                n = int(batch.lengths[i])
                assert batch.responses[i, :n].tolist() == want, (chat, limit, i)
                assert batch.stopped[i].item() == (want[-1] == tok.eos_token_id), (chat, limit, i)
                assert ids[:len(r["ids"]) + n].tolist() == r["ids"].tolist() + want, (chat, limit, i)
            assert batch.stopped.tolist()[:2] == [True, limit == 64], (chat, limit)


def test_dpo_losses_are_the_same():
    """dpo.dpo_loss and online_dpo.dpo_loss: every loss type and label smoothing, values and gradients."""
    torch.manual_seed(0)
    logps = [torch.randn(6, dtype=torch.float64, requires_grad=True) for _ in range(4)]
    for loss_type in dpo.LOSS_TYPES:
        for smoothing in ((0.0, 0.1) if loss_type == "sigmoid" else (0.0,)):
            outs = []
            for m in (dpo, online_dpo):
                loss, chosen, rejected = m.dpo_loss(*logps, beta=0.2, loss_type=loss_type, label_smoothing=smoothing)
                grads = torch.autograd.grad(loss, logps)
                outs.append((loss.item(), chosen.tolist(), rejected.tolist(), [g.tolist() for g in grads]))
            assert outs[0] == outs[1], (loss_type, smoothing)


def test_clip_bounds_are_the_same():
    """grpo.py's, ppo.py's and distill.py's clip_bound: a bound its tensor's dtype holds as it is, one past it +-inf
    (by hand: float32 and bfloat16 end near 3.4e38, float64 at 1.8e308)."""
    f32, f64, bf16 = (torch.zeros(1, dtype=d) for d in (torch.float32, torch.float64, torch.bfloat16))
    for x, like, want in [(1.2, f32, 1.2), (-0.8, f64, -0.8), (3.4e38, f32, 3.4e38), (1e308, f32, math.inf),
                          (-1e300, bf16, -math.inf), (1e308, f64, 1e308), (math.inf, f64, math.inf)]:
        assert [m.clip_bound(x, like) for m in (grpo, ppo, distill)] == [want] * 3, (x, like.dtype)


@pytest.mark.parametrize("family", families.FAMILIES)
def test_step_rule_is_the_same(family_dirs, family):
    """The PRM step rule (prm.py trains with it, serve_rm.py serves it, process_rewards.py reads a trainer's steps
    with it): completion_text, steps_of and with_placeholders of every copy on one family's completions."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(family_dirs[family] / "model")
    eos = tok.eos_token or ""
    texts = ["07+45=52\n" + eos, "Step 1: 1+2=3\nStep 2: 3+1=4\n\n", "ки\nx ки\n" + eos, "", eos, "a\n\nb"]
    copies = [m for m in (prm, serve_rm, process_rewards)]
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        decoded = tok.decode(ids)
        for m in copies:
            if hasattr(m, "completion_text"):
                assert m.completion_text(decoded, tok) == prm.completion_text(decoded, tok), (m.__name__, text)
            if hasattr(m, "steps_of"):
                assert m.steps_of(text, "\n") == prm.steps_of(text, "\n"), (m.__name__, text)
            if hasattr(m, "with_placeholders"):
                assert m.with_placeholders(text, "\n", "ки") == prm.with_placeholders(text, "\n", "ки"), m.__name__
    assert sum(hasattr(m, "completion_text") for m in copies) == 3


@pytest.mark.parametrize("family", families.FAMILIES)
def test_prm_judgement_is_the_same(family_dirs, family):
    """step_probabilities (prm.py's evaluation, serve_rm.py's scorer, process_rewards.py's local judge) and
    check_saved (a saved PRM's config read as a judge) of every copy, on one family's tiny model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(family_dirs[family] / "model")
    placeholder_id, reward_ids = prm.setup_tokens(tok, "ки", ["+", "-"])
    model = AutoModelForCausalLM.from_pretrained(family_dirs[family] / "model").eval()
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    model.config.placeholder_token_id, model.config.reward_token_ids = placeholder_id, reward_ids
    texts = ["07+45=52 ки\n99+1=100 ки", "Step 1: 3 ки\nStep 2: 4 ки\nStep 3: 5 ки", "x ки"]
    seqs = [torch.tensor(tok(t)["input_ids"]) for t in texts]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    want = prm.step_probabilities(model, seqs, pad)
    assert [len(p) for p in want] == [2, 3, 1] and all(0 < x < 1 for p in want for x in p)
    for m in (serve_rm, process_rewards):
        assert m.step_probabilities(model, seqs, pad) == want, m.__name__
    for m in (prm, serve_rm, process_rewards):  # the token texts filled in from the ids, the same way
        config = type(model.config).from_dict(model.config.to_dict())
        m.check_saved(config, tok, "prm_dir")
        assert (config.placeholder_token, config.reward_tokens) == (tok.decode([placeholder_id]),
                                                                    [tok.decode([i]) for i in reward_ids])
        config.reward_token_ids = reward_ids[:1]
        with pytest.raises(SystemExit, match="must be two distinct tokens"):
            m.check_saved(config, tok, "prm_dir")


def test_rollout_py_is_a_shim_that_names_the_new_places():
    """rollout.py's public names still work for one release, each with a DeprecationWarning naming where it lives
    now (the object there, not a copy); the shim is short and nothing of the product imports it."""
    import importlib

    import rollout

    assert len((ROOT / "rollout.py").read_text().splitlines()) <= 30
    assert {"rollout_correction_weights", "reward_client", "generate_hf", "Rollout"} <= set(rollout.MOVED)
    for name, place in rollout.MOVED.items():
        with pytest.warns(DeprecationWarning, match=rf"rollout\.{name} is deprecated: use {place}\.{name}"):
            assert getattr(rollout, name) is getattr(importlib.import_module(place), name)
    with pytest.raises(AttributeError, match="deprecation shim"):
        rollout.no_such_name
    users = [p.name for p in ROOT.glob("*.py") if "rollout" in imported(p) and p.name != "rollout.py"]
    assert users == []


RL = ("grpo", "ppo", "online_dpo", "distill", "make_pairs")  # each carries its own rollout


def rl_modules():
    import importlib

    return [importlib.import_module(name) for name in RL]


@pytest.mark.parametrize("family", families.FAMILIES)
def test_rl_scripts_generate_the_same_tokens(family_dirs, family):
    """generate_hf of every RL script: the same greedy ids from the same checkpoint and prompts (a group's prompt
    repeated: the copies that prefill it once must still agree), each cut at its EOS; the same samples at temperature
    1 from the same seed; and in grpo.py and ppo.py (the scripts with agents) the per-prompt budgets of an agent's
    turn honoured alike."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = family_dirs[family] / "model"
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:  # as common.load_tokenizer leaves every real tokenizer
        tok.add_special_tokens({"pad_token": "<pad>"})
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    with torch.no_grad():  # a likelier EOS, so that some completions stop before the budget
        model.get_output_embeddings().weight[tok.eos_token_id] *= 3
    prompts = [torch.tensor(tok(t)["input_ids"]) for t in ["12+34=", "Step 1: 7+5=", "x"] for _ in range(2)]
    runs = {}
    for m in rl_modules():
        greedy = m.generate_hf(model, tok, prompts, 0.0, max_new_tokens=12, chunk_size=4)
        torch.manual_seed(0)
        sampled = m.generate_hf(model, tok, prompts, 1.0, max_new_tokens=12, chunk_size=6)
        runs[m.__name__] = ([g.tolist() for g in greedy], [s.tolist() for s in sampled])
        if m.__name__ in ("grpo", "ppo"):
            torch.manual_seed(0)
            budgets = m.generate_hf(model, tok, prompts, 1.0, max_new_tokens=[3, 12, 5, 12, 1, 12], chunk_size=6)
            runs[m.__name__] += ([b.tolist() for b in budgets],)
    for name, run in runs.items():
        assert run == runs["grpo"][:len(run)], name
    greedy, sampled, budgeted = runs["grpo"]
    assert runs["ppo"][2] == budgeted
    assert all(len(g) == 12 or g[-1] == tok.eos_token_id for g in greedy)
    assert all(tok.eos_token_id not in g[:-1] for g in greedy + sampled + budgeted)
    assert [len(b) <= n for b, n in zip(budgeted, [3, 12, 5, 12, 1, 12])] == [True] * 6


def greedy_reference(model, tok, prompt, max_new_tokens):
    """Stock generate on one prompt, unpadded: greedy, told nothing by the checkpoint's generation config (Qwen's
    repetition penalty, GPT-2's no-repeat n-grams, Mistral's max_length), cut after its first EOS."""
    ids = prompt[None]
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                         max_length=None, repetition_penalty=1.0, no_repeat_ngram_size=0,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)[0, len(prompt):].tolist()
    return out[:out.index(tok.eos_token_id) + 1] if tok.eos_token_id in out else out


@pytest.mark.parametrize("family", families.FAMILIES)
def test_rl_scripts_hf_rollouts_are_the_same(family_dirs, family):
    """Each RL script's HF rollout end to end, its HFEngine(args, model, tokenizer).sample(records, T) made a Rollout
    by its Rollout.of, as its steps and its eval do: the same responses, lengths, stop flags and masks from every
    script, greedy (= stock generate prompt by prompt, cut after the first EOS) and at temperature 1 with --top_p from
    the same seed, a group's prompt repeated as a step samples it."""
    from transformers import AutoModelForCausalLM

    from test_families import family_args

    budget = 8
    args = family_args(family, apply_chat_template=False, generate_max_len=budget, top_p=0.9,
                       micro_rollout_batch_size=4)
    tok = common.load_tokenizer(family_dirs[family] / "model", args)
    model = AutoModelForCausalLM.from_pretrained(family_dirs[family] / "model").eval()
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    records = [{"ids": torch.tensor(tok(t)["input_ids"]), "text": t, "label": None, "input": t}
               for t in ["12+34=", "Step 1: 7+5", "x y", "Sure: 42."] for _ in range(2)]
    with torch.no_grad():  # EOS a shade above a token the first prompt's greedy reply writes early: some replies stop
        head = model.get_output_embeddings().weight  # (the tiny random models rarely pick EOS)
        head[tok.eos_token_id] = head[greedy_reference(model, tok, records[0]["ids"], budget)[2]] * 1.05
    runs = {}
    for m in (grpo, ppo, online_dpo, distill):
        engine, run = m.HFEngine(args, model, tok), []
        for temperature in (0.0, 1.0):
            torch.manual_seed(0)
            batch = m.Rollout.of(records, tok.eos_token_id, **engine.sample(records, temperature))
            if hasattr(batch, "action_mask"):  # online_dpo.py's Rollout has none
                assert batch.action_mask.tolist() == (torch.arange(budget) < batch.lengths[:, None]).tolist()
            run.append((batch.responses.tolist(), batch.lengths.tolist(), batch.stopped.tolist()))
        runs[m.__name__] = run
    for name, run in runs.items():
        assert run == runs["grpo"], name
    responses, lengths, stopped = runs["grpo"][0]
    assert [r[:n] for r, n in zip(responses, lengths)] == [greedy_reference(model, tok, r["ids"], budget)
                                                          for r in records[::2] for _ in range(2)]
    assert stopped == [r[n - 1] == tok.eos_token_id for r, n in zip(responses, lengths)]
    assert 0 < sum(stopped) < len(records) and max(lengths) == budget  # some stopped, some cut at the budget


def named(out):
    """A reward call's named result as plain lists, to compare."""
    return {k: (v.tolist() if torch.is_tensor(v) else {n: t.tolist() for n, t in v.items()})
            for k, v in out.items() if k in ("rewards", "scores", "logs")}


def test_reward_calls_read_replies_and_fail_alike(tmp_path):
    """check_rewards of every copy: the same named result from every accepted reply shape, the same one-line error
    for every malformed one; a reward_func file read by each script's reward_client gives the same result."""
    replies = [[1.0, 2.0], torch.tensor([0.5, -1.0]), {"rewards": [1, 0], "scores": [0.5, 0.25],
                                                       "extra_logs": {"acc": [1, 0], "k": 3}},
               {"scores": [2.0, 3.0]}]
    bad = [[1.0], [1.0, float("nan")], {"extra": 1}, {"rewards": [1, 2], "extra_logs": 5}, "text", [[1, 2], [3]],
           {"rewards": ["a", "b"]}]
    modules = rl_modules()
    for reply in replies:
        want = named(grpo.check_rewards(reply, 2, "src"))
        assert set(want) == {"rewards", "scores", "logs"}
        for m in modules:
            assert named(m.check_rewards(reply, 2, "src")) == want, (m.__name__, reply)
    for reply in bad:
        errors = set()
        for m in modules:
            with pytest.raises(SystemExit) as stop:
                m.check_rewards(reply, 2, "src")
            errors.add(str(stop.value))
        assert len(errors) == 1 and next(iter(errors)).startswith("error: src: "), (reply, errors)
    reward_file = tmp_path / "len_reward.py"
    reward_file.write_text("def reward_func(queries, prompts, labels):\n"
                           "    return {'rewards': [len(q) - len(p) for q, p in zip(queries, prompts)],\n"
                           "            'extra_logs': {'label_given': [float(l is not None) for l in labels]}}\n")
    queries, prompts, labels = ["12+34=46", "1+1=2</s>"], ["12+34=", "1+1="], ["46", None]
    results = {m.__name__: named(m.reward_client(str(reward_file))(queries, prompts, labels)) for m in modules}
    for name, result in results.items():
        assert result == results["grpo"], name
    assert results["grpo"]["rewards"] == [2.0, 5.0] and results["grpo"]["logs"] == {"label_given": [1.0, 0.0]}


def remote_runs(timeout=5.0, retries=2, **server):
    """remote_rewards of every copy (distill.py has none: its rewards come from a file) against one real server on
    127.0.0.1, conftest.RewardServer(**server), each given the same small budget as arguments (the mains pass their
    --remote_rm_* flags) -> (what every copy gave: its named result or its error, the seconds it took masked, and the
    requests it made; the server's URL)."""
    queries, prompts, labels = ["12+34=46", "7+5=12</s>", "x"], ["12+34=", "7+5=", ""], ["46", "12", None]
    server, runs = RewardServer(**server), {}
    try:
        for m in rl_modules():
            if m.__name__ == "distill":
                continue
            server.requests.clear()  # fail_first counts from each copy's first request
            try:
                out = named(m.remote_rewards(server.url, queries, prompts, labels, batch_size=2, timeout=timeout,
                                             retries=retries, backoff=0.05, retry_wait=1.0))
            except SystemExit as e:
                out = re.sub(r" in [\d.]+ s,", " in _ s,", str(e))
            runs[m.__name__] = (out, list(server.requests))
    finally:
        server.close()
    assert len(runs) == 4
    for name, run in runs.items():
        assert run == runs["grpo"], name
    return runs["grpo"], server.url


def test_remote_rewards_retry_alike():
    """Two 503s, then answers: every copy retries and returns the server's rewards in order (len(query) each), from
    the same requests: the first batch three times, then the second."""
    (out, requests), _ = remote_runs(fail_first=2)
    assert out == {"rewards": [8.0, 10.0, 1.0], "scores": [8.0, 10.0, 1.0], "logs": {}}
    assert [r["query"] for r in requests] == [["12+34=46", "7+5=12</s>"]] * 3 + [["x"]]
    assert requests[-1] == {"query": ["x"], "prompts": [""], "labels": [None]}


def test_remote_rewards_refused_alike():
    """A 422: every copy stops at its first request with the same one-line error naming the server and its reply."""
    (error, requests), url = remote_runs(status=422)
    assert error == f'error: reward server {url} refused the request (HTTP 422: {{"detail": "busy"}})'
    assert len(requests) == 1


def test_remote_rewards_timeout_alike():
    """A server that never answers in time: every copy gives up after the same tries with the same one-line error."""
    (error, requests), url = remote_runs(timeout=0.3, retries=1, hang=True)
    assert error.startswith(f"error: reward server {url} failed 2 times in _ s, 0.05 s of it waiting between tries "
                            "(--remote_rm_retries 1, --remote_rm_retry_wait 1); last error: ") and "Timeout" in error
    assert "\n" not in error and len(requests) == 2


@pytest.mark.parametrize("family", families.FAMILIES)
def test_reward_texts_are_the_same(family_dirs, family, tmp_path):
    """client_rewards of every RL script with a reward_func file that records what it gets: the same (query, prompt)
    texts for the same (prompt ids, response ids), with and without the chat template: the query the pair's tokens
    decoded together with the special tokens kept (a BOS, the template's markers, the EOS that ended a response),
    the prompt its prefix."""
    from test_families import family_args

    log = tmp_path / "texts.json"
    reward_file = tmp_path / "recording.py"
    reward_file.write_text("import json\n"
                           "def reward_func(queries, prompts, labels):\n"
                           f"    open({str(log)!r}, 'w').write(json.dumps([queries, prompts, labels]))\n"
                           "    return [float(len(q)) for q in queries]\n")
    for chat in ([False, True] if family in CHAT else [False]):
        args = family_args(family, apply_chat_template=chat, input_template=None)
        tok = common.load_tokenizer(family_dirs[family] / "model", args)
        prompt_ids = [tok(common.format_prompt(t, tok, args), add_special_tokens=not chat)["input_ids"]
                      for t in ("12+34=", "Step 1: 7+5=", "x")]
        eos = [tok.eos_token_id]
        replies = [tok(t, add_special_tokens=False)["input_ids"] for t in ("46", "12\nThe answer: 12")]
        responses = [replies[0] + eos, replies[1], eos]  # stopped, cut at the budget, EOS alone
        pairs = [(torch.tensor(p), torch.tensor(r)) for p, r in zip(prompt_ids, responses)]
        labels = ["46", None, "x"]
        runs = {}
        for m in rl_modules():
            out = m.client_rewards(m.reward_client(str(reward_file)), pairs, labels, tok)
            runs[m.__name__] = (json.loads(log.read_text()), out["rewards"].tolist())
        for name, run in runs.items():
            assert run == runs["grpo"], (name, chat)
        (queries, prompts, got_labels), rewards = runs["grpo"]
        assert queries == [tok.decode(p + r, skip_special_tokens=False) for p, r in zip(prompt_ids, responses)]
        assert prompts == [tok.decode(p, skip_special_tokens=False) for p in prompt_ids]
        assert all(q.startswith(p) for q, p in zip(queries, prompts)) and got_labels == labels
        assert [q.endswith(tok.eos_token) for q in queries] == [True, False, True], chat
        assert rewards == [float(len(q)) for q in queries]

def test_rollout_flags_agree_where_scripts_share_them():
    """add_rollout_args of grpo.py, ppo.py, online_dpo.py and distill.py: each flag two of them take has the same
    names, default, range and help in both (each copy holds only the flags its script takes)."""
    parsers = {}
    for name, m in (("grpo", grpo), ("ppo", ppo), ("online_dpo", online_dpo), ("distill", distill)):
        p = argparse.ArgumentParser()
        m.add_rollout_args(p)
        parsers[name] = {row[1]: row for row in flag_table(p)}
    for name, rows in parsers.items():
        for other, other_rows in parsers.items():
            for dest in rows.keys() & other_rows.keys():
                assert rows[dest] == other_rows[dest], (name, other, dest)
    assert set(parsers["grpo"]) == set(parsers["ppo"]) and len(parsers["grpo"]) > 30
    assert {"rollout_batch_size", "generate_max_len", "vllm", "ray", "eval_steps"} <= set(parsers["distill"])


@pytest.mark.parametrize("family", families.FAMILIES)
def test_prompts_and_reward_model_scores_are_the_same(family_dirs, family, tmp_path):
    """load_prompts (the prompt tokenized as generation sees it, too-long ones dropped) and rm_scores (a reward
    model's score at each completion's EOS) of every RL script's copy, with and without the chat template."""
    from transformers import AutoModelForSequenceClassification

    from test_families import family_args

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(f'{{"input": "{a}+{b}=", "label": "{a + b}"}}\n' for a, b in [(12, 34), (7, 5), (99, 1)])
                    + '{"input": "' + " ".join(map(str, range(400))) + '", "label": "x"}\n')  # too long: dropped
    for chat in ([False, True] if family in CHAT else [False]):
        args = family_args(family, apply_chat_template=chat, prompt_max_len=200, input_key="input", seed=42,
                           input_template=None)
        tok = common.load_tokenizer(family_dirs[family] / "model", args)
        runs = {m.__name__: m.load_prompts(str(data), "train", tok, args) for m in rl_modules()}
        for name, records in runs.items():
            assert [(r["ids"].tolist(), r["text"], r["label"], r["input"]) for r in records] == \
                [(r["ids"].tolist(), r["text"], r["label"], r["input"]) for r in runs["grpo"]], (name, chat)
        assert [r["label"] for r in runs["grpo"]] == ["46", "12", "100"]
    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_pretrained(family_dirs[family] / "model", num_labels=1).eval()
    rm.resize_token_embeddings(len(tok), mean_resizing=False)
    rm.config.pad_token_id = tok.pad_token_id
    pairs = [(r["ids"], torch.tensor(tok("46", add_special_tokens=False)["input_ids"] + e))
             for r, e in zip(runs["grpo"], [[tok.eos_token_id], [], [tok.eos_token_id]])]  # one without its EOS
    scores = {m.__name__: m.rm_scores(rm, pairs, tok, 2).tolist() for m in (grpo, ppo, online_dpo, make_pairs())}
    for name, got in scores.items():
        assert got == scores["grpo"], name
    assert scores["grpo"][1] == pytest.approx(rm_score_with_eos(rm, pairs[1], tok), abs=1e-6)  # padded: ~1e-8


def make_pairs():
    import make_pairs as module

    return module


@torch.no_grad()
def rm_score_with_eos(rm, pair, tok):
    """A completion without EOS is scored with one appended, as rm.py trains: the stock head on the whole sequence."""
    ids = torch.cat([pair[0], pair[1], torch.tensor([tok.eos_token_id])])[None]
    return rm(input_ids=ids).logits[0, 0].item()
