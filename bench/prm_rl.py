"""Process rewards on the toy world's running sums (issue 41): does a PRM's judgement of each step help RL?

    .venv/bin/python bench/prm_rl.py [--seeds 0 1 2] [--arms ...]       # writes bench/results/prm_rl.json

1. The start policy: sft.py on the steps data, stopped early (--start_samples records, 2 epochs; the demo's
   runs/sft_steps takes all 9,500 for 4 and writes 99% of held-out solutions exactly), so RL has room.
2. Its own samples (2 per held-out problem, at the RL runs' --temperature) labelled by the rule, Math-Shepherd
   style: a step is good while every line up to it is the right one ("+"), bad from the first wrong line on ("-");
   a solution that stops short has its last step bad. The demo's PRM (runs/prm: trained on misread carried totals
   only) judges them: step accuracy at P(good) > 0.5.
3. A PRM that can judge them, with Math-Shepherd's Monte-Carlo labels from the start policy's own completions of the
   training problems: each step's label is the share of --mc_rollouts continuations from it (temperature 1) that
   reach the right total (the last step: whether the solution's own total is right), prm.py's soft labels; trained
   from the demo's steps SFT like the demo's PRM. Judged on the same held-out samples: accuracy at 0.5, and AUC (how
   often a good step scores above a bad one: what group-normalized step scores use). --judge picks the RL arms' PRM.
4. RL from the start policy, one run per arm and seed, held-out greedy accuracy (the rule: the total after the last
   "=") before, during (--eval_steps) and after, and the wall time:
     grpo_rule      GRPO, the outcome rule as the reward (toy.py)
     grpo_prm_orm   GRPO, the PRM's outcome reward only (the min over its step scores)
     grpo_prm_prm   GRPO with --process_rewards (DeepSeekMath's process supervision from the PRM)
     ppo_prm_prm    PPO with --process_rewards (each step's score on its last token, Math-Shepherd)
     grpo_rule_prm  GRPO with --process_rewards and the outcome rule beside (both advantages added)
Stages 1-3 are cached in bench/.cache/prm_rl (delete it to redo them).
"""
import argparse
import bisect
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import prm  # noqa: E402
import toy  # noqa: E402

WORK = ROOT / "bench" / ".cache" / "prm_rl"
ARMS = ("grpo_rule", "grpo_prm_orm", "grpo_prm_prm", "ppo_prm_prm", "grpo_rule_prm")
# relative (the runs' cwd is ROOT): grpo.py drops the toy world's own default path beside a reward model
RULE = "toy.py"
PRM_TOY = ["--max_len", 64, "--max_epochs", 6, "--train_batch_size", 32, "--micro_train_batch_size", 32,
           "--learning_rate", 3e-4, "--lr_warmup_ratio", 0.1]


def run(*cmd):
    print(" ".join(map(str, cmd)), flush=True)
    t = time.time()
    subprocess.run([sys.executable, *map(str, cmd)], check=True, cwd=ROOT)
    return time.time() - t


def right_lines(prompt):
    """The right solution's lines of a running-sum problem ("07+45+08\\n")."""
    terms = [int(t) for t in prompt.strip().split("+")]
    lines, total = [], terms[0]
    for t in terms[1:]:
        lines.append(f"{total:02d}+{t:02d}={total + t:02d}")
        total += t
    return lines


def rule_labels(prompt, completion):
    """Per step (prm.steps_of, newline-separated) True while every line so far is right; the last step of a solution
    that stops short is wrong."""
    steps, pieces = prm.steps_of(completion, "\n")
    lines, want = [pieces[i].strip() for i in steps], right_lines(prompt)
    labels, ok = [], True
    for k, line in enumerate(lines):
        ok = ok and k < len(want) and line == want[k]
        labels.append(ok)
    if len(lines) < len(want):
        labels[-1] = False
    return labels


def load(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path).eval(), tok


@torch.no_grad()
def sample(model, tok, prompts, n=1, temperature=1.0, max_new_tokens=48, batch=256):
    """n completions of each prompt text (its tokens with BOS, as the RL scripts sample), text without specials."""
    tok.padding_side = "left"
    out = []
    texts = [p for p in prompts for _ in range(n)]
    for i in range(0, len(texts), batch):
        enc = tok(texts[i:i + batch], return_tensors="pt", padding=True)
        gen = model.generate(**enc, do_sample=temperature > 0, temperature=temperature or None, top_k=0, top_p=1.0,
                             max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id)
        out += tok.batch_decode(gen[:, enc["input_ids"].size(1):], skip_special_tokens=True)
    return [c.replace(toy.PLACEHOLDER, "") for c in out]  # one the policy wrote would read as a step end


def judge(prm_path, prompts, completions):
    """The PRM's P(good) of every step: the text prm.py trains on, one solution at a time."""
    model, tok = load(prm_path)
    p = model.config.placeholder_token
    return [prm.score_steps(model, tok, q + prm.with_placeholders(c, "\n", p)) for q, c in zip(prompts, completions)]


