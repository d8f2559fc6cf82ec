"""The toy demo: build the toy world, then run each stage as a user would, and print what it measured.

    python demo.py              # (or `make demo`, which first sets up .venv)

Stages run as plain commands (shown as they start), each from the previous stage's output:
    python sft.py                       -> runs/sft         held-out exact match of greedy answers
    python rm.py --pretrain runs/sft    -> runs/rm          held-out pair accuracy (chosen scored higher) on
                                                            the toy's synthetic pairs (wrong by 1, 2, 10, reversed)
    python sft.py --dataset toy_world/steps_train.jsonl ... -> runs/sft_steps   a policy that writes
                                                            running sums step by step (exact match)
    python prm.py --pretrain runs/sft_steps -> runs/prm     held-out step accuracy of the judge
    python sft.py --dataset toy_world/sft_sloppy_train.jsonl ... --seed 0 -> runs/sft_start   the RL stages' start:
                                                            SFT on a careless labeller's sums, who forgets a carry 3
                                                            times in 4 (toy.sloppy): greedy forgets every carry, so
                                                            held-out exact match is about the share of sums without
                                                            one (57.6%)
    python make_pairs.py --pretrain runs/sft_start --remote_rm_url toy.py ... -> runs/pairs_{train,test}.jsonl
                                                            preferences on the policy's own samples: 8 answers a
                                                            prompt, the toy rule judging (the stand-in labeller),
                                                            every right answer against each distinct wrong one
                                                            (best against worst alone leaves an RM that PPO exploits)
    python rm.py --pretrain runs/sft --dataset runs/pairs_train.jsonl,toy_world/pref_train.jsonl ... -> runs/rm_policy
                                                            the RM that PPO and online DPO learn from: the policy
                                                            errs only where a carry is due, so its pairs alone all
                                                            say "ten more is better", and PPO and online DPO learned
                                                            to add ten everywhere (README); the toy's written pairs
                                                            say otherwise
    python grpo.py --pretrain runs/sft_start [--vllm] -> runs/grpo, runs/grpo_vllm
                                                            held-out accuracy before -> after, s/step
    python distill.py --pretrain runs/sft_start --teacher_pretrain runs/sft --lmbda 1 -> runs/distill
                                                            on-policy distillation: held-out accuracy before -> after
    python dpo.py --pretrain runs/sft_start --dataset runs/pairs_train.jsonl --nll_loss_coef 1 ... -> runs/dpo
                                                            the policy's pairs, with the chosen answers' NLL (RPO):
                                                            without it pushing "95" down also pushed down the end
                                                            after "125", which became "1255"
    python online_dpo.py --pretrain runs/sft_start --reward_pretrain runs/rm_policy -> runs/dpo_online
                                                            held-out exact match, or greedy accuracy, before -> after
    python ppo.py --pretrain runs/sft_start --reward_pretrain runs/rm_policy --normalize_reward ... [--vllm | --ray]
                                        -> runs/ppo, runs/ppo_vllm, runs/ppo_ray (the same, per backend)
    python sft.py --pretrain runs/sft_start --dataset toy_world/tool_sft_train.jsonl ... -> runs/sft_tool
                                                            the tool task's format: "07+x=" -> "?" (ask) or a guess
    python grpo.py --pretrain runs/sft_tool --agent_func_path toy_agent.py ... -> runs/grpo_tool
                                                            episodes: held-out greedy accuracy before -> after

The start and the RL stages run with --seed 0. At the end: a table of every figure beside its range over seeds
(bench/results/toy_seeds.json, which bench/toy_seeds.py writes) and whether it lies inside; runs/demo.png, the held-out
figure of every RL stage against its steps; runs/demo.json, the figures; runs/logs/, what each stage printed.
"""

import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

import toy


SEEDS = Path(__file__).resolve().parent / "bench/results/toy_seeds.json"  # bench/toy_seeds.py's: ranges over seeds
SEED = 0  # the start's and the RL stages' seed: toy_seeds.py's first, so on this CPU kind their figures are its own


