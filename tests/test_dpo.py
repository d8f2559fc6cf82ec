"""dpo.py: the loss of each type against float64 closed forms (values and gradients), the sequence log-probs against
a float64 sum over a stock model's per-token log-probs (padded and packed), the LoRA reference against the base
model, the first update against Adam's first step on a float64 gradient recomputed from the samples the reward saw,
and end to end: offline (ZeRO-0 with exact resume, two processes ZeRO-3 with packing and LoRA), online (HF generate
with a reward model, vLLM with a reward function, Ray), every reported eval figure recomputed with stock classes;
bad input stops with one line."""
import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

import common
import dpo
from conftest import ROOT, results, run_script, script_args, stock_accuracy, stock_eval_reward, weights

BETA = 0.3


# ---------------------------------------------------------------------------------------------- the loss
def closed_form(delta, loss_type, smoothing, beta=BETA):
    """The loss of one pair and its derivative in delta, written out in float64."""
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    if loss_type == "sigmoid":
        loss = -(1 - smoothing) * math.log(sig(beta * delta)) - smoothing * math.log(sig(-beta * delta))
        return loss, -(1 - smoothing) * beta * sig(-beta * delta) + smoothing * beta * sig(beta * delta)
    if loss_type == "ipo":
        return (delta - 1 / (2 * beta)) ** 2, 2 * (delta - 1 / (2 * beta))
    return max(0.0, 1 - beta * delta), -beta if 1 - beta * delta > 0 else 0.0


@pytest.mark.parametrize("loss_type, smoothing", [("sigmoid", 0.0), ("sigmoid", 0.2), ("ipo", 0.0), ("hinge", 0.0)])
def test_dpo_loss_and_its_gradients_match_closed_forms(loss_type, smoothing):
    g = torch.Generator().manual_seed(0)
    logps = [torch.randn(16, generator=g, dtype=torch.float64) * 4 - 6 for _ in range(4)]
    inputs = [x.clone().float().requires_grad_() for x in logps]  # chosen, rejected, ref_chosen, ref_rejected
    loss, chosen_rewards, rejected_rewards = dpo.dpo_loss(*inputs, beta=BETA, loss_type=loss_type,
                                                          label_smoothing=smoothing)
    loss.backward()
    c, r, rc, rr = logps
    deltas = ((c - rc) - (r - rr)).tolist()
    if loss_type == "hinge":  # both sides of the hinge are exercised
        assert min(deltas) < 1 / BETA < max(deltas)
    forms = [closed_form(d, loss_type, smoothing) for d in deltas]
    assert loss.item() == pytest.approx(sum(f[0] for f in forms) / len(forms), rel=1e-6)
    slope = torch.tensor([f[1] for f in forms], dtype=torch.float64) / len(forms)  # d mean / d delta, per pair
    for x, sign in zip(inputs, (1, -1, -1, 1)):  # delta = chosen - ref_chosen - rejected + ref_rejected
        torch.testing.assert_close(x.grad.double(), sign * slope, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(chosen_rewards.double(), BETA * (c - rc), atol=1e-5, rtol=0)
    torch.testing.assert_close(rejected_rewards.double(), BETA * (r - rr), atol=1e-5, rtol=0)
    assert not chosen_rewards.requires_grad and not rejected_rewards.requires_grad


def test_dpo_loss_errors():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="unknown loss_type 'kto'"):
        dpo.dpo_loss(x, x, x, x, loss_type="kto")
    with pytest.raises(ValueError, match="label_smoothing is conservative DPO's"):
        dpo.dpo_loss(x, x, x, x, loss_type="ipo", label_smoothing=0.1)


def test_micro_batches_cover_every_pair_once_in_fixed_counts():
    for n in (0, 1, 5, 24, 25):
        layout = dpo.micro_batches(n, updates=2, gas=3)
        assert len(layout) == 2 and all(len(update) == 3 for update in layout)  # the same forwards on every rank
        flat = [i for update in layout for mb in update for i in mb]
        assert flat == list(range(n))
        sizes = [len(mb) for update in layout for mb in update]
        assert max(sizes) - min(sizes) <= 1 and max(sizes) <= math.ceil(n / 6)


