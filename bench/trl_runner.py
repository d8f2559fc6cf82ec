"""TRL's side of bench/trl_bench.py: one RewardTrainer, SFTTrainer or GRPOTrainer run, timed per optimizer
step. Runs inside the side environment (bench/.trl-venv), never imports our code.

    bench/.trl-venv/bin/python bench/trl_runner.py CONFIG.json   # writes CONFIG's "out" JSON
"""
import json
import re
import resource
import sys
import time

import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback


class StepTimer(TrainerCallback):
    """Wall time at the end of every optimizer step, and the loss (and GRPO's mean completion length, in tokens)
    TRL logs for it."""

    def __init__(self):
        self.times, self.losses, self.completion_lens = [], [], []

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.time())

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])
        if logs and "completions/mean_length" in logs:
            self.completion_lens.append(logs["completions/mean_length"])


def digit_share(completions, **kwargs):
    """The toy bench's reward (bench/digit_reward.py): the share of digits in a completion (varies even for a
    random model)."""
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


def sum_right(completions, label, **kwargs):
    """SmolLM2's (bench/sum_reward.py): 1 when the last integer in the completion is the sum, else 0."""
    last = [re.findall(r"-?\d+", text)[-1:] for text in completions]
    return [float(n == [str(y)]) for n, y in zip(last, label)]


REWARDS = {"digit_reward": digit_share, "sum_reward": sum_right}


def main():
    cfg = json.loads(open(sys.argv[1]).read())
    torch.manual_seed(cfg["seed"])
    torch.set_num_threads(cfg["threads"])
    tokenizer = AutoTokenizer.from_pretrained(cfg["model"])
    data = load_dataset("json", data_files=cfg["data"], split="train")
    common = dict(output_dir=cfg["work"], per_device_train_batch_size=cfg["batch"], gradient_accumulation_steps=1,
                  learning_rate=cfg["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                  adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0, num_train_epochs=1, max_steps=cfg["steps"],
                  logging_steps=1, save_strategy="no", report_to="none", seed=cfg["seed"], bf16=False,
                  gradient_checkpointing=False, dataloader_num_workers=0, disable_tqdm=True, use_cpu=True)
    timer = StepTimer()
    if cfg["task"] == "rm":
        from trl import RewardConfig, RewardTrainer

        model = AutoModelForSequenceClassification.from_pretrained(cfg["model"], num_labels=1)
        model.config.pad_token_id = tokenizer.pad_token_id
        trainer = RewardTrainer(model=model, args=RewardConfig(max_length=cfg["max_len"], **common),
                                train_dataset=data, processing_class=tokenizer, callbacks=[timer])
    elif cfg["task"] == "sft":
        from trl import SFTConfig, SFTTrainer

        model = AutoModelForCausalLM.from_pretrained(cfg["model"])
        model.config.use_cache = False  # padding-free rows are only right without the cache (see STACK.md)
        trainer = SFTTrainer(model=model, args=SFTConfig(max_length=None, padding_free=True,  # rows fit already
                                                         completion_only_loss=True, **common),
                             train_dataset=data, processing_class=tokenizer, callbacks=[timer])
    else:
        from trl import GRPOConfig, GRPOTrainer

        model = AutoModelForCausalLM.from_pretrained(cfg["model"])
        common["per_device_train_batch_size"] = cfg["batch"] * cfg["n"]  # samples per step
        trainer = GRPOTrainer(model=model, reward_funcs=REWARDS[cfg["reward"]], train_dataset=data,
                              processing_class=tokenizer, callbacks=[timer], args=GRPOConfig(
                                  num_generations=cfg["n"], max_completion_length=cfg["gen_len"],
                                  temperature=cfg["temperature"], top_p=1.0, beta=0.0, loss_type="dapo",
                                  scale_rewards="group", num_iterations=1,
                                  use_vllm=False, **common))
    trainer.train()
    out = {"step_end_times": timer.times, "losses": timer.losses, "completion_lens": timer.completion_lens,
           "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    open(cfg["out"], "w").write(json.dumps(out))


if __name__ == "__main__":
    main()