def stages(world):
    seed = ["--seed", str(SEED)]
    # the RL stages' start, trained to its plateau on toy.sloppy's answers (every flag spelled out: with --dataset a
    # script takes its real-run defaults)
    start = ["sft.py", "--dataset", f"{world}/sft_sloppy_train.jsonl", "--eval_dataset", f"{world}/sft_test.jsonl",
             "--learning_rate", "1e-3", "--lr_warmup_ratio", "0.1", "--train_batch_size", "64",
             "--micro_train_batch_size", "64", "--max_len", "32", "--max_epochs", "8", "--eval_generate_samples",
             "500", "--generate_max_len", "5", *seed, "--save_path", "runs/sft_start"]
    steps = ["--dataset", f"{world}/steps_train.jsonl", "--eval_dataset", f"{world}/steps_test.jsonl",
             "--learning_rate", "1e-3", "--lr_warmup_ratio", "0.1", "--train_batch_size", "64",
             "--micro_train_batch_size", "64", "--max_len", "64", "--max_epochs", "4", "--eval_generate_samples", "500",
             "--generate_max_len", "48"]
    # the policy's own pairs (InstructGPT's recipe; why the RM also learns the toy's written pairs and why DPO adds
    # the chosen answers' NLL: the module docstring)
    sample = ["make_pairs.py", "--pretrain", "runs/sft_start", "--remote_rm_url", os.path.relpath(toy.__file__),
              "--label_key", "label", "--n_samples_per_prompt", "8", "--pairs", "all", "--prompt_max_len", "16",
              "--generate_max_len", "8"]
    pairs = ["--dataset", "runs/pairs_train.jsonl", "--max_len", "32", "--train_batch_size", "64"]
    rm_policy = ["rm.py", "--pretrain", "runs/sft", "--dataset", f"runs/pairs_train.jsonl,{world}/pref_train.jsonl",
                 *pairs[2:], "--eval_dataset", "runs/pairs_test.jsonl",
                 "--micro_train_batch_size", "32", "--learning_rate", "3e-4", "--lr_warmup_ratio", "0.1",
                 "--max_epochs", "4", "--save_path", "runs/rm_policy"]
    # its eval pairs are the toy's held-out ones: exact match against their chosen answers covers all 500 test sums
    dpo = ["dpo.py", "--pretrain", "runs/sft_start", *pairs, "--eval_dataset", f"{world}/pref_test.jsonl",
           "--micro_train_batch_size", "64", "--learning_rate", "1e-4", "--lr_warmup_ratio", "0.05", "--beta", "0.5",
           "--nll_loss_coef", "1", "--eval_generate_samples", "500", "--generate_max_len", "5", "--eval_steps", "24",
           *seed, "--save_path", "runs/dpo"]
    # 8 samples a prompt (GRPO's number; 8 optimizer steps a rollout): with a judge it cannot exploit, PPO can push
    # harder than the toy defaults (one sample) do
    ppo = ["--pretrain", "runs/sft_start", "--reward_pretrain", "runs/rm_policy", "--normalize_reward",
           "--n_samples_per_prompt", "8", *seed]
    # a short SFT in the tool format from SFT start (asks 30% of the time, else guesses), then GRPO on episodes
    tool_sft = ["--dataset", f"{world}/tool_sft_train.jsonl", "--eval_dataset", f"{world}/tool_sft_test.jsonl",
                "--learning_rate", "5e-4", "--lr_warmup_ratio", "0.05", "--train_batch_size", "64",
                "--micro_train_batch_size", "64", "--max_len", "32", "--eval_generate_samples", "1000",
                "--generate_max_len", "5"]
    tool = ["--agent_func_path", "toy_agent.py", "--dataset", f"{world}/tool_train.jsonl", "--eval_dataset",
            f"{world}/tool_test.jsonl", "--label_key", "label", "--prompt_max_len", "16", "--generate_max_len", "16",
            "--rollout_batch_size", "32", "--n_samples_per_prompt", "8", "--train_batch_size", "256",
            "--micro_train_batch_size", "64", "--micro_rollout_batch_size", "64", "--learning_rate", "5e-5",
            "--lr_warmup_ratio", "0.05", "--max_samples", "6400", "--eval_steps", "50", *seed]
    return [
        ("SFT", ["sft.py", "--save_path", "runs/sft"], "runs/sft", "eval_exact_match", "held-out exact match"),
        ("RM", ["rm.py", "--pretrain", "runs/sft", "--save_path", "runs/rm"], "runs/rm", "eval_acc",
         "held-out pair accuracy"),
        ("SFT steps", ["sft.py", *steps, "--save_path", "runs/sft_steps"], "runs/sft_steps", "eval_exact_match",
         "held-out exact match (solutions)"),
        ("PRM", ["prm.py", "--pretrain", "runs/sft_steps", "--save_path", "runs/prm"], "runs/prm", "eval_step_acc",
         "held-out step accuracy"),
        ("SFT start", start, "runs/sft_start", "eval_exact_match", "held-out exact match"),
        ("Pairs", [*sample, "--dataset", f"{world}/prompts_train.jsonl", "--save_path", "runs/pairs_train.jsonl"],
         "runs/pairs_train.jsonl", None, "pairs from the policy's samples"),
        ("Pairs held out",
         [*sample, "--dataset", f"{world}/prompts_test.jsonl", "--save_path", "runs/pairs_test.jsonl"],
         "runs/pairs_test.jsonl", None, "pairs from the policy's samples"),
        ("RM policy", rm_policy, "runs/rm_policy", "eval_acc", "held-out pair accuracy (policy's pairs)"),
        ("GRPO", ["grpo.py", "--pretrain", "runs/sft_start", *seed, "--save_path", "runs/grpo"], "runs/grpo",
         "eval_accuracy", "held-out greedy accuracy"),
        ("GRPO vLLM", ["grpo.py", "--pretrain", "runs/sft_start", "--vllm", *seed, "--save_path",
                       "runs/grpo_vllm"], "runs/grpo_vllm", "eval_accuracy", "held-out greedy accuracy"),
        # on-policy distillation: SFT start samples, the full SFT (the teacher) scores its tokens
        ("Distill", ["distill.py", "--pretrain", "runs/sft_start", "--teacher_pretrain", "runs/sft", "--lmbda", "1",
                     *seed, "--save_path", "runs/distill"], "runs/distill", "eval_accuracy",
         "held-out greedy accuracy"),
        ("DPO", dpo, "runs/dpo", "eval_exact_match", "held-out exact match"),
        ("DPO online", ["online_dpo.py", "--pretrain", "runs/sft_start", "--reward_pretrain", "runs/rm_policy",
                        "--eval_steps", "100", *seed, "--save_path", "runs/dpo_online"], "runs/dpo_online",
         "eval_accuracy", "held-out greedy accuracy"),
        ("PPO", ["ppo.py", *ppo, "--save_path", "runs/ppo"], "runs/ppo", "eval_accuracy", "held-out greedy accuracy"),
        ("PPO vLLM", ["ppo.py", *ppo, "--vllm", "--save_path", "runs/ppo_vllm"], "runs/ppo_vllm", "eval_accuracy",
         "held-out greedy accuracy"),
        ("PPO Ray", ["ppo.py", *ppo, "--ray", "--save_path", "runs/ppo_ray"], "runs/ppo_ray", "eval_accuracy",
         "held-out greedy accuracy"),
        # the tool task (toy_agent.py): "07+x=" hides x, which the environment reveals when asked ("?")
        ("SFT tool", ["sft.py", "--pretrain", "runs/sft_start", *tool_sft, "--save_path", "runs/sft_tool"],
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


def run(cmd, log):
    """Run a stage as a user would see it, keeping what it printed in `log`; a failure stops the demo in one line."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")  # a print() through the pipe comes when printed, in its order
    if sys.stdout.isatty():  # through the pipe, rich would take the stage for a log file and draw no progress bar
        env.update(TTY_COMPATIBLE="1", TTY_INTERACTIVE="1", COLUMNS=str(shutil.get_terminal_size().columns))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    with open(log, "wb") as f:
        while chunk := os.read(proc.stdout.fileno(), 1 << 16):
            sys.stdout.buffer.write(chunk)
            sys.stdout.buffer.flush()
            f.write(chunk)
    if proc.wait():
        sys.exit(f"{Path(cmd[1]).name} failed (exit code {proc.returncode}); what it printed is in {log}")


def curve(log, name):
    """[(step, value)] of metric `name` in a run's log, from its lines "eval step N: name=value ..." (the eval before
    training is step 0, the last one the run's final figure)."""
    points = []
    for line in re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", log).splitlines():  # without the progress bar's escapes
        if match := re.search(r"eval step (\d+): (.*)", line):
            figures = dict(kv.split("=", 1) for kv in match[2].split() if "=" in kv)
            if name in figures:
                points.append((int(match[1]), float(figures[name])))
    return points


def seed_ranges(path=SEEDS):
    """({stage: [its figure at each seed]}, the CPUs they ran on) from what bench/toy_seeds.py wrote (({}, []) if it
    has not)."""
    stages = json.loads(path.read_text())["stages"] if path.is_file() else {}
    cpus = sorted({run["cpu"] for seeds in stages.values() for run in seeds.values()})
    return {name: [run["end"] for run in seeds.values()] for name, seeds in stages.items()}, cpus


def cpu():
    """This machine's CPU model (the kind whose figures are exact from run to run)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    return next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                platform.processor() or platform.machine())


def checked(value, ends):
    """Whether a figure lies within the range of the same stage's figures over seeds, and if not by how much."""
    lo, hi = min(ends), max(ends)
    if lo - 1e-9 <= value <= hi + 1e-9:
        return "yes"
    return f"[yellow]outside by {100 * (value - (lo if value < lo else hi)):+.1f} points[/]"


def plot(curves, ranges, path):
    """The picture (runs/demo.png): every RL stage's held-out figure against its training steps, one panel per start
    (its figure a dashed line), and each stage's range over seeds a bar at its last step. -> the matplotlib figure."""
    import matplotlib
    matplotlib.use("Agg")  # a file, no window
    import matplotlib.pyplot as plt

    starts = list(dict.fromkeys(start for start, _ in curves.values()))
    fig, axes = plt.subplots(1, len(starts), figsize=(6.5 * len(starts), 4.8), squeeze=False)
    for ax, start in zip(axes[0], starts):
        ax.set(title=f"from {start}", xlabel="training step (each stage's own)", ylabel="held-out accuracy (%)")
        for name, (origin, points) in curves.items():
            if origin != start:
                continue
            steps, values = zip(*points)
            line, = ax.plot(steps, [100 * v for v in values], marker="o", markersize=3, label=name)
            if name in ranges:
                ends = [100 * v for v in ranges[name]]
                ax.errorbar([steps[-1]], [(min(ends) + max(ends)) / 2], yerr=[(max(ends) - min(ends)) / 2],
                            color=line.get_color(), capsize=4, linewidth=2.5, alpha=0.5)
        first = next(points[0][1] for origin, points in curves.values() if origin == start)
        ax.axhline(100 * first, color="gray", linestyle="--", linewidth=1, label=f"start {first:.1%}")
        ax.legend(fontsize=8, loc="lower right")
        ax.grid(alpha=0.3)
    fig.suptitle("Toy world: the RL stages' held-out accuracy as they train; bars: the range of the end over seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return fig


def main():
    console = Console(width=max(Console().width, 150))  # the table stays readable in logs
    root = Path(__file__).resolve().parent
    t = time.time()
    world = toy.ensure_toy_world()
    (ranges, cpus), logs = seed_ranges(), Path("runs/logs")
    logs.mkdir(parents=True, exist_ok=True)
    rows = [("toy world", "", "", "", "", f"{time.time() - t:.1f}", "", os.path.relpath(world))]
    curves, figures = {}, {}
    for name, cmd, out, key, what in stages(os.path.relpath(world)):
        console.rule(f"[bold]{name}: python {' '.join(cmd)}")
        t, log = time.time(), logs / f"{Path(out).stem}.log"
        run([sys.executable, str(root / cmd[0]), *cmd[1:]], log)
        wall = round(time.time() - t, 1)
        if key is None:  # a file of pairs: how many
            rows.append((name, what, f"{len(Path(out).read_text().splitlines()):,}", "", "", str(wall), "", out))
            continue
        results = json.loads((Path(out) / "eval_results.json").read_text())
        figures[name] = {"command": cmd, "start": results.get(f"{key}_before"), "end": results[key], "seconds": wall}
        Path("runs/demo.json").write_text(json.dumps(figures, indent=1) + "\n")  # (bench/toy_seeds.py --demo_seed)
        if f"{key}_before" in results:  # an RL stage: its curve from its start (its first and last figure at least)
            points = curve(log.read_text(errors="replace"), key[5:])
            curves[name] = (cmd[cmd.index("--pretrain") + 1],
                            points or [(0, results[f"{key}_before"]), (results["steps"], results[key])])
        ends = ranges.get(name, [])
        span = f"{min(ends):.1%} to {max(ends):.1%} ({len(ends)} seeds)" if len(ends) > 1 else ""
        rows.append((name, what, shown(results, key), span, checked(results[key], ends) if len(ends) > 1 else "",
                     str(wall), f"{results['peak_rss_mb']:.0f}", out))
    table = Table(title="Toy world: two-digit addition and running sums, 2 CPU cores")
    for col in ("stage", "metric", "value", "over seeds (bench/results/toy_seeds.json)", "inside?", "wall time (s)",
                "peak RSS (MB)", "output"):
        table.add_column(col)
    for row in rows:
        table.add_row(*row)
    console.print(table)
    if cpus:  # a figure is exact from run to run on one kind of CPU, another seed's draw on another kind
        console.print(f"The ranges were measured on {', '.join(cpus)}; this CPU is {cpu()}. " + (
            "The same kind: the start's and the RL stages' figures should equal the seed-0 runs." if cpu() in cpus
            else "Another kind: each figure is one more draw, like another seed's, so one just outside is no fault; "
                 "an RL stage that lifts the start by less than 15 points is."))
    plot(curves, ranges, "runs/demo.png")
    console.print("the held-out figure of every RL stage against its steps: runs/demo.png; each stage's output: "
                  f"{logs}/")


if __name__ == "__main__":
    main()
