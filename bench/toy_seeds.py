"""The toy RLHF stages over seeds: what each lifts held-out accuracy by, as a mean and a range, not one run.

    .venv/bin/python bench/toy_seeds.py                          # the start over seeds 0-4, the RL stages 0-2
    .venv/bin/python bench/toy_seeds.py --stages grpo ppo --seeds 0 1 2
    .venv/bin/python bench/toy_seeds.py --table                  # the table of what bench/results/toy_seeds.json holds

Every stage runs demo.py's own command with --seed s and its output under runs/seeds/<s>/. The RL stages all start
from the same policy, demo.py's runs/sft_start (seed 0), and learn from the same inputs (runs/pairs_*.jsonl,
runs/rm_policy); whichever of demo.py's runs are missing are made first, with demo.py's commands. So a stage's spread
is its own, and the start's own spread over seeds is the sft_start row (SFT start trained with each seed), as prm's is
the PRM's (from demo.py's runs/sft_steps). The figure is held-out greedy exact match on the 500 test sums (the PRM's:
held-out step accuracy); an RL stage's start is its own eval before training. Each run's figures go into
bench/results/toy_seeds.json (stage -> seed -> start, end, seconds; runs of other seeds or stages are kept), which
demo.py reads to show each figure's range; the table of start, end and lift (mean, and min to max over the seeds) and
seconds per run is printed at the end. grpo_tool (the tool task, toy_agent.py, from demo.py's runs/sft_tool) also
prints its tool-call rate before and after, and the sampled rate at each logged step; grpo_tool_chat is the same
stage with the task as an agent on the OpenAI chat API (toy_chat_agent.py, --agent_server, its messages rendered by
toy_world/plain_chat.jinja into the same tokens): not a demo.py stage (~9 min a run on 2 cores, against ~2: each
model call goes through the openai client and the HTTP endpoint).
"""

import argparse
import datetime
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

RESULTS = ROOT / "bench" / "results" / "toy_seeds.json"
STAGES = {"prm": "PRM", "sft_start": "SFT start", "grpo": "GRPO", "grpo_vllm": "GRPO vLLM", "distill": "Distill",
          "dpo": "DPO", "dpo_online": "DPO online", "ppo": "PPO", "ppo_vllm": "PPO vLLM", "ppo_ray": "PPO Ray",
          "grpo_tool": "GRPO tool", "grpo_tool_chat": "GRPO tool chat"}  # --stages name -> demo.py's stage, its order
# demo.py's runs each stage starts from or learns from, in demo.py's order (RM policy learns from SFT and the pairs)
RM_POLICY = ["SFT", "SFT start", "Pairs", "Pairs held out", "RM policy"]
INPUTS = {"sft_start": [], "grpo": ["SFT start"], "grpo_vllm": ["SFT start"], "ppo": RM_POLICY, "ppo_vllm": RM_POLICY,
          "ppo_ray": RM_POLICY, "dpo": ["SFT start", "Pairs"], "dpo_online": RM_POLICY, "distill": ["SFT", "SFT start"],
          "prm": ["SFT steps"], "grpo_tool": ["SFT start", "SFT tool"], "grpo_tool_chat": ["SFT start", "SFT tool"]}


