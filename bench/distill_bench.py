"""On-policy distillation on the toy world (issue 42): how much held-out accuracy per second, against GRPO and
sequence-level KD from the same start.

    .venv/bin/python bench/distill_bench.py [--seeds 0 1 2] [--students same half] [--arms ...]
                                                                          # writes bench/results/distill.json

The teacher is the demo's runs/sft (4 layers, 10 epochs of SFT). Two students, each from a short SFT of its own:
    same   the demo's runs/sft_start (4 layers; the figures below are from before issue 65: runs/sft_short, 4 epochs)
    half   toy_world/model_half (2 layers: half the teacher's) after 2 epochs of SFT (bench/.cache/distill)
The arms, one run per student, arm and seed, held-out greedy exact match every --eval_steps:
    distill   distill.py --lmbda 1: the student samples, the teacher's distributions on its tokens (gkd, --beta)
    seq_kd    distill.py --lmbda 0 --seq_kd: the teacher samples (T 1), the same loss on its tokens
    grpo      grpo.py with the rule reward (toy.py), its toy-world settings
Time is training time: the sum of each step's step_s (sampling, teacher, update), evals excluded. "At equal time"
reads each curve at the shortest arm's total time (its last eval at or before it).
"""
import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import demo  # noqa: E402
import toy  # noqa: E402

WORK = ROOT / "bench" / ".cache" / "distill"
ARMS = ("distill", "seq_kd", "grpo")


def run(*cmd):
    print(" ".join(map(str, cmd)), flush=True)
    subprocess.run([sys.executable, *map(str, cmd)], check=True, cwd=ROOT)


def students():
    """{name: path} of the two start points (and the teacher), made here when missing, as the demo makes them."""
    paths = {"teacher": ROOT / "runs" / "sft", "same": ROOT / "runs" / "sft_start", "half": WORK / "sft_half"}
    start = next(cmd for name, cmd, *_ in demo.stages(toy.ensure_toy_world()) if name == "SFT start")
    cmds = {"teacher": [], "same": start[1:start.index("--save_path")],
            "half": ["--pretrain", toy.ensure_toy_world() / "model_half", "--max_epochs", 2]}
    for name, path in paths.items():
        if not (path / "config.json").exists():
            run(ROOT / "sft.py", *cmds[name], "--save_path", path)
    return paths


def arm_cmd(arm, start, teacher, seed, args):
    out = WORK / f"{arm}_{start.name}_seed{seed}"
    tb = WORK / "tb" / f"{out.name}_{time.time_ns()}"
    shared = ["--pretrain", start, "--seed", seed, "--eval_steps", args.eval_steps, "--logging_steps", 50,
              "--save_path", out, "--use_tensorboard", tb]
    if arm == "grpo":
        return out, tb, [ROOT / "grpo.py", *shared, "--max_samples", args.grpo_steps * 32]
    mode = ["--lmbda", 1] if arm == "distill" else ["--lmbda", 0, "--seq_kd"]
    return out, tb, [ROOT / "distill.py", *shared, "--teacher_pretrain", teacher, *mode, "--beta", args.beta,
                     "--learning_rate", args.lr, "--max_samples", 9500, "--num_episodes", args.episodes]


def curve(tb):
    """[(step, training seconds so far, held-out accuracy)] of every eval the run logged."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    acc.Reload()
    seconds, total = {}, 0.0
    for e in acc.Scalars("train/step_s"):
        total += e.value
        seconds[e.step] = total
    return [(e.step, round(seconds.get(e.step, 0.0), 1), e.value) for e in acc.Scalars("eval/accuracy")]


def at(points, t):
    """A curve's accuracy at training time t: its last eval at or before t."""
    return [acc for _, s, acc in points if s <= t + 1e-9][-1]


def first_lift(points, lift=0.30):
    """The training time of a curve's first eval at least `lift` above its start (None: never)."""
    return next((s for _, s, acc in points if acc >= points[0][2] + lift - 1e-9), None)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--students", nargs="+", default=["same", "half"], choices=("same", "half"))
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    p.add_argument("--beta", type=float, default=0.5)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--episodes", type=int, default=6, help="distill arms: passes over the 9,500 training prompts")
    p.add_argument("--grpo_steps", type=int, default=200, help="steps of 32 prompts x 8 samples (the demo's)")
    p.add_argument("--eval_steps", type=int, default=50)
    p.add_argument("--table_only", action="store_true", help="print the table of bench/results/distill.json")
    args = p.parse_args()
    if args.table_only:
        result = json.loads((ROOT / "bench" / "results" / "distill.json").read_text())
        return table(result["runs"], argparse.Namespace(**result["settings"]))
    paths = students()
    runs = []
    for student in args.students:
        for seed in args.seeds:
            for arm in args.arms:
                out, tb, cmd = arm_cmd(arm, paths[student], paths["teacher"], seed, args)
                t = time.time()
                run(*cmd)
                points = curve(tb)
                runs.append({"student": student, "arm": arm, "seed": seed, "curve": points, "wall_s": time.time() - t,
                             "train_s": points[-1][1], "before": points[0][2], "after": points[-1][2]})
                print(json.dumps({k: v for k, v in runs[-1].items() if k != "curve"}), flush=True)
    result = {"settings": vars(args), "runs": runs}
    (ROOT / "bench" / "results").mkdir(exist_ok=True)
    (ROOT / "bench" / "results" / "distill.json").write_text(json.dumps(result, indent=1) + "\n")
    table(runs, args)


def table(runs, args):
    print("| student | arm | before | after (mean, min-max) | lift | train s | first +30 points (s) | at equal time | "
          "wall s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for student in args.students:
        mine = [r for r in runs if r["student"] == student]
        # each seed's arms are read at the shortest of that seed's runs
        equal = {seed: min(r["train_s"] for r in mine if r["seed"] == seed) for seed in args.seeds}
        for arm in args.arms:
            rs = [r for r in mine if r["arm"] == arm]
            after = [r["after"] for r in rs]
            same_time = statistics.mean(at(r["curve"], equal[r["seed"]]) for r in rs)
            lifts = [first_lift(r["curve"]) for r in rs]
            lift = "never" if None in lifts else f"{statistics.mean(lifts):.0f} ({min(lifts):.0f}-{max(lifts):.0f})"
            print(f"| {student} | {arm} | {rs[0]['before']:.1%} | {statistics.mean(after):.1%} "
                  f"({min(after):.1%}-{max(after):.1%}) | {statistics.mean(after) - rs[0]['before']:+.1%} | "
                  f"{statistics.mean(r['train_s'] for r in rs):.0f} | {lift} | {same_time:.1%} at "
                  f"{statistics.mean(equal.values()):.0f} s | {statistics.mean(r['wall_s'] for r in rs):.0f} |")


if __name__ == "__main__":
    main()
