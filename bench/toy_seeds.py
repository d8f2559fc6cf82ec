"""The toy RLHF stages over seeds: what each lifts held-out accuracy by, as a mean and a range, not one run.

    .venv/bin/python bench/toy_seeds.py [--seeds 0 1 2] [--stages sft_short grpo ppo dpo dpo_online prm grpo_tool]
                                        [--stages grpo_tool grpo_tool_chat]

Every stage runs demo.py's own command with --seed s and its output under runs/seeds/<s>/. The RL stages all start
from the same policy, demo.py's runs/sft_short, and learn from the same inputs (runs/pairs_*.jsonl, runs/rm_policy);
whichever of demo.py's runs are missing are made first, with demo.py's commands. So a stage's spread is its own, and
the start's own spread over seeds is the sft_short row (SFT short trained with each seed), as prm's is the PRM's
(from demo.py's runs/sft_steps). The figure is held-out greedy exact match on the 500 test sums (the PRM's: held-out
step accuracy); an RL stage's start is its own eval before training. A table of start, end and lift (mean, and min
to max over the seeds) and seconds per run is printed at the end. grpo_tool (the tool task, toy_agent.py, from
demo.py's runs/sft_tool) also prints its tool-call rate before and after, and the sampled rate at each logged step;
grpo_tool_chat is the same stage with the task as an agent on the OpenAI chat API (toy_chat_agent.py, --agent_server,
its messages rendered by toy_world/plain_chat.jinja into the same tokens): not a demo.py stage (~9 min a run on 2
cores, against ~2: each model call goes through the openai client and the HTTP endpoint).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import demo  # noqa: E402
import toy  # noqa: E402

STAGES = {"sft_short": "SFT short", "grpo": "GRPO", "ppo": "PPO", "dpo": "DPO", "dpo_online": "DPO online",
          "prm": "PRM", "grpo_tool": "GRPO tool", "grpo_tool_chat": "GRPO tool chat"}  # --stages name -> stage
# demo.py's runs each stage starts from or learns from, in demo.py's order (RM policy learns from SFT and the pairs)
RM_POLICY = ["SFT", "SFT short", "Pairs", "Pairs held out", "RM policy"]
INPUTS = {"sft_short": [], "grpo": ["SFT short"], "ppo": RM_POLICY, "dpo": ["SFT short", "Pairs"],
          "dpo_online": RM_POLICY, "prm": ["SFT steps"], "grpo_tool": ["SFT short", "SFT tool"],
          "grpo_tool_chat": ["SFT short", "SFT tool"]}


def run(cmd):
    """-> (seconds, the run's log)."""
    t = time.time()
    proc = subprocess.run([sys.executable, *map(str, cmd)], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{cmd[0]} failed:\n{proc.stderr[-3000:]}")
    return time.time() - t, proc.stdout + proc.stderr


def spread(values, sign=""):
    return f"{100 * statistics.mean(values):{sign}.1f} ({100 * min(values):{sign}.1f} to {100 * max(values):{sign}.1f})"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--stages", nargs="+", default=list(STAGES), choices=list(STAGES))
    args = p.parse_args()
    os.chdir(ROOT)  # demo.py's commands name their inputs and outputs relative to the repository
    world = os.path.relpath(toy.ensure_toy_world())
    stages = {name: (cmd, out, key) for name, cmd, out, key, _ in demo.stages(world)}
    cmd, out, key = stages["GRPO tool"]
    i = cmd.index("--agent_func_path")
    stages["GRPO tool chat"] = ([*cmd[:i], "--agent_server", "toy_chat_agent.py", "--tokenizer_chat_template",
                                 f"{world}/plain_chat.jinja", *cmd[i + 2:]], f"{out}_chat", key)
    for name in dict.fromkeys(n for stage in args.stages for n in INPUTS[stage]):
        cmd, out, _ = stages[name]
        if not Path(out, "config.json").exists() and not Path(out).is_file():
            print(f"making {out} as demo.py does: python {' '.join(cmd)}", flush=True)
            run(cmd)
    figures = {name: [] for name in args.stages}  # (start or None, end, seconds) per seed
    for seed in args.seeds:
        for name in args.stages:
            cmd, _, key = stages[STAGES[name]]
            out = Path("runs", "seeds", str(seed), name)
            cmd = [*cmd[:cmd.index("--save_path")], *cmd[cmd.index("--save_path") + 2:], "--save_path", out,
                   "--seed", seed]
            wall, log = run(cmd)
            res = json.loads((out / "eval_results.json").read_text())
            figures[name].append((res.get(f"{key}_before"), res[key], wall))
            start = f"{100 * res[f'{key}_before']:.1f}% -> " if f"{key}_before" in res else ""
            print(f"seed {seed} {name}: {start}{100 * res[key]:.1f}% in {wall:.0f} s", flush=True)
            if "eval_asked" in res:  # the tool task: how often the policy asks, greedy (eval) and sampled (train)
                curve = [line.split(" asked=")[1].split()[0] for line in log.splitlines()
                         if line.startswith("train step") and " asked=" in line]
                print(f"  tool calls (eval): {100 * res['eval_asked_before']:.0f}% -> {100 * res['eval_asked']:.0f}%;"
                      f" sampled, at each logged step: {' '.join(curve)}", flush=True)
    print(f"\n{len(args.seeds)} seeds ({', '.join(map(str, args.seeds))}), held-out accuracy %: mean (min to max)")
    print("| stage | start | end | lift | s per run |\n|---|---|---|---|---|")
    for name, rows in figures.items():
        starts, ends, walls = zip(*rows)
        lifts = [e - s for s, e, _ in rows] if None not in starts else None
        print(f"| {name} | {spread(starts) if lifts else '-'} | {spread(ends)} | "
              f"{spread(lifts, '+') if lifts else '-'} | {statistics.mean(walls):.0f} |")


if __name__ == "__main__":
    main()
