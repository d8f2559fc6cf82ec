"""The toy RLHF stages over seeds: what each lifts held-out accuracy by, as a mean and a range, not one run.

    .venv/bin/python bench/toy_seeds.py [--seeds 0 1 2] [--stages grpo ppo dpo dpo_online] [--rm runs/rm]

For every seed: sft.py --max_epochs 4 (the demo's SFT short, stopped early so RL has room) with that seed, then
each stage from it with the same seed and the toy defaults, as demo.py runs them. The figure is held-out greedy
exact match on the 500 test sums: the start is each stage's own eval before training (the SFT short's, up to greedy
near-ties decided differently in another batch layout), the end the stage's. The reward model of PPO and online DPO is --rm (demo's runs/rm by default; this script trains it with
rm.py first if it is missing). Outputs go to runs/seeds/<seed>/; a table of start, end and lift (mean, and min to
max over the seeds) and seconds per stage is printed at the end.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = {  # name -> (flags after --pretrain <sft_short>, the eval key of held-out exact match)
    "grpo": (["grpo.py"], "eval_accuracy"),
    "ppo": (["ppo.py", "--reward_pretrain", "{rm}", "--normalize_reward"], "eval_accuracy"),
    "dpo": (["dpo.py"], "eval_exact_match"),
    "dpo_online": (["dpo.py", "--online", "--reward_pretrain", "{rm}"], "eval_accuracy"),
}


def run(cmd):
    t = time.time()
    proc = subprocess.run([sys.executable, *map(str, cmd)], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{cmd[0]} failed:\n{proc.stderr[-3000:]}")
    return time.time() - t


def results(path):
    return json.loads((Path(path) / "eval_results.json").read_text())


def spread(values):
    return f"{100 * statistics.mean(values):.1f} ({100 * min(values):.1f}-{100 * max(values):.1f})"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--stages", nargs="+", default=list(STAGES), choices=list(STAGES))
    p.add_argument("--rm", default="runs/rm", help="the reward model of ppo and dpo_online")
    args = p.parse_args()
    if not (ROOT / args.rm / "config.json").exists():
        print(f"training {args.rm} (sft.py, then rm.py)", flush=True)
        run(["sft.py", "--save_path", "runs/sft"])
        run(["rm.py", "--pretrain", "runs/sft", "--save_path", args.rm])
    figures = {name: [] for name in ["sft_short", *args.stages]}  # (start, end, seconds) per seed
    for seed in args.seeds:
        out = ROOT / "runs" / "seeds" / str(seed)
        short = out / "sft_short"
        wall = run(["sft.py", "--max_epochs", 4, "--seed", seed, "--save_path", short])
        start = results(short)["eval_exact_match"]
        figures["sft_short"].append((start, start, wall))
        for name in args.stages:
            cmd, key = STAGES[name]
            cmd = [c.format(rm=args.rm) for c in cmd]
            wall = run([*cmd, "--pretrain", short, "--seed", seed, "--save_path", out / name])
            res = results(out / name)  # its own eval before training: the SFT short's, but for greedy near-ties
            figures[name].append((res[f"{key}_before"], res[key], wall))
            print(f"seed {seed} {name}: {100 * res[f'{key}_before']:.1f}% -> {100 * res[key]:.1f}% in {wall:.0f} s",
                  flush=True)
    print(f"\n{len(args.seeds)} seeds ({', '.join(map(str, args.seeds))}), held-out exact match %: mean (min-max)")
    print("| stage | start | end | lift | s per run |\n|---|---|---|---|---|")
    for name, rows in figures.items():
        starts, ends, walls = zip(*rows)
        lifts = [e - s for s, e, _ in rows]
        print(f"| {name} | {spread(starts)} | {spread(ends)} | {spread(lifts) if name != 'sft_short' else '-'} | "
              f"{statistics.mean(walls):.0f} |")


if __name__ == "__main__":
    main()
