"""dpo.py: the loss of each type against float64 closed forms (values and gradients), the sequence log-probs against
a float64 sum over a stock model's per-token log-probs (padded and packed), the LoRA reference against the base
model, and end to end (ZeRO-0 with exact resume, two processes ZeRO-3 with packing and LoRA), every reported eval
figure recomputed with stock classes; bad input stops with one line. Online DPO: test_online_dpo.py."""
import json
import math
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import common
import packing
import dpo
from conftest import results, run_main, run_script, script_args, stock_accuracy, weights

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
    packing.register_packed_sdpa()
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation=attention).double()


@pytest.mark.parametrize("chunk", [1024, 4], ids=["one_chunk", "chunks_of_4"])
@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_pair_logps_equal_a_float64_sum_over_response_tokens(policy, triples, packing, chunk, monkeypatch):
    pairs, pad_id = triples
    monkeypatch.setattr(common, "LOGPROB_CHUNK", chunk)
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
    assert prompt.tolist() == tokenizer("12+34=")["input_ids"]  # as online_dpo.load_prompts tokenizes it
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
    # the margin is a difference of fp32 sums of log-probs near -15 (rounding ~1e-6 each): a tiny margin needs abs too
    assert res["eval_margin"] == pytest.approx(margin, rel=1e-4, abs=2e-6)
    assert res["eval_loss"] == pytest.approx(loss, rel=1e-5)
    assert res["eval_margin"] > 0 and res["eval_accuracy_before"] == 0  # policy = reference: no margin before


def test_offline_zero0_reports_what_stock_models_give_and_resumes_exactly(policy, pref_files, tmp_path):
    data = ["--pretrain", policy, "--dataset", pref_files / "train.jsonl", "--eval_dataset", pref_files / "eval.jsonl",
            "--micro_train_batch_size", 32, "--ckpt_path", tmp_path / "ckpt", "--ref_offload", "--label_smoothing",
            0.1, "--nll_loss_coef", 0.1]
    proc = run_main("dpo.py", *OFFLINE, *data, "--save_path", tmp_path / "a", "--save_steps", 2)
    res = results(tmp_path / "a")
    assert res["steps"] == 4
    assert "(step 0: the policy is its reference, so every implicit reward is 0 and each pair ties: accuracy and " \
           "margin 0 by definition)" in proc.stderr  # why eval_accuracy_before is 0
    check_pair_eval(res, tmp_path / "a", policy, pref_files / "eval.jsonl", smoothing=0.1)
    prompts = pref_files / "eval_prompts.jsonl"
    assert res["eval_exact_match"] == stock_accuracy(tmp_path / "a", prompts)
    assert res["eval_exact_match_before"] == stock_accuracy(policy, prompts)

    shutil.rmtree(tmp_path / "ckpt" / "global_step4")
    (tmp_path / "ckpt" / "latest").write_text("global_step2")
    proc = run_main("dpo.py", *OFFLINE, *data, "--save_path", tmp_path / "b", "--load_checkpoint")
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
    run_main("merge_lora.py", "--model_path", policy, "--lora_path", tmp_path / "lora", "--output_path", merged)
    res = results(tmp_path / "lora")
    check_pair_eval(res, merged, policy, pref_files / "eval.jsonl", loss_type="ipo")
    assert res["eval_exact_match"] == stock_accuracy(merged, pref_files / "eval_prompts.jsonl")


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
    line = one_line_error(run_main("dpo.py", "--dataset", data, "--save_path", tmp_path / "out", check=False))
    assert str(data) in line and message in line


@pytest.mark.parametrize("flags, message", [
    (["--online"], "online DPO is online_dpo.py now"),
    (["--ipo", "--loss_type", "hinge"], "--ipo is --loss_type ipo: not with --loss_type hinge"),
    (["--loss_type", "ipo", "--label_smoothing", 0.1], "--label_smoothing is conservative DPO's"),
    (["--lora_rank", 4, "--ref_offload"], "--ref_offload: with --lora_rank the reference is the policy's base"),
])
def test_misuse_is_refused_in_one_line(toy_world, tmp_path, flags, message):
    line = one_line_error(run_main("dpo.py", *flags, "--save_path", tmp_path / "out", check=False))
    assert message in line