def accuracy(labels, scores):
    """How the judge's P(good) of each step agrees with the rule's labels: at 0.5, and AUC, the chance that a good
    step scores above a bad one (a tie counts half)."""
    good = [s for ys, ss in zip(labels, scores) for y, s in zip(ys, ss) if y]
    bad = [s for ys, ss in zip(labels, scores) for y, s in zip(ys, ss) if not y]
    bad_sorted, wins = sorted(bad), 0.0
    for g in good:  # the bad steps below g, and half of those equal to it
        below, up_to = bisect.bisect_left(bad_sorted, g), bisect.bisect_right(bad_sorted, g)
        wins += below + (up_to - below) / 2
    passed, caught = sum(s > 0.5 for s in good), sum(s <= 0.5 for s in bad)
    return {"step_acc": (passed + caught) / len(good + bad), "auc": wins / max(len(good) * len(bad), 1),
            "good_steps_passed": passed / max(len(good), 1), "bad_steps_caught": caught / max(len(bad), 1),
            "steps": len(good + bad), "bad_steps": len(bad)}


def mc_labels(model, tok, problems, rollouts):
    """Math-Shepherd's soft labels for one sample of each problem: per step, the share of continuations from it that
    reach the right total; the last step, whether the sample's own total is right."""
    prompts = [r["input"] for r in problems]
    firsts = sample(model, tok, prompts)
    rows, queries, where = [], [], []
    for r, c in zip(problems, firsts):
        steps, pieces = prm.steps_of(c, "\n")
        lines = [pieces[i].strip() for i in steps]
        rows.append({"input": r["input"] + "\n".join(f"{line} {toy.PLACEHOLDER}" for line in lines),
                     "label": [None] * len(lines), "total": r["label"], "final": c.strip().rsplit("=", 1)[-1]})
        for k in range(len(lines) - 1):
            queries.append(r["input"] + "\n".join(lines[:k + 1]) + "\n")
            where.append((len(rows) - 1, k))
    continued = sample(model, tok, queries, n=rollouts)
    for j, (i, k) in enumerate(where):
        ends = [c.strip().rsplit("=", 1)[-1] for c in continued[j * rollouts:(j + 1) * rollouts]]
        rows[i]["label"][k] = sum(e == rows[i]["total"] for e in ends) / rollouts
    for row in rows:
        row["label"][-1] = float(row.pop("final") == row.pop("total"))
    return rows