# ------------------------------------------------------------------------------------------ log-probs
@pytest.fixture(scope="module")
def triples(policy):
    """(prompt, chosen, rejected): prompts of 7, 5 and 10 tokens, responses of 1 to 6 tokens."""
    tok = AutoTokenizer.from_pretrained(policy)
    prompts = [torch.tensor(tok(text)["input_ids"]) for text in ("12+34=", "7+8=", "123+4567=")]
    g = torch.Generator().manual_seed(0)
    responses = [torch.randint(4, len(tok), (n,), generator=g) for n in (4, 1, 6, 2, 3, 5)]
    return [(p, responses[2 * i], responses[2 * i + 1]) for i, p in enumerate(prompts)], tok.pad_token_id


def naive_logps(model, triples):
    """Each (prompt + response) alone through the stock model, log_softmax in float64 over the whole vocabulary,
    the response tokens' log-probs summed: [(chosen, rejected)] with their graphs."""
    def logp(p, r):
        logits = model(torch.cat([p, r])[None]).logits[0, len(p) - 1:len(p) + len(r) - 1].double()
        return torch.log_softmax(logits, -1)[torch.arange(len(r)), r].sum()
    return [(logp(p, c), logp(p, r)) for p, c, r in triples]


def float64_model(path, attention):
    common.register_packed_sdpa()
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation=attention).double()


@pytest.mark.parametrize("chunk", [1024, 4], ids=["one_chunk", "chunks_of_4"])
@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_pair_logps_equal_a_float64_sum_over_response_tokens(policy, triples, packing, chunk, monkeypatch):
    pairs, pad_id = triples
    monkeypatch.setattr(dpo, "LOGPROB_CHUNK", chunk)
    model = float64_model(policy, "packed_sdpa" if packing else "sdpa")
    row = []  # the tokens the forward runs: packed, each prompt once, shared by its chosen and rejected
    model.get_input_embeddings().register_forward_hook(lambda m, inp, out: row.append(inp[0].shape))
    chosen, rejected, chosen_len, rejected_len, _ = dpo.pair_logps(model, pairs, pad_id, packing)
    if packing:
        assert row == [(1, sum(len(p) + len(c) + len(r) for p, c, r in pairs))]
    assert chosen_len.tolist() == [len(c) for _, c, _ in pairs] and rejected_len.tolist() == [len(r) for *_, r in pairs]
    reference = float64_model(policy, "sdpa")
    expected = naive_logps(reference, pairs)
    torch.testing.assert_close(chosen, torch.stack([c for c, _ in expected]), atol=1e-9, rtol=0)
    torch.testing.assert_close(rejected, torch.stack([r for _, r in expected]), atol=1e-9, rtol=0)
    # the gradient of a loss made of them (packed: a prompt's gradient summed once instead of per copy, rounded in
    # the float32 RMSNorm)
    ours = torch.autograd.grad((chosen - 2 * rejected).sum(), list(model.parameters()))
    theirs = torch.autograd.grad(sum(c - 2 * r for c, r in expected), list(reference.parameters()))
    for g, ref_g in zip(ours, theirs):
        torch.testing.assert_close(g, ref_g, atol=1e-6 * ref_g.abs().max().item() + 1e-12, rtol=0)


