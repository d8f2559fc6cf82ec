"""The toy demo: build the toy world, then run each stage as a user would, and print what it measured.

    python demo.py              # (or `make demo`, which first sets up .venv)

Stages run as plain commands (shown as they start), each from the previous stage's output:
    python sft.py                       -> runs/sft         held-out exact match of greedy answers
    python rm.py --pretrain runs/sft    -> runs/rm          held-out pair accuracy (chosen scored higher) on
                                                            the toy's synthetic pairs (wrong by 1, 2, 10, reversed)
    python sft.py --dataset toy_world/steps_train.jsonl ... -> runs/sft_steps   a policy that writes
                                                            running sums step by step (exact match)
    python prm.py --pretrain runs/sft_steps -> runs/prm     held-out step accuracy of the judge
    python sft.py --max_epochs 4 ...    -> runs/sft_short   a weaker addition policy (36-80% by seed) for RL to improve
    python make_pairs.py --pretrain runs/sft_short --remote_rm_url toy.py ... -> runs/pairs_{train,test}.jsonl
                                                            preferences on the policy's own samples: 8 answers a
                                                            prompt, the toy rule judging (the stand-in labeller),
                                                            every right answer against each distinct wrong one
    python rm.py --pretrain runs/sft --dataset runs/pairs_train.jsonl ... -> runs/rm_policy
                                                            the RM that PPO and online DPO learn from
    python grpo.py --pretrain runs/sft_short [--vllm] -> runs/grpo, runs/grpo_vllm
                                                            held-out accuracy before -> after, s/step
    python distill.py --pretrain runs/sft_short --teacher_pretrain runs/sft --lmbda 1 -> runs/distill
                                                            on-policy distillation: held-out accuracy before -> after
    python dpo.py --pretrain runs/sft_short --dataset runs/pairs_train.jsonl ... -> runs/dpo
    python online_dpo.py --pretrain runs/sft_short --reward_pretrain runs/rm_policy -> runs/dpo_online
                                                            held-out exact match, or greedy accuracy, before -> after
    python ppo.py --pretrain runs/sft_short --reward_pretrain runs/rm_policy --normalize_reward ... [--vllm | --ray]
                                        -> runs/ppo, runs/ppo_vllm, runs/ppo_ray (the same, per backend)
    python sft.py --pretrain runs/sft_short --dataset toy_world/tool_sft_train.jsonl ... -> runs/sft_tool
                                                            the tool task's format: "07+x=" -> "?" (ask) or a guess
    python grpo.py --pretrain runs/sft_tool --agent_func_path toy_agent.py ... -> runs/grpo_tool
                                                            episodes: held-out greedy accuracy before -> after
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
    # InstructGPT's recipe: the preferences come from the policy RL will improve. SFT short samples 8 answers to
    # every prompt, the toy rule judges them (the stand-in for a human labeller), and every two distinct answers it
    # ranks differently are a pair (best against worst alone leaves an RM that PPO exploits: see README). An RM
    # learns those pairs (rm.py's toy defaults are for the synthetic pairs, so the settings are spelled out); PPO
    # and online DPO learn from that RM, offline DPO from the pairs themselves.
    sample = ["make_pairs.py", "--pretrain", "runs/sft_short", "--remote_rm_url", os.path.relpath(toy.__file__),
              "--label_key", "label", "--n_samples_per_prompt", "8", "--pairs", "all", "--prompt_max_len", "16",
              "--generate_max_len", "8"]
    pairs = ["--dataset", "runs/pairs_train.jsonl", "--max_len", "32", "--train_batch_size", "64"]
    rm_policy = ["rm.py", "--pretrain", "runs/sft", *pairs, "--eval_dataset", "runs/pairs_test.jsonl",
                 "--micro_train_batch_size", "32", "--learning_rate", "3e-4", "--lr_warmup_ratio", "0.1",
                 "--max_epochs", "4", "--save_path", "runs/rm_policy"]
    # its eval pairs are the toy's held-out ones: exact match against their chosen answers covers all 500 test sums
    dpo = ["dpo.py", "--pretrain", "runs/sft_short", *pairs, "--eval_dataset", f"{world}/pref_test.jsonl",
           "--micro_train_batch_size", "64", "--learning_rate", "1e-4", "--lr_warmup_ratio", "0.05", "--beta", "0.5",
           "--eval_generate_samples", "500", "--generate_max_len", "5", "--save_path", "runs/dpo"]
    # 8 samples a prompt (GRPO's number; 8 optimizer steps a rollout): with a judge it cannot exploit, PPO can push
    # harder than the toy defaults (one sample) do
    ppo = ["--pretrain", "runs/sft_short", "--reward_pretrain", "runs/rm_policy", "--normalize_reward",
           "--n_samples_per_prompt", "8"]
    # a short SFT in the tool format from SFT short (asks 30% of the time, else guesses), then GRPO on episodes
    tool_sft = ["--dataset", f"{world}/tool_sft_train.jsonl", "--eval_dataset", f"{world}/tool_sft_test.jsonl",
                "--learning_rate", "5e-4", "--lr_warmup_ratio", "0.05", "--train_batch_size", "64",
                "--micro_train_batch_size", "64", "--max_len", "32", "--eval_generate_samples", "1000",
                "--generate_max_len", "5"]
    tool = ["--agent_func_path", "toy_agent.py", "--dataset", f"{world}/tool_train.jsonl", "--eval_dataset",
            f"{world}/tool_test.jsonl", "--label_key", "label", "--prompt_max_len", "16", "--generate_max_len", "16",
            "--rollout_batch_size", "32", "--n_samples_per_prompt", "8", "--train_batch_size", "256",
            "--micro_train_batch_size", "64", "--micro_rollout_batch_size", "64", "--learning_rate", "5e-5",
            "--lr_warmup_ratio", "0.05", "--max_samples", "6400", "--eval_steps", "50"]
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
        ("Pairs", [*sample, "--dataset", f"{world}/prompts_train.jsonl", "--save_path", "runs/pairs_train.jsonl"],
         "runs/pairs_train.jsonl", None, "pairs from the policy's samples"),
        ("Pairs held out",
         [*sample, "--dataset", f"{world}/prompts_test.jsonl", "--save_path", "runs/pairs_test.jsonl"],
         "runs/pairs_test.jsonl", None, "pairs from the policy's samples"),
        ("RM policy", rm_policy, "runs/rm_policy", "eval_acc", "held-out pair accuracy (policy's pairs)"),
        ("GRPO", ["grpo.py", "--pretrain", "runs/sft_short", "--save_path", "runs/grpo"], "runs/grpo",
         "eval_accuracy", "held-out greedy accuracy"),
        ("GRPO vLLM", ["grpo.py", "--pretrain", "runs/sft_short", "--vllm", "--save_path", "runs/grpo_vllm"],
         "runs/grpo_vllm", "eval_accuracy", "held-out greedy accuracy"),
        # on-policy distillation: SFT short samples, the full SFT (the teacher) scores its tokens
        ("Distill", ["distill.py", "--pretrain", "runs/sft_short", "--teacher_pretrain", "runs/sft", "--lmbda", "1",
                     "--save_path", "runs/distill"], "runs/distill", "eval_accuracy", "held-out greedy accuracy"),
        ("DPO", dpo, "runs/dpo", "eval_exact_match", "held-out exact match"),
        ("DPO online", ["online_dpo.py", "--pretrain", "runs/sft_short", "--reward_pretrain", "runs/rm_policy",
                        "--save_path", "runs/dpo_online"], "runs/dpo_online", "eval_accuracy", "held-out greedy accuracy"),
        ("PPO", ["ppo.py", *ppo, "--save_path", "runs/ppo"], "runs/ppo", "eval_accuracy", "held-out greedy accuracy"),
        ("PPO vLLM", ["ppo.py", *ppo, "--vllm", "--save_path", "runs/ppo_vllm"], "runs/ppo_vllm", "eval_accuracy",
         "held-out greedy accuracy"),
        ("PPO Ray", ["ppo.py", *ppo, "--ray", "--save_path", "runs/ppo_ray"], "runs/ppo_ray", "eval_accuracy",
         "held-out greedy accuracy"),
        # the tool task (toy_agent.py): "07+x=" hides x, which the environment reveals when asked ("?")
        ("SFT tool", ["sft.py", "--pretrain", "runs/sft_short", *tool_sft, "--save_path", "runs/sft_tool"],
         "runs/sft_tool", "eval_exact_match", "held-out exact match (first turn or answer)"),
        ("GRPO tool", ["grpo.py", "--pretrain", "runs/sft_tool", *tool, "--save_path", "runs/grpo_tool"],
         "runs/grpo_tool", "eval_accuracy", "held-out greedy accuracy (episodes)"),
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
        if key is None:  # a file of pairs: how many
            rows.append((name, what, f"{len(Path(out).read_text().splitlines()):,}", f"{wall:.1f}", "", out))
            continue
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