def prepare(args, world):
    WORK.mkdir(parents=True, exist_ok=True)
    start, demo_sft, demo_prm = WORK / "sft_steps_short", ROOT / "runs" / "sft_steps", ROOT / "runs" / "prm"
    steps = ["--dataset", world / "steps_train.jsonl", "--eval_dataset", world / "steps_test.jsonl",
             "--learning_rate", "1e-3", "--lr_warmup_ratio", "0.1", "--train_batch_size", "64",
             "--micro_train_batch_size", "64", "--max_len", "64", "--eval_generate_samples", "500",
             "--generate_max_len", "48"]
    if not (start / "config.json").exists():
        run(ROOT / "sft.py", *steps, "--max_epochs", 2, "--max_samples", args.start_samples, "--save_path", start)
    for path, cmd in ((demo_sft, [*steps, "--max_epochs", 4]), (demo_prm, ["--pretrain", demo_sft])):
        if not (path / "config.json").exists():
            run(ROOT / ("sft.py" if path == demo_sft else "prm.py"), *cmd, "--save_path", path)
    report = json.loads((WORK / "judges.json").read_text()) if (WORK / "judges.json").exists() else {}
    mc_prm = WORK / "prm_mc"
    if not (mc_prm / "config.json").exists():
        model, tok = load(start)
        torch.manual_seed(0)
        train = [json.loads(x) for x in open(world / "steps_prompts_train.jsonl")][:args.mc_problems]
        t = time.time()
        rows = mc_labels(model, tok, train, args.mc_rollouts)
        report["mc_label_s"] = time.time() - t
        random.Random(0).shuffle(rows)
        cut = len(rows) // 20
        for name, part in (("mc_test", rows[:cut]), ("mc_train", rows[cut:])):
            (WORK / f"{name}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in part))
        report["prm_mc_train_s"] = run(ROOT / "prm.py", "--pretrain", demo_sft, "--dataset", WORK / "mc_train.jsonl",
                                       "--eval_dataset", WORK / "mc_test.jsonl", "--save_path", mc_prm,
                                       *PRM_TOY)  # prm.py's toy settings (they apply only without --dataset)
    if "demo_prm" not in report:
        model, tok = load(start)
        torch.manual_seed(1)
        test = [json.loads(x)["input"] for x in open(world / "steps_prompts_test.jsonl")]
        prompts = [p for p in test for _ in range(2)]
        completions = sample(model, tok, test, n=2, temperature=args.temperature)
        labels = [rule_labels(p, c) for p, c in zip(prompts, completions)]
        report["start_sample_solutions_right"] = sum(all(y) for y in labels) / len(labels)
        for name, path in (("demo_prm", demo_prm), ("mc_prm", mc_prm)):
            report[name] = accuracy(labels, judge(path, prompts, completions))
            print(name, report[name], flush=True)
        (WORK / "judges.json").write_text(json.dumps(report, indent=1))
    return start, mc_prm, report


def arm_cmd(arm, start, judge_path, world, seed, args):
    out = WORK / f"{arm}_seed{seed}"
    common = ["--pretrain", start, "--dataset", world / "steps_prompts_train.jsonl", "--eval_dataset",
              world / "steps_prompts_test.jsonl", "--label_key", "label", "--prompt_max_len", 16,
              "--generate_max_len", 48, "--max_samples", args.steps * args.rollout_batch_size,
              "--rollout_batch_size", args.rollout_batch_size, "--n_samples_per_prompt", 8,
              "--train_batch_size", args.rollout_batch_size * 8, "--micro_train_batch_size", 64,
              "--micro_rollout_batch_size", 64, "--eval_steps", args.eval_steps, "--seed", seed,
              "--temperature", args.temperature,
              "--eval_reward_func", toy.__file__, "--logging_steps", 1, "--save_path", out,
              "--use_tensorboard", WORK / "tb" / f"{arm}_seed{seed}_{time.time_ns()}"]
    script, flags = arm.split("_", 1)
    reward = (["--remote_rm_url", RULE] if flags.startswith("rule") else []) + \
        (["--reward_pretrain", judge_path] if "prm" in flags else [])
    extra = ["--process_rewards"] if flags in ("prm_prm", "rule_prm") else []
    lr = ["--learning_rate", args.lr] if script == "grpo" else ["--learning_rate", args.lr, "--critic_learning_rate",
                                                                 args.critic_lr, "--init_kl_coef", 0]
    return out, common[-1], [ROOT / f"{script}.py", *common, *reward, *extra, *lr]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    p.add_argument("--start_samples", type=int, default=8000, help="SFT records (2 epochs) of the start policy")
    p.add_argument("--mc_problems", type=int, default=3000)
    p.add_argument("--mc_rollouts", type=int, default=8)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rollout_batch_size", type=int, default=32)
    p.add_argument("--eval_steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--temperature", type=float, default=0.7, help="the RL runs' sampling (and the judged samples')")
    p.add_argument("--critic_lr", type=float, default=1e-4)
    p.add_argument("--judge", default="demo", choices=("demo", "mc"),
                   help="the PRM of the RL arms: the demo's (better at ranking the start policy's steps) or the MC one")
    p.add_argument("--prepare_only", action="store_true")
    args = p.parse_args()
    world = toy.ensure_toy_world()
    start, mc_prm, report = prepare(args, world)
    if args.prepare_only:
        return
    judge_path = mc_prm if args.judge == "mc" else ROOT / "runs" / "prm"
    runs = []
    for seed in args.seeds:
        for arm in args.arms:
            out, tb, cmd = arm_cmd(arm, start, judge_path, world, seed, args)
            wall = run(*cmd)
            r = json.loads((out / "eval_results.json").read_text())
            runs.append({"arm": arm, "seed": seed, "before": r["eval_accuracy_before"], "after": r["eval_accuracy"],
                         "wall_s": wall, "curve": eval_curve(tb)})
            print(json.dumps(runs[-1]), flush=True)
    result = {"settings": vars(args), "judges": report, "runs": runs}
    (ROOT / "bench" / "results").mkdir(exist_ok=True)
    (ROOT / "bench" / "results" / "prm_rl.json").write_text(json.dumps(result, indent=1) + "\n")
    print("| arm | before | after (mean, min-max) | lift | s per run |\n|---|---|---|---|---|")
    for arm in args.arms:
        rs = [r for r in runs if r["arm"] == arm]
        after = [r["after"] for r in rs]
        print(f"| {arm} | {rs[0]['before']:.1%} | {statistics.mean(after):.1%} ({min(after):.1%}-{max(after):.1%}) | "
              f"{statistics.mean(after) - rs[0]['before']:+.1%} | {statistics.mean(r['wall_s'] for r in rs):.0f} |")


def eval_curve(tb):
    """(step, seconds since the run's first event, held-out accuracy) of every eval the run logged."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb))
    acc.Reload()
    events = acc.Scalars("eval/accuracy")
    t0 = min(e.wall_time for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag))
    return [(e.step, round(e.wall_time - t0, 1), e.value) for e in events]


if __name__ == "__main__":
    main()
