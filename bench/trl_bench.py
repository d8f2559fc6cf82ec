"""Speed against TRL on identical work, and against this machine's matmul limit (issues 8 and 40). Not a test: it
prints a table per world and writes bench/results/trl.json (toy) and trl_smollm2.json.

    .venv/bin/python bench/trl_bench.py                    # both worlds: rm, sft, grpo (toy), sft, grpo (SmolLM2)
    .venv/bin/python bench/trl_bench.py --world toy --only sft --repeats 3

- TRL runs in a side virtual environment, bench/.trl-venv (created on first use with the pins below, torch
  pinned as everywhere), so .venv never sees it; bench/trl_runner.py is its side of each run.
- Same model for both. The toy world: a random-init Llama of about 20M parameters with the toy tokenizer. The
  smollm2 world: the real SmolLM2-135M-Instruct (smollm2.py; `make smollm2`). Same data: toy-world addition
  records chained into sequences of 32-512 characters (log-uniform lengths), under each world's tokenizer; GRPO
  prompts: toy additions (toy), or "What is A+B?" rendered with SmolLM2's chat template, rewarded by
  bench/sum_reward.py and its twin (smollm2). Same batch size, precision (fp32), max length, optimizer (AdamW,
  constant lr, no weight decay, clip 1.0), sampling temperature and steps.
- Both sides run with the same glibc allocator setting (freed memory kept for reuse; see SAME_MALLOC).
- Rounds alternate ours and theirs (A B A B) so machine drift hits both alike. Throughput is measured over
  optimizer steps 2..N (the first carries one-off start-up costs in both), from the wall time at the end of
  each step: ours from its TensorBoard events, TRL's from a TrainerCallback.
- FLOP/s: 6 x parameters x real tokens per second (training), over the matmul FLOP/s measured here first. GRPO
  counts the work a step cannot avoid: 8 x parameters (2 to generate, 6 to train) per distinct token, each
  prompt once (its n samples share it) plus every completion, at each run's own completion lengths (both sample).
- The speed ratio is of tokens/s: the same as of seconds per step for RM and SFT (the same tokens), and for GRPO
  fair when the two sides sampled completions of different lengths.
"""
import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SIDE = ROOT / "bench" / ".trl-venv"
WORK = ROOT / "bench" / ".cache" / "trl_bench"
THEIRS = ["trl==1.16.0", "transformers==5.23.0", "accelerate==1.15.0", "datasets==5.2.0", "tokenizers==0.23.3",
          "safetensors==0.8.0"]
TORCH = "torch==2.13.0"
SEED, THREADS, LR, GRPO_N = 0, 2, 1e-5, 4
# Per world: its tasks with their batch sizes (pairs, samples, prompts) and optimizer steps, and GRPO's temperature
# and reward (ours in bench/, TRL's twin of the same name in trl_runner.py) with the dataset key it reads.
WORLDS = {"toy": {"batch": {"rm": 4, "sft": 8, "grpo": 4}, "steps": {"rm": 12, "sft": 12, "grpo": 8},
                  "temperature": 1.0, "reward": "digit_reward", "label": None},
          "smollm2": {"batch": {"sft": 8, "grpo": 4}, "steps": {"sft": 6, "grpo": 6},
                      "temperature": 0.7, "reward": "sum_reward", "label": "label"}}
# Our scripts keep freed memory for reuse on CPU (common.keep_freed_memory); TRL gets the same glibc setting
# through the environment, so neither side gains from the allocator.
SAME_MALLOC = {"MALLOC_TRIM_THRESHOLD_": str(1 << 40), "MALLOC_MMAP_THRESHOLD_": str(32 << 20)}


