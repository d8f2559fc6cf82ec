"""End to end on the toy world, as a user runs it: sft.py, rm.py and prm.py for a few steps, single process
(ZeRO-0, and ZeRO-2 with packing) and two processes (ZeRO-3 under torchrun and the deepspeed launcher,
gloo); what they save reloads with stock classes and reproduces the numbers the scripts reported; a run
killed after a save resumes where it stopped."""
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

import prm
from conftest import ROOT, results, run_main, run_script

# 128 samples, global batch 32 (micro 16 x 2 accumulation on one process, 8 x 2 on two): 4 steps an epoch
SMALL = ["--max_samples", 128, "--train_batch_size", 32, "--max_epochs", 1, "--logging_steps", 1]


@torch.no_grad()
def stock_sft_eval(path, toy_world):
    """Eval loss of the saved SFT model, computed independently: stock class, one sample at a time."""
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    nll, n = 0.0, 0
    for line in open(toy_world / "sft_test.jsonl"):
        r = json.loads(line)
        prompt = tok(r["input"])["input_ids"]
        full = torch.tensor([prompt + tok(r["output"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]])
        logp = torch.log_softmax(model(full).logits[0, :-1].double(), -1)
        targets = full[0, 1:]
        for t in range(len(prompt) - 1, full.size(1) - 1):
            nll -= logp[t, targets[t]].item()
            n += 1
    return nll / n


@torch.no_grad()
def stock_rm_eval(path, toy_world):
    """Pair accuracy and reward mean/std of the saved RM from stock AutoModelForSequenceClassification."""
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    records = [json.loads(line) for line in open(toy_world / "pref_test.jsonl")]

    def score(texts):  # right padding; the stock head finds the last non-pad token (the eos) itself
        enc = tok([t + tok.eos_token for t in texts], return_tensors="pt", padding=True)
        return model(**enc).logits[:, 0].double()

    chosen = torch.cat([score([r["input"] + r["chosen"] for r in records[i:i + 100]]) for i in range(0, 500, 100)])
    rejected = torch.cat([score([r["input"] + r["rejected"] for r in records[i:i + 100]]) for i in range(0, 500, 100)])
    both = torch.cat([chosen, rejected])
    return (chosen > rejected).double().mean().item(), both.mean().item(), both.std(unbiased=False).item(), model


@pytest.mark.parametrize("nproc,zero,packing", [(1, 0, False), (1, 2, True), (2, 3, False)])
def test_sft_then_rm(toy_world, tmp_path, nproc, zero, packing):
    micro = 16 // nproc
    extra = SMALL + ["--zero_stage", zero, "--micro_train_batch_size", micro] + (["--packing_samples"] if packing else [])
    extra += ["--overlap_comm"] if zero == 2 else []  # ZeRO-2's reduction overlapped with the backward
    run_script("sft.py", *extra, "--save_path", tmp_path / "sft", "--eval_generate_samples", 8, nproc=nproc, cwd=tmp_path)
    sft = results(tmp_path / "sft")
    assert sft["steps"] == 4 and 0 <= sft["eval_exact_match"] <= 1
    umask = os.umask(0)
    os.umask(umask)  # every saved file (the weights too, and the toy world's) readable as any new file here
    saved = list((tmp_path / "sft").iterdir()) + list((toy_world / "model").iterdir())
    assert {f.name: oct(f.stat().st_mode & 0o777) for f in saved} == {f.name: oct(0o666 & ~umask) for f in saved}
    # the saved weights (gathered from ZeRO-3 shards when sharded) reproduce the reported eval loss
    assert math.isclose(stock_sft_eval(tmp_path / "sft", toy_world), sft["eval_loss"], rel_tol=1e-4)

    # the two launchers: torchrun above, the deepspeed launcher here
    run_script("rm.py", *extra, "--pretrain", tmp_path / "sft", "--save_path", tmp_path / "rm", nproc=nproc,
               launcher="deepspeed", cwd=tmp_path)
    rm = results(tmp_path / "rm")
    acc, mean, std, model = stock_rm_eval(tmp_path / "rm", toy_world)
    assert math.isclose(acc, rm["eval_acc"], abs_tol=1e-9)
    assert math.isclose(mean, rm["eval_reward_mean"], rel_tol=1e-4, abs_tol=1e-5)
    assert math.isclose(std, rm["eval_reward_std"], rel_tol=1e-4)
    assert math.isclose(model.config.mean, mean, rel_tol=1e-4, abs_tol=1e-5) and math.isclose(model.config.std, std, rel_tol=1e-4)
    assert model.config.pad_token_id != model.config.eos_token_id


def final_weights(path):
    return AutoModelForCausalLM.from_pretrained(path).state_dict()


def test_kill_after_save_then_resume_matches_uninterrupted_run(toy_world, tmp_path):
    # 40 steps with a checkpoint after each; kill -9 as soon as one exists, resume, compare with a run
    # that was never interrupted: model, optimizer, schedule and data position must all come back.
    args = ["--max_samples", 320, "--train_batch_size", 16, "--micro_train_batch_size", 8, "--max_epochs", 2,
            "--eval_dataset", "", "--logging_steps", 1]
    run_main("sft.py", *args, "--save_path", tmp_path / "full", cwd=tmp_path)

    ckpt = tmp_path / "run_checkpoints"
    cmd = [sys.executable, str(ROOT / "sft.py"), *map(str, args), "--save_path", str(tmp_path / "run"), "--save_steps", "1"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not (ckpt / "latest").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    assert not (tmp_path / "run" / "config.json").exists()
    saved = int((ckpt / "latest").read_text().strip()[len("global_step"):])
    assert 1 <= saved < 40

    out = run_main("sft.py", *args, "--save_path", tmp_path / "run", "--save_steps", 1, "--load_checkpoint",
                   cwd=tmp_path)
    assert f"at step {saved}" in out.stderr
    assert f"train step {saved + 1}:" in out.stderr and f"train step {saved}:" not in out.stderr
    assert len(list(ckpt.glob("global_step*"))) == 3  # --max_ckpt_num
    full, resumed = final_weights(tmp_path / "full"), final_weights(tmp_path / "run")
    for name in full:
        torch.testing.assert_close(resumed[name], full[name], atol=1e-6, rtol=1e-5)


def stock_prm_eval(path, toy_world):
    """Step and solution accuracy of the saved PRM: stock class, score_steps one solution at a time."""
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    steps = correct = solutions_correct = 0
    records = [json.loads(line) for line in open(toy_world / "prm_test.jsonl")]
    for r in records:
        good = [p > 0.5 for p in prm.score_steps(model, tok, r["input"].replace("ки", model.config.placeholder_token))]
        truth = [label == "+" for label in r["label"]]
        steps, correct = steps + len(truth), correct + sum(g == t for g, t in zip(good, truth))
        solutions_correct += all(good) == all(truth)
    return correct / steps, solutions_correct / len(records), model.config


@pytest.mark.parametrize("nproc,zero,packing,soft", [(1, 2, True, True), (2, 3, False, False)])
def test_prm(toy_world, tmp_path, nproc, zero, packing, soft):
    # soft labels as Monte-Carlo estimates would give them; the two-process run uses a placeholder the
    # tokenizer does not know, so the embeddings grow under ZeRO-3
    placeholder = "ки" if soft else "<step>"
    records = [json.loads(line) for line in open(toy_world / "prm_train.jsonl")][:128]
    for r in records:
        r["input"] = r["input"].replace("ки", placeholder)
        r["label"] = [0.875 if x == "+" else 0.125 for x in r["label"]] if soft else r["label"]
    data = tmp_path / "prm.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    test = tmp_path / "prm_test.jsonl"
    test.write_text((toy_world / "prm_test.jsonl").read_text().replace("ки", placeholder))
    extra = SMALL + ["--zero_stage", zero, "--micro_train_batch_size", 16 // nproc] + (
        ["--packing_samples"] if packing else [])
    run_script("prm.py", *extra, "--dataset", data, "--eval_dataset", test, "--placeholder_token", placeholder,
               "--learning_rate", 1e-3, "--max_len", 64, "--save_path", tmp_path / "prm", nproc=nproc, cwd=tmp_path)
    out = results(tmp_path / "prm")
    assert out["steps"] == 4
    step_acc, solution_acc, config = stock_prm_eval(tmp_path / "prm", toy_world)
    assert math.isclose(step_acc, out["eval_step_acc"], abs_tol=1e-9)
    assert math.isclose(solution_acc, out["eval_solution_acc"], abs_tol=1e-9)
    tok = AutoTokenizer.from_pretrained(tmp_path / "prm")
    assert config.placeholder_token == placeholder
    assert config.placeholder_token_id == tok.convert_tokens_to_ids(placeholder) < config.vocab_size
    assert soft or config.placeholder_token_id == len(tok) - 1  # "<step>" was added
    assert config.reward_token_ids == tok.convert_tokens_to_ids(["+", "-"]) and config.reward_tokens == ["+", "-"]