@torch.no_grad()
def test_lora_reference_is_the_base_model(policy, triples, tokenizer):
    pairs, pad_id = triples
    args = script_args(lora_rank=4, lora_alpha=8, lora_dropout=0.0, target_modules=["all-linear"])
    tok = common.load_tokenizer(policy, args)
    model = common.load_model(policy, args, tok).eval()
    for name, p in model.named_parameters():
        if "lora_B" in name:  # trained adapters: B starts at zero, which would hide a reference that keeps them
            p.normal_(0, 0.05)
    adapted = dpo.pair_logps(model, pairs, pad_id, False)[:2]
    with dpo.adapters_off(model) as base:
        off = dpo.pair_logps(base, pairs, pad_id, False)[:2]
    again = dpo.pair_logps(model, pairs, pad_id, False)[:2]
    stock = naive_logps(AutoModelForCausalLM.from_pretrained(policy).eval(), pairs)  # a fresh load, no adapters
    for i, x in enumerate(off):
        torch.testing.assert_close(x.double(), torch.stack([s[i] for s in stock]), atol=1e-4, rtol=0)
        assert (adapted[i] - x).abs().max() > 1e-2  # the adapters do change the policy
        torch.testing.assert_close(again[i], adapted[i], atol=0, rtol=0)  # and are back on after the block