def ensure_trl_env():
    if (SIDE / "installed").exists():
        return
    subprocess.run(["python3", "-m", "venv", str(SIDE)], check=True)
    pip = [str(SIDE / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run(pip + [TORCH], check=True)  # alone first: the pin keeps pip from pulling CUDA wheels
    constraints = WORK / "torch-constraint.txt"
    constraints.write_text(TORCH + "\n")
    subprocess.run(pip + THEIRS + ["-c", str(constraints)], check=True)
    (SIDE / "installed").write_text("\n".join([TORCH] + THEIRS) + "\n")


def build_world(world):
    """The shared model and the datasets. toy: a random-init Llama of ~20M parameters with the toy tokenizer;
    smollm2: the real SmolLM2-135M-Instruct (smollm2.py), with the same SFT rows under its own tokenizer and, for
    GRPO, "What is A+B?" questions rendered with its chat template (as text, so both sides get the same ids)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    work = WORK if world == "toy" else WORK / world
    work.mkdir(parents=True, exist_ok=True)
    if world == "smollm2":
        import smollm2

        model_dir = smollm2.ensure_smollm2()
        tok = AutoTokenizer.from_pretrained(model_dir)
    else:
        import toy

        tok = AutoTokenizer.from_pretrained(toy.ensure_toy_world() / "model")
        model_dir = WORK / "model"
    if not (model_dir / "config.json").exists():
        config = LlamaConfig(vocab_size=len(tok), hidden_size=512, intermediate_size=1408, num_hidden_layers=6,
                             num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=1024,
                             tie_word_embeddings=True, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                             eos_token_id=tok.eos_token_id)
        torch.manual_seed(SEED)
        LlamaForCausalLM(config).save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
    rng = random.Random(SEED)

    def problems(n_chars):
        """Chained toy additions, "07+45=52;31+09=40;...", about n_chars long."""
        out = ""
        while len(out) < n_chars:
            a, b = rng.randrange(100), rng.randrange(100)
            out += f"{a:02d}+{b:02d}={a + b};"
        return out[:n_chars]

    def length():
        return int(math.exp(rng.uniform(math.log(32), math.log(512))))

    def question():
        a, b = rng.randrange(10, 100), rng.randrange(10, 100)
        chat = [{"role": "user", "content": f"What is {a}+{b}? Reply with the number only."}]
        return {"prompt": tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
                "label": str(a + b)}

    data = {}
    for name, n in (("sft", 512), ("rm", 512), ("grpo", 256)):
        path = work / f"{name}.jsonl"
        rows = []
        for _ in range(n):
            total = length() - 2  # bos/eos
            if name == "sft":
                cut = total // 2
                text = problems(total)
                rows.append({"prompt": text[:cut], "completion": text[cut:]})
            elif name == "rm":
                cut = total // 2
                chosen = problems(total)
                rows.append({"prompt": chosen[:cut], "chosen": chosen[cut:],
                             "rejected": chosen[cut:][::-1]})  # same length, so both sides cost the same
            else:
                rows.append(question() if world == "smollm2" else {"prompt": problems(64)})
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        data[name] = path
    return model_dir, data, tok


def measure_matmul_flops():
    """The physical limit here: the best fp32 matmul FLOP/s of THREADS threads (2 n^3 per n x n product)."""
    torch.set_num_threads(THREADS)
    best = 0.0
    for n in (1024, 2048):
        a, b = torch.randn(n, n), torch.randn(n, n)
        for _ in range(3):
            a @ b
        for _ in range(5):
            t = time.perf_counter()
            a @ b
            best = max(best, 2 * n ** 3 / (time.perf_counter() - t))
    return best


def timed(cmd, env=None):
    """Run a command under /usr/bin/time; -> (combined output, peak RSS in MB)."""
    rss_file = WORK / "rss.txt"
    proc = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", str(rss_file)] + [str(c) for c in cmd],
                          capture_output=True, text=True, env={**os.environ, **(env or {})}, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(f"failed: {' '.join(map(str, cmd))}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return proc.stdout + proc.stderr, int(rss_file.read_text().split()[-1]) / 1024


def tb_events(directory, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory))
    acc.Reload()
    return acc.Scalars(tag)


def ours(task, model_dir, data, steps, batch, world, variant=""):
    run = WORK / f"ours_{task}{variant}"
    tb = WORK / f"tb_{task}{variant}_{time.time_ns()}"
    w = WORLDS[world]
    flags = ["--pretrain", model_dir, "--dataset", data, "--input_key", "prompt", "--learning_rate", LR,
             "--lr_scheduler", "constant", "--lr_warmup_ratio", 0, "--adam_betas", 0.9, 0.999, "--l2", 0,
             "--max_norm", 1.0, "--seed", SEED, "--logging_steps", 1, "--use_tensorboard", tb, "--save_path", run,
             "--max_len", 512]
    if task == "grpo":
        flags += ["--remote_rm_url", ROOT / "bench" / f"{w['reward']}.py", "--n_samples_per_prompt", GRPO_N,
                  "--rollout_batch_size", batch,
                  "--train_batch_size", batch * GRPO_N, "--micro_train_batch_size", batch * GRPO_N,
                  "--micro_rollout_batch_size", batch * GRPO_N, "--generate_max_len", 32, "--prompt_max_len", 512,
                  "--max_samples", batch * steps, "--temperature", w["temperature"], "--packing_samples"]
        flags += ["--label_key", w["label"]] if w["label"] else []
        flags += ["--vllm"] if variant == "_vllm" else []
    else:
        flags += ["--train_batch_size", batch, "--micro_train_batch_size", batch, "--max_samples", batch * steps]
        flags += ["--output_key", "completion"] if task == "sft" else []
        flags += ["--packing_samples"] if variant == "_packed" else []
    _, rss = timed([ROOT / ".venv" / "bin" / "python", ROOT / f"{task}.py", *flags],
                   env={"OMP_NUM_THREADS": str(THREADS), "HF_HUB_OFFLINE": "1"})
    loss_tag = "train/policy_loss" if task == "grpo" else "train/loss"
    events = tb_events(tb, loss_tag)
    out = {"times": [e.wall_time for e in events], "loss": events[-1].value, "peak_rss_mb": rss}
    if task == "grpo":
        out["completion_lens"] = [e.value for e in tb_events(tb, "train/response_len")]
    return out


def theirs(task, model_dir, data, steps, batch, world):
    w = WORLDS[world]
    out = WORK / f"theirs_{task}.json"
    cfg = WORK / f"theirs_{task}_config.json"
    cfg.write_text(json.dumps({"task": task, "model": str(model_dir), "data": str(data), "out": str(out),
                               "work": str(WORK / f"theirs_{task}"), "steps": steps, "batch": batch, "lr": LR,
                               "seed": SEED, "threads": THREADS, "max_len": 512, "n": GRPO_N, "gen_len": 32,
                               "temperature": w["temperature"], "reward": w["reward"]}))
    _, rss = timed([SIDE / "bin" / "python", ROOT / "bench" / "trl_runner.py", cfg],
                   env={"OMP_NUM_THREADS": str(THREADS), "HF_HUB_OFFLINE": "1", **SAME_MALLOC})
    res = json.loads(out.read_text())
    return {"times": res["step_end_times"], "loss": res["losses"][-1], "peak_rss_mb": rss,
            "completion_lens": res["completion_lens"]}


def steady(times):
    """Seconds per step over steps 2..N (from the end of step 1 to the end of step N)."""
    return (times[-1] - times[0]) / (len(times) - 1)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", default="toy,smollm2", help="toy, smollm2 or both (comma-separated)")
    p.add_argument("--only", default="rm,sft,grpo", help="tasks, each run in the worlds that have it")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, help="optimizer steps per rm/sft run (default: the world's)")
    p.add_argument("--grpo_steps", type=int, help="optimizer steps per grpo run (default: the world's)")
    args = p.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    ensure_trl_env()
    peak = measure_matmul_flops()
    print(f"matmul limit here: {peak / 1e9:.1f} GFLOP/s ({THREADS} threads)")
    for world in args.world.split(","):
        bench_world(world, [t for t in args.only.split(",") if t in WORLDS[world]["batch"]], args, peak)


def bench_world(world, tasks, args, peak):
    model_dir, data, tok = build_world(world)
    from transformers import AutoModelForCausalLM

    n_params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())
    print(f"{world}: {model_dir.name}, {n_params / 1e6:.1f}M parameters")
    batch = WORLDS[world]["batch"]

    def real_tokens(task, rows):
        """Tokens of the work (no padding): what both sides must process, from the same tokenizer."""
        count = lambda text: len(tok(text)["input_ids"]) + 1  # noqa: E731  (+ eos)
        if task == "sft":
            return sum(count(r["prompt"] + r["completion"]) for r in rows)
        return sum(count(r["prompt"] + r["chosen"]) + count(r["prompt"] + r["rejected"]) for r in rows)

    def grpo_tokens_per_step(rows, run):
        """Distinct tokens of one step: each prompt once, plus its n completions at the mean length that run
        sampled over the timed steps 2..N."""
        prompt = sum(len(tok(r["prompt"])["input_ids"]) for r in rows) / len(rows)
        return batch["grpo"] * (prompt + GRPO_N * statistics.mean(run["completion_lens"][1:]))

    table, report = [], {"machine": f"{os.cpu_count()} CPU cores, {THREADS} threads", "world": world,
                         "model": str(model_dir.relative_to(ROOT)), "params": n_params, "matmul_flops": peak,
                         "runs": {}}
    for task in tasks:
        variants = {"rm": ["", "_packed"], "sft": ["_packed"], "grpo": ["", "_vllm"]}[task]
        steps = (args.grpo_steps if task == "grpo" else args.steps) or WORLDS[world]["steps"][task]
        rows = [json.loads(line) for line in open(data[task])][:batch[task] * steps]
        subset = data[task].parent / f"{task}_{len(rows)}.jsonl"  # both sides get exactly these rows: one epoch
        subset.write_text("".join(json.dumps(r) + "\n" for r in rows))
        per_step = real_tokens(task, rows) / steps if task != "grpo" else None
        flops_per_token = 8 * n_params if task == "grpo" else 6 * n_params  # GRPO: generate (2N) + update (6N)
        results = {f"ours{v}": [] for v in variants} | {"trl": []}
        for k in range(args.repeats):
            order = list(results) if k % 2 == 0 else list(results)[::-1]  # A B A B: drift hits both alike
            for name in order:
                r = (theirs(task, model_dir, subset, steps, batch[task], world) if name == "trl" else
                     ours(task, model_dir, subset, steps, batch[task], world, name[4:]))
                r["s_per_step"] = steady(r["times"])
                results[name].append(r)
                lens = f", {statistics.mean(r['completion_lens'][1:]):.1f} tokens a completion" \
                    if task == "grpo" else ""
                print(f"  {world} {task} {name}: {r['s_per_step']:.3f} s/step, loss {r['loss']:.4f}, "
                      f"{r['peak_rss_mb']:.0f} MB{lens}", flush=True)
        report["runs"][task] = results
        for name, runs in results.items():
            s = [r["s_per_step"] for r in runs]
            row = {"task": task, "who": name, "s_per_step": statistics.median(s), "min": min(s), "max": max(s),
                   "loss": statistics.median(r["loss"] for r in runs), "rss": max(r["peak_rss_mb"] for r in runs)}
            tokens = per_step or statistics.median(grpo_tokens_per_step(rows, r) for r in runs)
            row["tokens_per_s"] = tokens / row["s_per_step"]
            row["units_per_s"] = batch[task] * (GRPO_N if task == "grpo" else 1) / row["s_per_step"]
            row["mfu"] = flops_per_token * row["tokens_per_s"] / peak
            row["matmul_flops"] = peak
            table.append(row)
        # The speed ratio is per unit of work: tokens/s (GRPO's completions are sampled, so their lengths differ
        # between runs; RM and SFT do the same tokens, where this is the ratio of seconds per step).
        trl_row = next(r for r in table if r["task"] == task and r["who"] == "trl")
        for row in table:
            if row["task"] == task:
                row["ratio"] = row["tokens_per_s"] / trl_row["tokens_per_s"]
    print(f"\n{world}: {model_dir.name}, {n_params / 1e6:.1f}M parameters, fp32\n")
    print("| work | who | s/step median (min-max) | tokens/s | pairs or samples/s | ours/TRL speed | "
          "FLOP/s / matmul limit | loss after N steps | peak RSS MB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in table:
        print(f"| {r['task']} | {r['who']} | {r['s_per_step']:.3f} ({r['min']:.3f}-{r['max']:.3f}) | "
              f"{r['tokens_per_s']:.0f} | {r['units_per_s']:.2f} | {r['ratio']:.2f} | {r['mfu']:.2f} | "
              f"{r['loss']:.4f} | {r['rss']:.0f} |")
    report["table"] = table
    out = ROOT / "bench" / "results" / ("trl.json" if world == "toy" else f"trl_{world}.json")
    if out.exists():  # a rerun of some tasks (--only) keeps the file's other tasks
        old = json.loads(out.read_text())
        report["runs"] = {**{k: v for k, v in old.get("runs", {}).items() if k not in tasks}, **report["runs"]}
        report["table"] = [r for r in old.get("table", []) if r["task"] not in tasks] + table
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
