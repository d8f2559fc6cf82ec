"""The toy demo: build the toy world, then run each stage as a user would, and print what it measured.

    python demo.py              # (or `make demo`, which first sets up .venv)

Stages run as plain commands (shown as they start), each from the previous stage's output:
    python sft.py                       -> runs/sft         held-out exact match of greedy answers
    python rm.py --pretrain runs/sft    -> runs/rm          held-out pair accuracy (chosen scored higher)
    python sft.py --dataset toy_world/steps_train.jsonl ... -> runs/sft_steps   a policy that writes
                                                            running sums step by step (exact match)
    python prm.py --pretrain runs/sft_steps -> runs/prm     held-out step accuracy of the judge
    python sft.py --max_epochs 4 ...    -> runs/sft_short   a weaker addition policy (33-51%) for RL to improve
    python grpo.py --pretrain runs/sft_short [--vllm] -> runs/grpo, runs/grpo_vllm
                                                            held-out accuracy before -> after, s/step
    python dpo.py --pretrain runs/sft_short [--online --reward_pretrain runs/rm] -> runs/dpo, runs/dpo_online
                                                            offline on the toy pairs; online on the policy's own
                                                            samples ranked by the RM: held-out exact match, or
                                                            greedy accuracy, before -> after
    python ppo.py --pretrain runs/sft_short --reward_pretrain runs/rm --normalize_reward [--vllm | --ray]
                                        -> runs/ppo, runs/ppo_vllm, runs/ppo_ray (the same, per backend)
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

import toy


def stages(world):
    steps = ["--dataset", f"{world}/steps_train.jsonl", "--eval_dataset", f"{world}/steps_test.jsonl",
             "--learning_rate", "1e-3", "--lr_warmup_ratio", "0.1", "--train_batch_size", "64",
             "--micro_train_batch_size", "64", "--max_len", "64", "--max_epochs", "4", "--eval_generate_samples", "500",
             "--generate_max_len", "48"]
    # PPO trains on the RM's judgement; the toy rule (toy.reward_func) only measures held-out accuracy
    ppo = ["--pretrain", "runs/sft_short", "--reward_pretrain", "runs/rm", "--normalize_reward"]
    return [
        ("SFT", ["sft.py", "--save_path", "runs/sft"], "runs/sft", "eval_exact_match", "held-out exact match"),
        ("RM", ["rm.py", "--pretrain", "runs/sft", "--save_path", "runs/rm"], "runs/rm", "eval_acc",
         "held-out pair accuracy"),
        ("SFT steps", ["sft.py", *steps, "--save_path", "runs/sft_steps"], "runs/sft_steps", "eval_exact_match",
         "held-out exact match (solutions)"),
        ("PRM", ["prm.py", "--pretrain", "runs/sft_steps", "--save_path", "runs/prm"], "runs/prm", "eval_step_acc",
         "held-out step accuracy"),
        # RL needs room to improve: the same SFT stopped after 4 of its 10 epochs
        ("SFT short", ["sft.py", "--max_epochs", "4", "--save_path", "runs/sft_short"], "runs/sft_short",
         "eval_exact_match", "held-out exact match"),
        ("GRPO", ["grpo.py", "--pretrain", "runs/sft_short", "--save_path", "runs/grpo"], "runs/grpo",
         "eval_accuracy", "held-out greedy accuracy"),
        ("GRPO vLLM", ["grpo.py", "--pretrain", "runs/sft_short", "--vllm", "--save_path", "runs/grpo_vllm"],
         "runs/grpo_vllm", "eval_accuracy", "held-out greedy accuracy"),
        ("DPO", ["dpo.py", "--pretrain", "runs/sft_short", "--save_path", "runs/dpo"], "runs/dpo", "eval_exact_match",
         "held-out exact match"),
        ("DPO online", ["dpo.py", "--pretrain", "runs/sft_short", "--online", "--reward_pretrain", "runs/rm",
                        "--save_path", "runs/dpo_online"], "runs/dpo_online", "eval_accuracy", "held-out greedy accuracy"),
        ("PPO", ["ppo.py", *ppo, "--save_path", "runs/ppo"], "runs/ppo", "eval_accuracy", "held-out greedy accuracy"),
        ("PPO vLLM", ["ppo.py", *ppo, "--vllm", "--save_path", "runs/ppo_vllm"], "runs/ppo_vllm", "eval_accuracy",
         "held-out greedy accuracy"),
        ("PPO Ray", ["ppo.py", *ppo, "--ray", "--save_path", "runs/ppo_ray"], "runs/ppo_ray", "eval_accuracy",
         "held-out greedy accuracy"),
    ]


def shown(results, key):
    """The figure, with where RL started from and its time per step when the stage reports them."""
    text = f"{results[key]:.1%}"
    if f"{key}_before" in results:
        text = f"{results[f'{key}_before']:.1%} -> {text}"
    if "generate_s_per_step" in results:
        phases = [k[:-len("_s_per_step")] for k in results if k.endswith("_s_per_step") and results[k] > 0]
        text += "; s/step " + " + ".join(f"{k} {results[f'{k}_s_per_step']:.2f}" for k in phases)
    return text


def main():
    console = Console(width=max(Console().width, 150))  # the table stays readable in logs
    root = Path(__file__).resolve().parent
    t = time.time()
    world = toy.ensure_toy_world()
    rows = [("toy world", "", "", f"{time.time() - t:.1f}", "", os.path.relpath(world))]
    for name, cmd, out, key, what in stages(os.path.relpath(world)):
        console.rule(f"[bold]{name}: python {' '.join(cmd)}")
        t = time.time()
        subprocess.run([sys.executable, str(root / cmd[0]), *cmd[1:]], check=True)
        wall = time.time() - t
        results = json.loads((Path(out) / "eval_results.json").read_text())
        rows.append((name, what, shown(results, key), f"{wall:.1f}", f"{results['peak_rss_mb']:.0f}", out))
    table = Table(title="Toy world: two-digit addition and running sums, 2 CPU cores")
    for col in ("stage", "metric", "value", "wall time (s)", "peak RSS (MB)", "output"):
        table.add_column(col)
    for row in rows:
        table.add_row(*row)
    console.print(table)


if __name__ == "__main__":
    main()