def run(cmd):
    """-> (seconds, the run's log)."""
    t = time.time()
    proc = subprocess.run([sys.executable, *map(str, cmd)], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{next(c for c in cmd if str(c).endswith('.py'))} failed:\n{proc.stderr[-3000:]}")
    return time.time() - t, proc.stdout + proc.stderr


def spread(values, sign=""):
    return f"{100 * statistics.mean(values):{sign}.1f} ({100 * min(values):{sign}.1f} to {100 * max(values):{sign}.1f})"


def save(stage, seed, figures):
    """Keep one run's figures in the results file: read again and replaced whole (os.replace), so a sweep beside this
    one keeps its runs and an interrupted write leaves the file as it was."""
    saved = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {"stages": {}}
    saved["stages"].setdefault(stage, {})[str(seed)] = figures
    tmp = RESULTS.with_suffix(".tmp")
    tmp.write_text(json.dumps(saved, indent=1) + "\n")
    os.replace(tmp, RESULTS)
    return saved


def table(stages):
    """The Markdown table of bench/results/toy_seeds.json's stages (demo.py's order): start, end and lift, each a mean
    and its range over the seeds, and mean seconds per run."""
    lines = ["| stage | seeds | start | end | lift | s per run |", "|---|---|---|---|---|---|"]
    for name in (n for n in STAGES.values() if n in stages):
        runs = [stages[name][s] for s in sorted(stages[name], key=int)]
        starts, ends = [r["start"] for r in runs], [r["end"] for r in runs]
        lifts = [e - s for s, e in zip(starts, ends)] if None not in starts else None
        lines.append(f"| {name} | {', '.join(sorted(stages[name], key=int))} | {spread(starts) if lifts else '-'} | "
                     f"{spread(ends)} | {spread(lifts, '+') if lifts else '-'} | "
                     f"{statistics.mean(r['seconds'] for r in runs):.0f} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", help="default: 0-4 for sft_start, 0-2 for the others")
    p.add_argument("--stages", nargs="+", default=[s for s in STAGES if s != "grpo_tool_chat"], choices=list(STAGES))
    p.add_argument("--table", action="store_true", help="print the table of the results file and stop")
    p.add_argument("--logprob_chunk", type=int, help="run with common.LOGPROB_CHUNK = N (the script's own process: "
                   "not vLLM's or Ray's): the same math rounded another way, the losses summed N tokens at a time (a "
                   "toy micro-batch has a few hundred: take 16); its figures are printed, not saved")
    p.add_argument("--demo_seed", action="store_true",
                   help=f"take demo.py's last run (runs/demo.json) as seed {demo.SEED} of its stages, not run again")
    args = p.parse_args()
    saved = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {"stages": {}}
    if args.table:
        return print(table(saved["stages"]))
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
    where = {"date": datetime.date.today().isoformat(), "cpu": demo.cpu(), "cores": os.cpu_count()}
    taken = set()  # the stages whose seed-0 run is the demo's
    if args.demo_seed and not args.logprob_chunk:  # the same commands as a run here would be, where demo.py seeds them
        for name, done in json.loads(Path("runs/demo.json").read_text()).items():
            cmd = stages[name][0] if name in STAGES.values() else []
            if cmd == done["command"] and "--seed" in cmd and cmd[cmd.index("--seed") + 1] == str(demo.SEED):
                saved = save(name, demo.SEED, {"start": done["start"], "end": done["end"],
                                               "seconds": done["seconds"], **where})
                taken.add(name)
    for name in args.stages:
        for seed in args.seeds or ([0, 1, 2, 3, 4] if name == "sft_start" else [0, 1, 2]):
            if seed == demo.SEED and STAGES[name] in taken:
                continue
            cmd, _, key = stages[STAGES[name]]
            out = Path("runs", "seeds", f"chunk{args.logprob_chunk}" if args.logprob_chunk else "", str(seed), name)
            cmd = [c for i, c in enumerate(cmd) if c not in ("--save_path", "--seed") and
                   not (i > 0 and cmd[i - 1] in ("--save_path", "--seed"))]
            if args.logprob_chunk:  # the script run as its own __main__, in this interpreter's common, chunk changed
                cmd = ["-c", f"import common, runpy, sys; common.LOGPROB_CHUNK = {args.logprob_chunk}; "
                       "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')", *cmd]
            wall, log = run([*cmd, "--save_path", out, "--seed", seed])
            res = json.loads((out / "eval_results.json").read_text())
            if not args.logprob_chunk:  # after every run: a long sweep keeps what it did
                saved = save(STAGES[name], seed, {"start": res.get(f"{key}_before"), "end": res[key],
                                                  "seconds": round(wall, 1), **where})
            start = f"{100 * res[f'{key}_before']:.1f}% -> " if f"{key}_before" in res else ""
            print(f"seed {seed} {name}: {start}{100 * res[key]:.1f}% in {wall:.0f} s", flush=True)
            if "eval_asked" in res:  # the tool task: how often the policy asks, greedy (eval) and sampled (train)
                curve = [line.split(" asked=")[1].split()[0] for line in log.splitlines()
                         if line.startswith("train step") and " asked=" in line]
                print(f"  tool calls (eval): {100 * res['eval_asked_before']:.0f}% -> {100 * res['eval_asked']:.0f}%;"
                      f" sampled, at each logged step: {' '.join(curve)}", flush=True)
    print(f"\nheld-out accuracy %: mean (min to max) over the seeds; {RESULTS.relative_to(ROOT)}")
    print(table(saved["stages"]))


if __name__ == "__main__":
    main()