# ------------------------------------------------------------------------------------------------ data
def test_tokenize_pair_prompt_as_generation_sees_it(tokenizer):
    args = script_args(input_key="input", chosen_key="chosen", rejected_key="rejected", apply_chat_template=False)
    prompt, chosen, rejected = dpo.tokenize_pair({"input": "12+34=", "chosen": "46", "rejected": "47"}, tokenizer,
                                                 args, "x")
    assert prompt.tolist() == tokenizer("12+34=")["input_ids"]  # as common.load_prompts tokenizes it
    assert chosen.tolist() == tokenizer("46", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert rejected.tolist() == tokenizer("47", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    args.apply_chat_template = True  # the toy template writes "\n" after the eos: not part of the response
    conv = [{"role": "user", "content": "12+34="}]
    for record in ({"input": "12+34=", "chosen": "46", "rejected": "47"},
                   {"input": conv, "chosen": [{"role": "assistant", "content": "46"}], "rejected": "47"}):
        prompt, chosen, _ = dpo.tokenize_pair(record, tokenizer, args, "x")
        text = tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        assert prompt.tolist() == tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(chosen) == "46" + tokenizer.eos_token
    args.input_key = ""  # whole conversations, differing in the last turn
    prompt, chosen, rejected = dpo.tokenize_pair(
        {"chosen": conv + [{"role": "assistant", "content": "46"}],
         "rejected": conv + [{"role": "assistant", "content": "47"}]}, tokenizer, args, "x")
    assert tokenizer.decode(prompt) == tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(rejected) == "47" + tokenizer.eos_token
    args.input_key = "input"  # a response that repeats the prompt's turn (UltraFeedback's layout) wants --input_key ''
    with pytest.raises(SystemExit, match="x: a chosen or rejected conversation that repeats the prompt"):
        dpo.tokenize_pair({"input": "12+34=", "chosen": conv + [{"role": "assistant", "content": "46"}],
                           "rejected": "47"}, tokenizer, args, "x")
    args.apply_chat_template = False
    with pytest.raises(SystemExit, match="x: chat messages need --apply_chat_template"):
        dpo.tokenize_pair({"input": conv, "chosen": "46", "rejected": "47"}, tokenizer, args, "x")


# ------------------------------------------------------------------------------------------- the update
RECORDER = """
import json, os
def reward_func(queries, prompts, labels):
    # a prompt's two samples are consecutive: on rank 0 the first 3 pairs of two different numbers score as those
    # numbers, every other pair ties (-1, -1), and so does every pair on rank 1; each call is appended to a file
    answers = [q[len(p):] for q, p in zip(queries, prompts)]
    rewards, decided, rank = [-1.0] * len(answers), 0, int(os.environ["RANK"])
    for i in range(0, len(answers), 2):
        a, b = answers[i:i + 2]
        if rank == 0 and decided < 3 and a.isdigit() and b.isdigit() and int(a) != int(b):
            rewards[i:i + 2], decided = [float(a), float(b)], decided + 1
    with open(os.environ["RECORD_FILE"], "a") as f:
        f.write(json.dumps({"rank": rank, "prompts": prompts, "answers": answers, "rewards": rewards}) + "\\n")
    return rewards
"""


@pytest.mark.parametrize("nproc", [1, 2], ids=["one_process", "two_processes_zero3"])
def test_first_online_step_is_adams_first_step_on_the_mean_over_kept_pairs(policy, tmp_path, monkeypatch, nproc):
    """One online step, 16 prompts a rank in two micro-batches of 8, 13 ties dropped: the 3 pairs kept split 2 + 1
    (and with two processes under ZeRO-3, rank 1 has only ties: two micro-batches of weight 0). Adam's first step
    moves each weight by about lr against the sign of its gradient (m / sqrt(v) = g / |g|), so the saved model is
    the starting one moved by -lr * g / (|g| + eps), g the (clipped) float64 gradient of the mean DPO loss over the 3
    pairs, recomputed here from the samples the reward function saw. A mean of micro-batch means weighs the lone
    pair twice, and gives other signs."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"input": f"{a:02d}+{b:02d}="}) + "\n"
                            for a, b in zip(range(32), range(5, 165, 5))))
    (tmp_path / "recorder.py").write_text(RECORDER)
    monkeypatch.setenv("RECORD_FILE", str(tmp_path / "calls.jsonl"))
    lr, max_len, prompts = 1e-4, 6, 16 * nproc
    run_script("dpo.py", "--pretrain", policy, "--online", "--dataset", data, "--max_samples", prompts,
               "--remote_rm_url", tmp_path / "recorder.py", "--rollout_batch_size", prompts, "--train_batch_size",
               prompts, "--micro_train_batch_size", 8, "--generate_max_len", max_len, "--learning_rate", lr,
               "--lr_scheduler", "constant", "--lr_warmup_ratio", 0, "--beta", BETA,
               "--zero_stage", 3 if nproc > 1 else 0, "--save_path", tmp_path / "out", nproc=nproc)
    calls = sorted((json.loads(line) for line in open(tmp_path / "calls.jsonl")), key=lambda c: c["rank"])
    assert [c["rank"] for c in calls] == list(range(nproc)) and all(r == -1 for c in calls[1:] for r in c["rewards"])
    call = calls[0]
    tok = AutoTokenizer.from_pretrained(policy)

    def ids(answer):  # one character, one token; a completion shorter than the limit stopped at its EOS
        tokens = tok(answer, add_special_tokens=False)["input_ids"]
        return torch.tensor(tokens + ([tok.eos_token_id] if len(tokens) < max_len else []))

    kept = []
    for i in range(0, 32, 2):
        (a, b), (ra, rb) = call["answers"][i:i + 2], call["rewards"][i:i + 2]
        if ra != rb:
            chosen, rejected = (a, b) if ra > rb else (b, a)
            kept.append((torch.tensor(tok(call["prompts"][i])["input_ids"]), ids(chosen), ids(rejected)))
    assert len(kept) == 3

    model = AutoModelForCausalLM.from_pretrained(policy).double()
    losses = []
    for (c, r), in (naive_logps(model, [triple]) for triple in kept):  # the reference is the starting policy
        losses.append(-F.logsigmoid(BETA * ((c - c.detach()) - (r - r.detach()))))
    names = [n for n, _ in model.named_parameters()]
    mean = dict(zip(names, torch.autograd.grad(sum(losses) / 3, list(model.parameters()), retain_graph=True)))
    micro_means = dict(zip(names, torch.autograd.grad((losses[0] + losses[1]) / 2 + losses[2],
                                                      list(model.parameters()))))
    norm = math.sqrt(sum(g.pow(2).sum().item() for g in mean.values()))
    clip = min(1.0, 1.0 / (norm + 1e-6))  # --max_norm 1, as DeepSpeed clips
    before, after = weights(policy), weights(tmp_path / "out")
    checked = differ = 0
    for name, g in mean.items():
        big = g.abs() > 1e-3 * g.abs().max()  # where a float32 run cannot differ
        moved = (after[name] - before[name]).double()
        step = -lr * g * clip / (g.abs() * clip + 1e-8)  # Adam's first step: -lr g / (|g| + eps)
        torch.testing.assert_close(moved[big], step[big], atol=1e-3 * lr, rtol=0, msg=name)
        checked += big.sum().item()
        differ += (big & (micro_means[name].sign() != g.sign())).sum().item()
    assert checked > 10000 and differ > 100  # the wrong weighting would have failed


# ------------------------------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def pref_files(toy_world, tmp_path_factory):
    """256 training pairs, 48 held-out ones, and the held-out prompts with their chosen answer as the label."""
    root = tmp_path_factory.mktemp("dpo_data")
    train = open(toy_world / "pref_train.jsonl").readlines()[:256]
    held = open(toy_world / "pref_test.jsonl").readlines()[:48]
    (root / "train.jsonl").write_text("".join(train))
    (root / "eval.jsonl").write_text("".join(held))
    (root / "eval_prompts.jsonl").write_text("".join(
        json.dumps({"input": r["input"], "label": r["chosen"]}) + "\n" for r in map(json.loads, held)))
    return root


@torch.no_grad()
def stock_pair_eval(policy_path, ref_path, eval_file, beta, loss_type="sigmoid", smoothing=0.0):
    """DPO's held-out accuracy, margin and loss, recomputed with stock classes in float64, one pair at a time (IPO on
    per-token mean log-probs)."""
    model = AutoModelForCausalLM.from_pretrained(policy_path).double().eval()
    ref = AutoModelForCausalLM.from_pretrained(ref_path).double().eval()
    tok = AutoTokenizer.from_pretrained(ref_path)
    accuracy, margin, loss, records = [], [], [], [json.loads(line) for line in open(eval_file)]
    for r in records:
        prompt = torch.tensor(tok(r["input"])["input_ids"])
        chosen, rejected = (torch.tensor(tok(r[k], add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
                            for k in ("chosen", "rejected"))
        (c, rj), = naive_logps(model, [(prompt, chosen, rejected)])
        (rc, rr), = naive_logps(ref, [(prompt, chosen, rejected)])
        if loss_type == "ipo":
            c, rc, rj, rr = c / len(chosen), rc / len(chosen), rj / len(rejected), rr / len(rejected)
        chosen_reward, rejected_reward = beta * (c - rc).item(), beta * (rj - rr).item()
        accuracy.append(chosen_reward > rejected_reward)
        margin.append(chosen_reward - rejected_reward)
        loss.append(closed_form((chosen_reward - rejected_reward) / beta, loss_type, smoothing, beta)[0])
    n = len(records)
    return sum(accuracy) / n, sum(margin) / n, sum(loss) / n


OFFLINE = ["--max_samples", 256, "--train_batch_size", 64, "--logging_steps", 1, "--eval_generate_samples", 48,
           "--learning_rate", 2e-5, "--beta", 0.5]  # 4 steps


def check_pair_eval(res, policy_path, ref_path, eval_file, loss_type="sigmoid", smoothing=0.0):
    accuracy, margin, loss = stock_pair_eval(policy_path, ref_path, eval_file, 0.5, loss_type, smoothing)
    assert res["eval_accuracy"] == pytest.approx(accuracy, abs=1e-9)
    assert res["eval_margin"] == pytest.approx(margin, rel=1e-4) and res["eval_loss"] == pytest.approx(loss, rel=1e-5)
    assert res["eval_margin"] > 0 and res["eval_accuracy_before"] == 0  # policy = reference: no margin before


def test_offline_zero0_reports_what_stock_models_give_and_resumes_exactly(policy, pref_files, tmp_path):
    data = ["--pretrain", policy, "--dataset", pref_files / "train.jsonl", "--eval_dataset", pref_files / "eval.jsonl",
            "--micro_train_batch_size", 32, "--ckpt_path", tmp_path / "ckpt", "--ref_offload", "--label_smoothing",
            0.1, "--nll_loss_coef", 0.1]
    run_script("dpo.py", *OFFLINE, *data, "--save_path", tmp_path / "a", "--save_steps", 2)
    res = results(tmp_path / "a")
    assert res["steps"] == 4
    check_pair_eval(res, tmp_path / "a", policy, pref_files / "eval.jsonl", smoothing=0.1)
    prompts = pref_files / "eval_prompts.jsonl"
    assert res["eval_exact_match"] == stock_accuracy(tmp_path / "a", prompts)
    assert res["eval_exact_match_before"] == stock_accuracy(policy, prompts)

    shutil.rmtree(tmp_path / "ckpt" / "global_step4")
    (tmp_path / "ckpt" / "latest").write_text("global_step2")
    proc = run_script("dpo.py", *OFFLINE, *data, "--save_path", tmp_path / "b", "--load_checkpoint")
    assert "resumed from" in proc.stdout + proc.stderr
    a, b = weights(tmp_path / "a"), weights(tmp_path / "b")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6


def test_offline_zero3_two_processes_packing_lora_ipo(policy, pref_files, tmp_path):
    """The reference is the base model inside the adapted one (adapters off), partitioned by ZeRO-3; IPO (OpenRLHF's
    flag) on per-token means."""
    run_script("dpo.py", *OFFLINE, "--pretrain", policy, "--dataset", pref_files / "train.jsonl", "--eval_dataset",
               pref_files / "eval.jsonl", "--micro_train_batch_size", 16, "--zero_stage", 3, "--packing_samples",
               "--lora_rank", 8, "--lora_alpha", 16, "--learning_rate", 5e-4, "--ipo", "--save_path", tmp_path / "lora",
               nproc=2)
    assert (tmp_path / "lora" / "adapter_model.safetensors").exists()
    merged = tmp_path / "merged"
    run_script("merge_lora.py", "--model_path", policy, "--lora_path", tmp_path / "lora", "--output_path", merged)
    res = results(tmp_path / "lora")
    check_pair_eval(res, merged, policy, pref_files / "eval.jsonl", loss_type="ipo")
    assert res["eval_exact_match"] == stock_accuracy(merged, pref_files / "eval_prompts.jsonl")


@pytest.fixture(scope="module")
def reward_model(policy, tmp_path_factory):
    out = tmp_path_factory.mktemp("dpo") / "rm"
    run_script("rm.py", "--pretrain", policy, "--max_samples", 256, "--train_batch_size", 32, "--save_path", out)
    return out


ONLINE = ["--online", "--max_samples", 64, "--num_episodes", 1, "--rollout_batch_size", 16, "--train_batch_size", 16,
          "--micro_train_batch_size", 8, "--logging_steps", 1, "--generate_max_len", 6]  # 4 steps


def logged(log, key):
    return [float(line.split(f" {key}=")[1].split()[0]) for line in log.splitlines() if line.startswith("train step")]


def test_online_hf_zero2_with_a_reward_model_and_resume(policy, reward_model, eval_file, tmp_path):
    flags = [*ONLINE, "--pretrain", policy, "--reward_pretrain", reward_model, "--eval_dataset", eval_file,
             "--non_stop_penalty", -5, "--max_epochs", 2, "--zero_stage", 2, "--ckpt_path", tmp_path / "ckpt"]
    proc = run_script("dpo.py", *flags, "--save_path", tmp_path / "out", "--save_steps", 2)
    res, log = results(tmp_path / "out"), proc.stdout + proc.stderr
    assert res["steps"] == 4
    # the first step's figures are taken before its update, against the starting policy: no KL, no margin yet
    assert abs(logged(log, "objective/kl")[0]) < 1e-5 and abs(logged(log, "rewards/margin")[0]) < 1e-5
    assert min(abs(x) for x in logged(log, "objective/kl")[1:]) > 1e-3  # and then the policy moves
    # every prompt gave a pair or a tie; the trained pairs' score margins are positive
    assert all(t + k == 16 for t, k in zip(logged(log, "pairs_tied"), logged(log, "pairs_trained")))
    assert min(logged(log, "objective/scores_margin")) > 0 and len(logged(log, "objective/kl")) == 4
    assert res["eval_accuracy"] == stock_accuracy(tmp_path / "out", eval_file)
    prompts = [json.loads(line)["input"] for line in open(eval_file)]
    assert res["eval_reward"] == pytest.approx(stock_eval_reward(tmp_path / "out", reward_model, prompts), abs=1e-4)
    before, after = weights(policy), weights(tmp_path / "out")
    assert max((after[k] - before[k]).abs().max().item() for k in before) > 1e-4

    # resumed from step 2: the same prompts and samples from there on, so the same final weights
    shutil.rmtree(tmp_path / "ckpt" / "global_step4")
    (tmp_path / "ckpt" / "latest").write_text("global_step2")
    run_script("dpo.py", *flags, "--save_path", tmp_path / "resumed", "--load_checkpoint")
    resumed = weights(tmp_path / "resumed")
    assert max((resumed[k] - after[k]).abs().max().item() for k in after) < 1e-6


def test_online_vllm_with_a_reward_function(policy, eval_file, tmp_path):
    """(--ray hosts the same engine code in a Ray actor: tests/test_grpo_e2e.py and test_ppo_e2e.py run it.)"""
    backend = "--vllm"
    proc = run_script("dpo.py", *ONLINE, "--pretrain", policy, "--remote_rm_url", ROOT / "toy.py", "--label_key",
                      "label", "--eval_dataset", eval_file, "--eval_reward_func", ROOT / "toy.py", backend,
                      "--save_path", tmp_path / "out", timeout=900)
    res, log = results(tmp_path / "out"), proc.stdout + proc.stderr
    assert res["eval_accuracy"] == stock_accuracy(tmp_path / "out", eval_file)  # vLLM's greedy = the stock model's
    assert res["sync_s_per_step"] > 0 and len(logged(log, "accuracy")) == 4  # the reward function's extra logs
    # a 0/1 reward ties whenever both samples are right or both wrong
    assert all(t + k == 16 for t, k in zip(logged(log, "pairs_tied"), logged(log, "pairs_trained")))
    assert sum(logged(log, "pairs_tied")) > 0


# ------------------------------------------------------------------------------------------- bad input
def one_line_error(proc):
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


@pytest.mark.parametrize("record, message", [
    ({"input": "1+2=", "chosen": "3"}, "line 2: missing key 'rejected'"),
    ({"input": "1+2=", "chosen": "3", "rejected": "3"}, "line 2: chosen and rejected are the same response"),
])
def test_bad_pairs_name_the_line(toy_world, tmp_path, record, message):
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps({"input": "1+1=", "chosen": "2", "rejected": "3"}) + "\n" + json.dumps(record) + "\n")
    line = one_line_error(run_script("dpo.py", "--dataset", data, "--save_path", tmp_path / "out", check=False))
    assert str(data) in line and message in line


@pytest.mark.parametrize("flags, message", [
    (["--online"], "--online ranks each prompt's two samples by a reward: give exactly one of --reward_pretrain"),
    (["--vllm"], "--vllm is for --online"),
    (["--ipo", "--loss_type", "hinge"], "--ipo is --loss_type ipo: not with --loss_type hinge"),
    (["--loss_type", "ipo", "--label_smoothing", 0.1], "--label_smoothing is conservative DPO's"),
    (["--lora_rank", 4, "--ref_offload"], "--ref_offload: with --lora_rank the reference is the policy's base"),
    (["--enforce_eager"], "--enforce_eager is for --online"),
    (["--online", "--reward_pretrain", "rm", "--temperature", 0], "--online needs --temperature > 0"),
    (["--online", "--reward_pretrain", "rm", "--enforce_eager"], "--enforce_eager is a vLLM option: add --vllm"),
])
def test_misuse_is_refused_in_one_line(toy_world, tmp_path, flags, message):
    line = one_line_error(run_script("dpo.py", *flags, "--save_path", tmp_path / "out", check=False))
    assert message in line
