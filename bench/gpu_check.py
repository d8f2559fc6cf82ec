"""The GPU self-check: what to run first on a new GPU machine, and what we run whenever a GPU is at hand.

    make gpu-check          (or: .venv/bin/python bench/gpu_check.py [--out runs/gpu_check] [--peak_tflops N])

On one CUDA GPU, offline, in about 10 minutes, with whatever is installed (a stage that needs vllm or flash-attn says it
was skipped where they are not):
1. the toy pipeline in bf16 under DeepSpeed, each stage as a user runs it: SFT (with --packing_samples, so torch's
   varlen kernel), RM, GRPO on HF generate, GRPO on --vllm, PPO from that RM; each stage's held-out figure and time.
   SFT and RM must learn the toy task (exact match >= 50%, pair accuracy >= 80%; 97.6% and 98.0% in float32 on CPU).
2. SFT throughput of a random ~350M Llama-shaped model (24 layers, hidden 1024, 16 query / 8 key-value heads, vocab
   32k) on samples of 400-1,000 tokens, micro-batch 8, ZeRO-2: real tokens/s, MFU and peak memory for padded,
   packed (packing.packed_sdpa) and --flash_attn --packing_samples (where flash-attn is installed); packed against
   the padding-free ideal, padded real-tokens/s x padded tokens / real tokens (padding whose pads cost nothing).
MFU = 6 x parameters x real tokens/s over the GPU's dense bf16 peak (PEAK_TFLOPS by device name, or --peak_tflops).
It prints a table, writes <out>/gpu_check.json, and exits 1 if any stage fails; without CUDA it says so in one line.
"""
import argparse
import importlib.metadata
import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# dense bf16 tensor-core peak, TFLOP/s, by a part of torch.cuda.get_device_name(); the first match counts
PEAK_TFLOPS = [("H100 PCIe", 756), ("H100 NVL", 835), ("H100", 989), ("H200", 989), ("B200", 2250), ("A100", 312),
               ("A800", 312), ("L40S", 362), ("L40", 181), ("A10", 125), ("L4", 121)]
MODEL = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=24, num_attention_heads=16,
             num_key_value_heads=8, vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False)
STEPS, WARMUP, MICRO = 40, 5, 8  # throughput: optimizer steps of one micro-batch each, the first WARMUP not counted


