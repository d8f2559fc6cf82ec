"""online_dpo.py: the first update against Adam's first step on a float64 gradient of the mean DPO loss over the pairs
kept, recomputed from the samples the reward saw (one process, and two under ZeRO-3 with a rank of ties only); end to
end with HF generate and a reward model (ZeRO-2, exact resume) and with vLLM and a reward function, every reported
eval figure recomputed with stock classes; misuse refused in one line."""
import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import ROOT, logged, max_diff, results, run_main, run_script, stock_accuracy, stock_eval_reward, weights
from test_dpo import BETA, naive_logps, one_line_error

RECORDER = """
import json, os
def reward_func(queries, prompts, labels):
    # a prompt's two samples are consecutive: on rank 0 the first 3 pairs of two different numbers score as those
    # numbers, every other pair ties (-1, -1), and so does every pair on rank 1; each call is appended to a file
    answers = [q[len(p):].removesuffix("</s>") for q, p in zip(queries, prompts)]  # the EOS that ended a sample
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
    run_script("online_dpo.py", "--pretrain", policy, "--dataset", data, "--max_samples", prompts,
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
            kept.append((torch.tensor(tok(call["prompts"][i], add_special_tokens=False)["input_ids"]), ids(chosen),
                         ids(rejected)))  # the prompt as the policy saw it, its BOS included
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
def reward_model(policy, tmp_path_factory):
    out = tmp_path_factory.mktemp("dpo") / "rm"
    run_main("rm.py", "--pretrain", policy, "--max_samples", 256, "--train_batch_size", 32, "--save_path", out)
    return out


ONLINE = ["--max_samples", 64, "--num_episodes", 1, "--rollout_batch_size", 16, "--train_batch_size", 16,
          "--micro_train_batch_size", 8, "--logging_steps", 1, "--generate_max_len", 6]  # 4 steps


def test_online_hf_zero2_with_a_reward_model_and_resume(policy, reward_model, eval_file, tmp_path):
    flags = [*ONLINE, "--pretrain", policy, "--reward_pretrain", reward_model, "--eval_dataset", eval_file,
             "--non_stop_penalty", -5, "--max_epochs", 2, "--zero_stage", 2, "--ckpt_path", tmp_path / "ckpt"]
    proc = run_main("online_dpo.py", *flags, "--save_path", tmp_path / "out", "--save_steps", 2)
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
    assert max_diff(after, before) > 1e-4

    # resumed from step 2: the same prompts and samples from there on, so the same final weights
    shutil.rmtree(tmp_path / "ckpt" / "global_step4")
    (tmp_path / "ckpt" / "latest").write_text("global_step2")
    run_main("online_dpo.py", *flags, "--save_path", tmp_path / "resumed", "--load_checkpoint")
    resumed = weights(tmp_path / "resumed")
    assert max_diff(resumed, after) < 1e-6


def test_online_vllm_with_a_reward_function(policy, eval_file, tmp_path):
    """(--ray hosts the same engine code in a Ray actor: tests/test_grpo_e2e.py and test_ppo_e2e.py run it.)"""
    backend = "--vllm"
    proc = run_script("online_dpo.py", *ONLINE, "--pretrain", policy, "--remote_rm_url", ROOT / "toy.py", "--label_key",
                      "label", "--eval_dataset", eval_file, "--eval_reward_func", ROOT / "toy.py", backend,
                      "--save_path", tmp_path / "out", timeout=900)
    res, log = results(tmp_path / "out"), proc.stdout + proc.stderr
    assert res["eval_accuracy"] == stock_accuracy(tmp_path / "out", eval_file)  # vLLM's greedy = the stock model's
    assert res["sync_s_per_step"] > 0 and len(logged(log, "accuracy")) == 4  # the reward function's extra logs
    # a 0/1 reward ties whenever both samples are right or both wrong
    assert all(t + k == 16 for t, k in zip(logged(log, "pairs_tied"), logged(log, "pairs_trained")))
    assert sum(logged(log, "pairs_tied")) > 0


@pytest.mark.parametrize("flags, message", [
    ([], "online DPO ranks each prompt's two samples by a reward: give exactly one of --reward_pretrain"),
    (["--reward_pretrain", "rm", "--temperature", 0], "argument --temperature: 0 is outside [1e-05, inf)"),
    (["--reward_pretrain", "rm", "--enforce_eager"], "--enforce_eager is a vLLM option: add --vllm"),
    (["--reward_pretrain", "rm", "--ipo", "--loss_type", "hinge"], "--ipo is --loss_type ipo: not with --loss_type hinge"),
])
def test_misuse_is_refused_in_one_line(toy_world, tmp_path, flags, message):
    line = one_line_error(run_main("online_dpo.py", *flags, "--save_path", tmp_path / "out", check=False))
    assert message in line