def run(name, cmd, out, timeout=600):
    """One script, as a user runs it, into `out` (emptied first: a stage never reads a previous check's run); its
    output to <out>.log. -> (eval_results.json or None, seconds, log)."""
    shutil.rmtree(out, ignore_errors=True)
    t = time.time()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    try:
        proc = subprocess.run([sys.executable, *map(str, cmd)], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
        log, ok = proc.stdout + proc.stderr, proc.returncode == 0
    except subprocess.TimeoutExpired as e:  # its output comes as bytes, whatever text= said
        log = b"".join(x for x in (e.stdout, e.stderr) if x).decode(errors="replace")
        log, ok = f"{log}\ntimed out after {timeout} s", False
    Path(f"{out}.log").write_text(log)
    results = Path(out, "eval_results.json")
    if not ok or not results.exists():
        tail = [line for line in log.splitlines() if line.strip()][-1:] or ["no output"]
        print(f"{name}: FAILED ({tail[0][:200]}; log: {out}.log)", flush=True)
        return None, time.time() - t, log
    return json.loads(results.read_text()), time.time() - t, log


def pipeline(out, rows):
    """The toy stages in bf16; rows get (stage, figure, seconds, peak GPU MB, status)."""
    sft, rm = out / "sft", out / "rm"
    rl = ["--bf16", "--pretrain", sft, "--eval_steps", -1]
    stages = [
        ("SFT (packed)", ["sft.py", "--bf16", "--packing_samples", "--save_path", sft], sft, "eval_exact_match", 0.5),
        ("RM (packed)", ["rm.py", "--bf16", "--packing_samples", "--pretrain", sft, "--save_path", rm], rm,
         "eval_acc", 0.8),
        ("GRPO, HF generate", ["grpo.py", *rl, "--max_samples", 960, "--save_path", out / "grpo"], out / "grpo",
         "eval_accuracy", None),
        ("GRPO, vLLM", ["grpo.py", *rl, "--vllm", "--max_samples", 960, "--save_path", out / "grpo_vllm"],
         out / "grpo_vllm", "eval_accuracy", None),
        ("PPO, the RM's reward", ["ppo.py", *rl, "--reward_pretrain", rm, "--normalize_reward", "--max_samples", 640,
                                  "--save_path", out / "ppo"], out / "ppo", "eval_accuracy", None),
    ]
    for name, cmd, path, key, floor in stages:
        if "--vllm" in cmd and importlib.util.find_spec("vllm") is None:
            rows.append((name, "-", "-", "-", "skipped: vllm is not installed (make venv-gpu installs it)"))
            continue
        needs = [x for x in (sft, rm) if x in cmd and x != path]
        if any(not Path(x, "config.json").exists() for x in needs):
            rows.append((name, "-", "-", "-", f"skipped: no {' or '.join(x.name for x in needs)} (failed above)"))
            continue
        results, wall, _ = run(name, cmd, path)
        if results is None:
            rows.append((name, "-", f"{wall:.0f}", "-", "FAILED"))
            continue
        figure = f"{results[key]:.1%}"
        if f"{key}_before" in results:
            figure = f"{results[f'{key}_before']:.1%} -> {figure}"
        status = "ok" if floor is None or results[key] >= floor else f"FAILED: {key} below {floor:.0%}"
        rows.append((name, f"{key[5:]} {figure}", f"{wall:.0f}", f"{results.get('peak_gpu_mb', 0):,.0f}", status))


def throughput_data(out):
    """A random ~350M Llama (bf16, the toy tokenizer) and samples of 400-1,000 tokens -> (model dir, data file, and
    for each measured step its real tokens and its padded ones: MICRO x its longest sample)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    import common
    import sft
    import toy

    tokenizer = AutoTokenizer.from_pretrained(toy.ensure_toy_world() / "model", model_max_length=4096)
    model_dir = out / "llama_random"
    if not Path(model_dir, "config.json").exists():
        torch.manual_seed(0)
        config = LlamaConfig(**MODEL, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id, torch_dtype="bfloat16")
        LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(model_dir)
        tokenizer.model_max_length = MODEL["max_position_embeddings"]
        tokenizer.save_pretrained(model_dir)
    rng, records = random.Random(0), []
    for _ in range(STEPS * MICRO):
        length = rng.randint(400, 1000) - 2  # BOS and EOS
        text = "".join(rng.choice("0123456789+=") for _ in range(length))
        records.append({"input": text[:length // 2], "output": text[length // 2:]})
    data = out / "sft_400_1000.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    args = sft.add_training_args(argparse.ArgumentParser()).parse_args([])
    args.__dict__.update(output_key="output", multiturn=False, pretrain_mode=False, max_len=1024)
    lengths = [len(sft.tokenize_sample(r, tokenizer, args)[0]) for r in records]
    # sft.py's batches (sft.train_batches): one epoch, a permutation seeded with --seed (42), MICRO per step
    perm = torch.randperm(len(records), generator=torch.Generator().manual_seed(args.seed)).tolist()
    steps = [[lengths[i] for i in perm[k * MICRO:(k + 1) * MICRO]] for k in range(WARMUP, STEPS)]
    return model_dir, data, [sum(s) for s in steps], [MICRO * max(s) for s in steps]


def throughput(out, rows, peak):
    """SFT real tokens/s of the ~350M model, padded, packed and with flash-attn -> {layout: figures}."""
    model_dir, data, real, padded = throughput_data(out)
    params = count_params(model_dir)
    base = ["sft.py", "--pretrain", model_dir, "--dataset", data, "--max_len", 1024, "--train_batch_size", MICRO,
            "--micro_train_batch_size", MICRO, "--max_epochs", 1, "--bf16", "--zero_stage", 2, "--learning_rate",
            1e-5, "--logging_steps", 1, "--eval_dataset", ""]
    layouts = {"padded": [], "packed": ["--packing_samples"], "flash-attn": ["--flash_attn", "--packing_samples"]}
    figures = {}
    for layout, flags in layouts.items():
        name = f"SFT {params / 1e6:.0f}M, {layout}"
        if layout == "flash-attn" and importlib.util.find_spec("flash_attn") is None:
            rows.append((name, "-", "-", "-", "skipped: flash-attn is not installed"))
            continue
        results, wall, log = run(name, [*base, *flags, "--save_path", out / f"sft_{layout}"], out / f"sft_{layout}")
        rates = [float(line.split("tokens_per_s=")[1].split()[0]) for line in log.splitlines()
                 if line.startswith("train step") and "tokens_per_s=" in line][WARMUP:]
        if results is None or len(rates) != STEPS - WARMUP:
            rows.append((name, "-", f"{wall:.0f}", "-", "FAILED"))
            continue
        seconds = [n / rate for n, rate in zip(real, rates)]  # each measured step's time
        tokens = sum(real) / sum(seconds)
        figures[layout] = {"real_tokens_per_s": tokens, "mfu": 6 * params * tokens / (peak * 1e12) if peak else None,
                           "peak_gpu_mb": results.get("peak_gpu_mb"), "step_seconds": seconds}
        mfu = f", MFU {figures[layout]['mfu']:.1%}" if peak else ""
        rows.append((name, f"{tokens:,.0f} real tokens/s{mfu}", f"{wall:.0f}",
                     f"{results.get('peak_gpu_mb', 0):,.0f}", "ok"))
    padding = sum(padded) / sum(real)
    goal = lambda x: "ok" if x >= 0.9 else "below the 0.90 goal"  # noqa: E731  (a figure, not a failure)
    if "padded" in figures and "packed" in figures:
        # padding whose pads cost nothing: each padded step's time scaled by its real / padded tokens
        ideal = sum(real) / sum(t * n / m for t, n, m in zip(figures["padded"]["step_seconds"], real, padded))
        of_ideal = figures["packed"]["of_padding_free_ideal"] = figures["packed"]["real_tokens_per_s"] / ideal
        rows.append(("packed / padding-free ideal", f"{of_ideal:.2f}x (ideal {ideal:,.0f} real tokens/s; padded/real "
                     f"tokens {padding:.2f})", "-", "-", goal(of_ideal)))
    if "flash-attn" in figures and "packed" in figures:
        of_flash = figures["packed"]["of_flash_attn"] = (figures["packed"]["real_tokens_per_s"]
                                                         / figures["flash-attn"]["real_tokens_per_s"])
        rows.append(("packed / flash-attn", f"{of_flash:.2f}x", "-", "-", goal(of_flash)))
    return {"params": params, "padded_over_real_tokens": padding, **figures}


def count_params(model_dir):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return sum(p.numel() for p in model.parameters())


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/gpu_check", help="where the runs, their logs and gpu_check.json go")
    p.add_argument("--peak_tflops", type=float, default=None, help="the GPU's dense bf16 peak (default: by name)")
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit(f"gpu_check: no CUDA GPU here (torch {torch.__version__}): it checks the GPU paths on one; "
                 "nothing was run")
    from rich.console import Console
    from rich.table import Table

    # the GPU's name and the packed attention path, asked in a process of their own: this one holds no CUDA memory
    probe = ("import json, torch, packing; k = packing.torch_varlen(0); print(json.dumps([torch.cuda.get_device_name(), "
             "torch.version.cuda, k and ('native' if packing.takes_gqa(k) else 'by repeated key/value heads')]))")
    gpu, cuda, gqa = json.loads(subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                                               check=True).stdout.splitlines()[-1])
    peak = args.peak_tflops or next((tf for part, tf in PEAK_TFLOPS if part in gpu), None)
    versions = {}
    for name in ("torch", "transformers", "deepspeed", "vllm", "flash-attn"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    kernel = f"torch varlen_attn, GQA {gqa}" if gqa else "no varlen kernel: packed_sdpa loops over the pieces"
    print(f"{gpu}, dense bf16 peak {peak or '?'} TFLOP/s; CUDA {cuda}; {versions}; packed attention: {kernel}",
          flush=True)
    out = (ROOT / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t, rows = time.time(), []
    pipeline(out, rows)
    speed = throughput(out, rows, peak)
    table = Table(title=f"GPU self-check: {gpu}, {time.strftime('%Y-%m-%d')}, {time.time() - t:.0f} s")
    for col in ("stage", "figure", "seconds", "peak GPU MB", "status"):
        table.add_column(col)
    for row in rows:
        table.add_row(*row)
    Console(width=160).print(table)
    failed = [r[0] for r in rows if r[4].startswith("FAILED")]
    columns = ("stage", "figure", "seconds", "peak_gpu_mb", "status")
    report = {"gpu": gpu, "cuda": cuda, "packed_attention": kernel, "peak_tflops": peak,
              "date": time.strftime("%Y-%m-%d"), "versions": versions, "seconds": time.time() - t,
              "rows": [dict(zip(columns, r)) for r in rows], "throughput": speed, "failed": failed}
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out / 'gpu_check.json'}")
    sys.exit(f"gpu_check: {len(failed)} failed: {', '.join(failed)}" if failed else 0)


if __name__ == "__main__":
    main()
