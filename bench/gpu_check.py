"""The GPU self-check: what to run first on a new GPU machine, and what we run whenever a GPU is at hand.

    make gpu-check          (or: .venv/bin/python bench/gpu_check.py [--out runs/gpu_check] [--peak_tflops N]
                                 [--only pipeline|throughput] [--micro 8 64] [--rows packed liger ...])

On one CUDA GPU, offline, with whatever is installed (a row that needs vllm, flash-attn, liger-kernel or trl says it
was skipped where they are not):
1. pipeline: the toy pipeline in bf16 under DeepSpeed, each stage as a user runs it: SFT (with --packing_samples, so
   torch's varlen kernel), RM, GRPO on HF generate, GRPO on --vllm, PPO from that RM; each stage's held-out figure and
   time. SFT and RM must learn the toy task (exact match >= 50%, pair accuracy >= 80%; 97.6% and 98.0% in float32 on
   CPU). 184 s on an H200.
2. throughput: SFT of a random ~350M Llama-shaped model (24 layers, hidden 1024, 16 query / 8 key-value heads, vocab
   32k) on samples of 400-1,000 tokens, ZeRO-2, at micro-batch 8 (40 steps, 6-40 timed) and 64 (17 steps, 6-15
   timed): real tokens/s, MFU and peak memory of each row (--rows):
     padded, packed (packing.packed_sdpa), flash-attn (--flash_attn --packing_samples), liger (packed +
     --use_liger_kernel), compile (packed + --torch_compile), trl-padded and trl-padding_free (TRL's SFTTrainer on
     the same model and batches, sdpa, as trl_sft() runs it; padding_free at micro-batch 64 only when --rows names
     it: KNOWN_OOM);
   packed against the padding-free ideal (padded real-tokens/s x padded tokens / real tokens: padding whose pads cost
   nothing), against flash-attn and TRL's best; liger and compile against packed. The packed micro-64 run is also
   profiled (torch.profiler, steps 16-17, after its timed ones): the top ops by CUDA time and their share of it.
   Each row is a process of its own (its peak memory is its own). About 8 minutes on an H200 (an estimate from the
   wall times of its rows there, the new rows unmeasured), 4 of them at micro-batch 64; bench/README.md has each
   subset's.
MFU = 6 x parameters x real tokens/s over the GPU's dense bf16 peak (PEAK_TFLOPS by device name, or --peak_tflops).
It prints its tables as Markdown, writes <out>/gpu_check.json (after every row, so a run cut short leaves what it
measured) and <out>/profile_micro64.txt, and exits 1 if any stage fails (running out of memory is a figure, not a
failure); without CUDA it says so in one line.
"""
import argparse
import gc
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
LENGTHS = (400, 1000)  # tokens a sample, BOS and EOS included
STEPS = {8: 40, 64: 17}  # throughput: optimizer steps of one micro-batch each, by micro-batch size
TIMED = {8: (6, 40), 64: (6, 15)}  # the steps timed, first and last: after a warm-up of 5
PROFILE = (16, 17)  # the packed micro-64 run's profiled steps: after its timed ones, so that none is profiled
PROFILE_TOP = 15
ROW_TIMEOUT = 300  # seconds a throughput row may take
# row: (label, sft.py's flags; None: TRL's SFTTrainer, padding_free or not)
ROWS = {
    "padded": ("ours, padded", []),
    "packed": ("ours, packed", ["--packing_samples"]),
    "flash-attn": ("ours, flash-attn (packed)", ["--flash_attn", "--packing_samples"]),
    "liger": ("ours, packed + Liger kernels", ["--packing_samples", "--use_liger_kernel"]),
    "compile": ("ours, packed + torch.compile", ["--packing_samples", "--torch_compile"]),
    "trl-padded": ("TRL SFTTrainer, padded (sdpa)", None),
    "trl-padding_free": ("TRL SFTTrainer, padding_free (sdpa)", None),
}
# rows left out unless --rows names them: what they did on the largest GPU so far
KNOWN_OOM = {(64, "trl-padding_free"): "out of memory on an H200 on 2026-11-27 (sdpa over a dense mask of the whole "
                                       "45k-token row, > 139 GiB); --rows trl-padding_free runs it"}
COLUMNS = ("stage", "figure", "seconds", "peak_gpu_mb", "status")


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
        what = "out of memory" if out_of_memory(log) else "FAILED"
        print(f"{name}: {what} ({tail[0][:200]}; log: {out}.log)", flush=True)
        return None, time.time() - t, log
    return json.loads(results.read_text()), time.time() - t, log


def out_of_memory(log):
    return "OutOfMemoryError" in log or "CUDA out of memory" in log


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


# ---------------------------------------------------------------------------------------------- throughput
def random_model(out):
    """A random ~350M Llama (bf16) with the toy tokenizer, built once -> (its directory, the tokenizer)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

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
    return model_dir, tokenizer


def throughput_data(out, tokenizer, micro, steps):
    """steps x micro samples of LENGTHS tokens -> (sft.py's data file, TRL's (the same samples in the order of sft.py's
    batches, prompt/completion), each step's real tokens and its padded ones: micro x its longest sample). The same
    seed at every size: micro 8 x 40 steps are the samples the H200 run of 2026-11-27 measured."""
    import torch

    import sft

    rng, records = random.Random(0), []
    for _ in range(steps * micro):
        length = rng.randint(*LENGTHS) - 2  # BOS and EOS
        text = "".join(rng.choice("0123456789+=") for _ in range(length))
        records.append({"input": text[:length // 2], "output": text[length // 2:]})
    data, trl_data = out / f"sft_micro{micro}.jsonl", out / f"trl_micro{micro}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    args = sft.add_training_args(argparse.ArgumentParser()).parse_args([])
    args.__dict__.update(output_key="output", multiturn=False, pretrain_mode=False, max_len=1024)
    lengths = [len(sft.tokenize_sample(r, tokenizer, args)[0]) for r in records]
    # sft.py's batches (sft.train_batches): one epoch, a permutation seeded with --seed (42), micro per step
    perm = torch.randperm(len(records), generator=torch.Generator().manual_seed(args.seed)).tolist()
    trl_data.write_text("".join(json.dumps({"prompt": records[i]["input"], "completion": records[i]["output"]}) + "\n"
                                for i in perm))
    batches = [[lengths[i] for i in perm[k * micro:(k + 1) * micro]] for k in range(steps)]
    return data, trl_data, [sum(b) for b in batches], [micro * max(b) for b in batches]


def mfu(params, tokens_per_s, peak):
    """Model FLOP utilisation: 6 x parameters x real tokens/s over the peak (TFLOP/s; None: unknown)."""
    return 6 * params * tokens_per_s / (peak * 1e12) if peak else None


def step_rates(log):
    """sft.py's log -> {step: its tokens_per_s} ("train step N: ... tokens_per_s=X ...", --logging_steps 1)."""
    rates = {}
    for line in log.splitlines():
        if line.startswith("train step ") and "tokens_per_s=" in line:
            rates[int(line.split()[2].rstrip(":"))] = float(line.split("tokens_per_s=")[1].split()[0])
    return rates


def speed(real, seconds, params, peak, steps):
    """One row's figures from each step's real tokens (real[k - 1] for step k) and seconds ({step: s}) over the timed
    `steps` (first, last). None when one of them is missing (the run did not log every step)."""
    timed = list(range(steps[0], steps[1] + 1))
    if any(k not in seconds for k in timed):
        return None
    rate = sum(real[k - 1] for k in timed) / sum(seconds[k] for k in timed)
    return {"real_tokens_per_s": rate, "mfu": mfu(params, rate, peak), "timed_steps": [timed[0], timed[-1]],
            "real_tokens_per_step": sum(real[k - 1] for k in timed) / len(timed),
            "step_seconds": [seconds[k] for k in timed], "slowest_step_s": max(seconds[k] for k in timed)}


def padding_free_ideal(padded_seconds, real, padded, first):
    """Padding whose pads cost nothing: each timed padded step's time (from step `first` on) scaled by its real /
    padded tokens -> real tokens/s."""
    timed = range(first, first + len(padded_seconds))
    return sum(real[k - 1] for k in timed) / sum(t * real[k - 1] / padded[k - 1] for t, k in zip(padded_seconds, timed))


def figure_text(f):
    mfu_text = f", MFU {f['mfu']:.1%}" if f.get("mfu") is not None else ""
    return f"{f['real_tokens_per_s']:,.0f} real tokens/s{mfu_text}"


def sft_args(model_dir, data, micro, flags, save):
    return ["--pretrain", model_dir, "--dataset", data, "--max_len", 1024, "--train_batch_size", micro,
            "--micro_train_batch_size", micro, "--max_epochs", 1, "--bf16", "--zero_stage", 2, "--learning_rate",
            1e-5, "--logging_steps", 1, "--eval_dataset", "", *flags, "--save_path", save]


# the children: gpu_check.py's own functions, each in a process of its own
CHILD = "import sys; sys.path.insert(0, 'bench'); import gpu_check; "
PROFILED = CHILD + "gpu_check.profiled_sft(sys.argv[1], (int(sys.argv[2]), int(sys.argv[3])), sys.argv[4:])"
TRL = CHILD + "gpu_check.trl_sft(sys.argv[1])"


def ours(name, out, micro, row, model_dir, data, real, params, peak, profile=None):
    """One row of ours: sft.py with the row's flags (under the profiler with `profile`, a summary path) ->
    (figures or None, status, wall seconds)."""
    save = out / f"sft_micro{micro}_{row}"
    args = sft_args(model_dir, data, micro, ROWS[row][1], save)
    cmd = ["sft.py", *args] if profile is None else ["-c", PROFILED, profile, *PROFILE, *args]
    results, wall, log = run(name, cmd, save, timeout=ROW_TIMEOUT)
    if results is None:
        return None, "out of memory" if out_of_memory(log) else "FAILED", wall
    rates = step_rates(log)
    figures = speed(real, {k: real[k - 1] / r for k, r in rates.items() if 0 < k <= len(real)}, params, peak,
                    TIMED[micro])
    if figures is None:
        return None, f"FAILED: steps {TIMED[micro][0]}-{TIMED[micro][1]} not all logged", wall
    return dict(figures, peak_gpu_mb=results.get("peak_gpu_mb")), "ok", wall


def theirs(name, out, micro, row, model_dir, trl_data, real, params, peak):
    """One row of TRL's SFTTrainer (trl_sft in a process of its own) -> (figures or None, status, wall seconds)."""
    save = out / f"sft_micro{micro}_{row}"
    config = out / f"{row}_micro{micro}.json"
    config.write_text(json.dumps({"model": str(model_dir), "data": str(trl_data), "micro": micro,
                                  "steps": STEPS[micro], "padding_free": row == "trl-padding_free",
                                  "out": str(save)}))
    results, wall, log = run(name, ["-c", TRL, config], save, timeout=ROW_TIMEOUT)
    if results is None:
        return None, "out of memory" if out_of_memory(log) else "FAILED", wall
    if results["out_of_memory"]:
        return {"peak_gpu_mb": results["peak_gpu_mb"]}, "out of memory", wall
    times, tokens = results["step_end_times"], results["step_tokens"]
    seconds = {k: times[k - 1] - times[k - 2] for k in range(2, len(times) + 1)}  # step k ends at times[k - 1]
    figures = speed(tokens, seconds, params, peak, TIMED[micro]) if len(tokens) == STEPS[micro] else None
    if figures is None:
        return None, f"FAILED: {len(times)} steps timed, {len(tokens)} batches counted, not {STEPS[micro]}", wall
    # the same batches as ours (trl_sft reads them in sft.py's order): the same real tokens, step by step
    return dict(figures, peak_gpu_mb=results["peak_gpu_mb"], same_batches_as_ours=tokens == real), "ok", wall


def missing(row):
    """Why a row cannot run here, or None."""
    if row == "flash-attn" and importlib.util.find_spec("flash_attn") is None:
        return "skipped: flash-attn is not installed"
    if row == "liger":
        lacking = [p for p in ("liger_kernel", "triton") if importlib.util.find_spec(p) is None]
        if lacking:
            return f"skipped: {' and '.join(x.replace('_', '-') for x in lacking)} not installed"
    if row == "compile":
        import sft
        if "--torch_compile" not in sft.add_training_args(argparse.ArgumentParser())._option_string_actions:
            return "skipped: this sft.py has no --torch_compile"
    if row.startswith("trl") and importlib.util.find_spec("trl") is None:
        return "skipped: trl not installed"
    return None


def throughput(out, rows, peak, micros, chosen, explicit, save):
    """SFT real tokens/s of the ~350M model, each row of `chosen` at each micro-batch size of `micros`; rows get one
    line each (and the ratios); save() after every row -> {params, "8": {row: figures}, ..., "profile": ...}."""
    model_dir, tokenizer = random_model(out)
    params = count_params(model_dir)
    speed_report = {"params": params, "steps": {str(m): STEPS[m] for m in micros},
                    "timed": {str(m): TIMED[m] for m in micros}}
    for micro in micros:
        data, trl_data, real, padded = throughput_data(out, tokenizer, micro, STEPS[micro])
        timed = slice(TIMED[micro][0] - 1, TIMED[micro][1])
        figures = speed_report[str(micro)] = {"real_tokens_per_step": sum(real[timed]) / len(real[timed]),
                                              "padded_over_real_tokens": sum(padded[timed]) / sum(real[timed])}
        for row in chosen:
            label = ROWS[row][0]
            name = f"SFT {params / 1e6:.0f}M micro {micro}, {label}"
            why = missing(row) or (None if explicit else KNOWN_OOM.get((micro, row)))
            if why:
                why = why if why.startswith("skipped") else f"skipped: {why}"
                figures[row] = {"status": why}
                rows.append((name, "-", "-", "-", why))
                print(f"{name}: {why}", flush=True)
                continue
            profile = str(out / "profile_micro64.json") if (micro, row) == (64, "packed") else None
            if profile:  # no summary of an earlier check's
                Path(profile).unlink(missing_ok=True)
                Path(profile).with_suffix(".txt").unlink(missing_ok=True)
            if ROWS[row][1] is None:
                f, status, wall = theirs(name, out, micro, row, model_dir, trl_data, real, params, peak)
            else:
                f, status, wall = ours(name, out, micro, row, model_dir, data, real, params, peak, profile)
            figures[row] = dict(f or {}, status=status, seconds=wall)
            memory = f"{f['peak_gpu_mb']:,.0f}" if f and f.get("peak_gpu_mb") is not None else "-"
            text = figure_text(f) if f and "real_tokens_per_s" in f else "-"
            rows.append((name, text, f"{wall:.0f}", memory, status))
            print(f"{name}: {text}, peak {memory} MiB, {wall:.0f} s, {status}", flush=True)
            if profile and status == "ok":
                if Path(profile).exists():
                    summary = speed_report["profile"] = json.loads(Path(profile).read_text())
                    top = ", ".join(f"{o['op']} {o['share']:.0%}" for o in summary["top_ops"][:4])
                    rows.append((f"micro {micro}: profile of steps {PROFILE[0]}-{PROFILE[1]}", f"kernels "
                                 f"{summary['kernel_share_of_wall']:.0%} of the wall; {top}", "-", "-", "ok"))
                else:
                    rows.append((f"micro {micro}: profile", "-", "-", "-", f"FAILED: no {Path(profile).name}"))
            save()
        ratios(figures, rows, micro, real, padded)
        save()
    return speed_report


def ratios(figures, rows, micro, real, padded):
    """The comparisons of one micro-batch size's rows, into `figures` and `rows` (figures, not failures)."""
    def rate(row):
        return figures.get(row, {}).get("real_tokens_per_s")

    def goal(x):
        return "ok" if x >= 0.9 else "below the 0.90 goal"
    packed = rate("packed")
    if packed and rate("padded"):
        ideal = padding_free_ideal(figures["padded"]["step_seconds"], real, padded, TIMED[micro][0])
        of_ideal = figures["packed"]["of_padding_free_ideal"] = packed / ideal
        rows.append((f"micro {micro}: packed / padding-free ideal", f"{of_ideal:.2f}x (ideal {ideal:,.0f} real "
                     f"tokens/s; padded/real tokens {figures['padded_over_real_tokens']:.2f})", "-", "-",
                     goal(of_ideal)))
    if packed and rate("flash-attn"):
        of_flash = figures["packed"]["of_flash_attn"] = packed / rate("flash-attn")
        rows.append((f"micro {micro}: packed / flash-attn", f"{of_flash:.2f}x", "-", "-", goal(of_flash)))
    trl = max((r for r in ("trl-padded", "trl-padding_free") if rate(r)), key=rate, default=None)
    if packed and trl:
        of_trl = figures["packed"]["of_trl_best"] = packed / rate(trl)
        rows.append((f"micro {micro}: packed / TRL's best ({trl[4:]})", f"{of_trl:.2f}x", "-", "-", "ok"))
    for row in ("liger", "compile"):
        if packed and rate(row):
            gain = figures[row]["of_packed"] = rate(row) / packed
            rows.append((f"micro {micro}: {ROWS[row][0][6:]} / packed", f"{gain:.2f}x", "-", "-",
                         "faster" if gain > 1 else "not faster"))


def count_params(model_dir):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------- the children
def profiled_sft(summary_path, steps, args, top=PROFILE_TOP):
    """sft.py's main() with `args`, torch.profiler over its optimizer steps steps[0]..steps[1] (started and stopped
    between steps, when sft.py logs one: outside every step's timing); profile_summary() to summary_path, the
    profiler's table beside it (.txt)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    import common
    import sft

    cuda, log, state = torch.cuda.is_available(), common.Logger.log, {}

    def logged(self, step, metrics, prefix="train"):
        log(self, step, metrics, prefix)
        if prefix != "train":
            return
        if step == steps[0] - 1:
            if cuda:
                torch.cuda.synchronize()
            state["profiler"] = profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda)
            state["profiler"].start()
            state["start"] = time.time()
        elif step == steps[1] and "profiler" in state:
            if cuda:
                torch.cuda.synchronize()
            wall = time.time() - state["start"]
            state["profiler"].stop()
            averages = state["profiler"].key_averages()
            peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
            summary = profile_summary(averages, steps, wall, peak, top)
            by = "self_cuda_time_total" if cuda else "self_cpu_time_total"
            Path(summary_path).with_suffix(".txt").write_text(
                f"PROFILE of optimizer steps {steps[0]}-{steps[1]}: wall {wall:.3f} s; kernel time "
                f"{summary['kernel_s_per_step'] * (steps[1] - steps[0] + 1):.3f} s = "
                f"{summary['kernel_share_of_wall']:.0%} of the wall; peak {peak or 0:,.0f} MiB\n"
                + averages.table(sort_by=by, row_limit=40, max_name_column_width=60) + "\n")
            Path(summary_path).write_text(json.dumps(summary, indent=1) + "\n")
            state.clear()  # the profiler's events go now, not in a timed step
            del averages
            gc.collect()

    common.Logger.log = logged
    sys.argv = ["sft.py", *args]
    sft.main()


def profile_summary(averages, steps, wall, peak_mb, top=PROFILE_TOP):
    """torch.profiler's key_averages() over optimizer steps steps[0]..steps[1] -> per step: the wall, the kernel time
    (CUDA events, as the profiler's own "Self CUDA time total") and its share of the wall, and the top ops by their own
    CUDA time (the kernels each launched itself: the ops' shares add up to about 100%) with their share of it."""
    from torch.autograd import DeviceType

    n = steps[1] - steps[0] + 1
    kernels = sum(e.self_device_time_total for e in averages
                  if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False))
    ops = sorted((e for e in averages if e.device_type == DeviceType.CPU and e.self_device_time_total > 0),
                 key=lambda e: e.self_device_time_total, reverse=True)
    return {"steps": list(steps), "wall_s_per_step": wall / n, "kernel_s_per_step": kernels / 1e6 / n,
            "kernel_share_of_wall": kernels / 1e6 / wall if wall else None, "peak_gpu_mb": peak_mb,
            "top_ops": [{"op": e.key, "cuda_ms_per_step": e.self_device_time_total / 1e3 / n,
                         "share": e.self_device_time_total / kernels, "calls_per_step": e.count / n}
                        for e in ops[:top]]}


def trl_sft(config_path):
    """TRL's side of a throughput row: SFTTrainer (TRL 1.16) on the same model and the same batches as sft.py (the
    prompt/completion file in the order of sft.py's batches, read in order; completion-only loss), run the way
    bench/trl_runner.py runs it: the model as from_pretrained loads it (bf16, as saved; sdpa), bf16=True, no gradient
    checkpointing (TRL's default turns it on), the same learning rate, one micro-batch a step; TRL's own collator,
    padded or padding_free. Timed at the end of every optimizer step (after a CUDA sync); each step's real tokens
    counted from its batch. Writes <out>/eval_results.json: step_end_times, step_tokens, peak_gpu_mb, out_of_memory."""
    import torch
    from datasets import load_dataset
    from torch.utils.data import SequentialSampler
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    cfg = json.loads(Path(config_path).read_text())
    cuda, times, tokens = torch.cuda.is_available(), [], []
    out = Path(cfg["out"])
    out.mkdir(parents=True, exist_ok=True)

    class StepTimer(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            times.append(time.time())

    class Trainer(SFTTrainer):
        def _get_train_sampler(self, train_dataset=None):  # the file's order: sft.py's batches, step by step
            return SequentialSampler(self.train_dataset if train_dataset is None else train_dataset)

        def training_step(self, model, inputs, *args, **kwargs):  # the batch's real tokens
            tokens.append(int(inputs["attention_mask"].sum()) if "attention_mask" in inputs
                          else int(inputs["input_ids"].numel()))
            return super().training_step(model, inputs, *args, **kwargs)

    torch.manual_seed(42)
    tokenizer = AutoTokenizer.from_pretrained(cfg["model"])
    model = AutoModelForCausalLM.from_pretrained(cfg["model"], attn_implementation="sdpa")
    model.config.use_cache = False  # padding-free rows are only right without the cache (see STACK.md)
    data = load_dataset("json", data_files=cfg["data"], split="train")
    args = SFTConfig(output_dir=str(out), per_device_train_batch_size=cfg["micro"], gradient_accumulation_steps=1,
                     max_steps=cfg["steps"], num_train_epochs=1, learning_rate=1e-5, max_grad_norm=1.0, bf16=cuda,
                     use_cpu=not cuda, gradient_checkpointing=False, max_length=None, padding_free=cfg["padding_free"],
                     completion_only_loss=True, logging_steps=1, save_strategy="no", report_to="none", seed=42,
                     dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=data, processing_class=tokenizer, callbacks=[StepTimer()])
    oom = False
    try:
        trainer.train()
    except torch.OutOfMemoryError:
        oom = True
    (out / "eval_results.json").write_text(json.dumps({
        "step_end_times": times, "step_tokens": tokens, "out_of_memory": oom,
        "peak_gpu_mb": torch.cuda.max_memory_allocated() / 2**20 if cuda else None}) + "\n")


# ---------------------------------------------------------------------------------------------- the tables
def markdown(header, rows):
    """A Markdown table (a | inside a cell escaped)."""
    cells = [[str(c).replace("|", "\\|") for c in row] for row in rows]
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
                      *("| " + " | ".join(row) + " |" for row in cells)])


def speed_table(speed_report):
    """The throughput rows as the README's table: micro-batch (real tokens a step), layout, real tokens/s, MFU, peak
    GPU MiB, status."""
    lines = []
    for key, figures in speed_report.items():
        if not key.isdigit():
            continue
        micro = f"{key} (~{figures['real_tokens_per_step'] / 1000:.1f}k)"
        for row, f in figures.items():
            if row not in ROWS:
                continue
            lines.append((micro, ROWS[row][0], f"{f['real_tokens_per_s']:,.0f}" if "real_tokens_per_s" in f else "-",
                          f"{f['mfu']:.1%}" if f.get("mfu") is not None else "-",
                          f"{f['peak_gpu_mb']:,.0f}" if f.get("peak_gpu_mb") is not None else "-", f["status"]))
    return markdown(("micro-batch (real tokens a step)", "layout", "real tokens/s", "MFU", "peak GPU MiB", "status"),
                    lines)


def profile_table(summary):
    """profile_summary() as Markdown: a line on the step, then the top ops."""
    head = (f"Packed micro-64 step, steps {summary['steps'][0]}-{summary['steps'][1]} profiled: wall "
            f"{summary['wall_s_per_step']:.3f} s a step, kernels {summary['kernel_s_per_step']:.3f} s "
            f"({summary['kernel_share_of_wall']:.0%} of the wall)")
    return head + "\n\n" + markdown(("op", "CUDA ms a step", "share of kernel time", "calls a step"), [
        (o["op"], f"{o['cuda_ms_per_step']:.1f}", f"{o['share']:.1%}", f"{o['calls_per_step']:.0f}")
        for o in summary["top_ops"]])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/gpu_check", help="where the runs, their logs and gpu_check.json go")
    p.add_argument("--peak_tflops", type=float, default=None, help="the GPU's dense bf16 peak (default: by name)")
    p.add_argument("--only", nargs="+", choices=("pipeline", "throughput"), default=("pipeline", "throughput"),
                   help="run only these parts (default: both)")
    p.add_argument("--micro", nargs="+", type=int, choices=sorted(STEPS), default=sorted(STEPS),
                   help="throughput: these micro-batch sizes (default: all)")
    p.add_argument("--rows", nargs="+", choices=list(ROWS), default=None,
                   help="throughput: these rows (default: all, but those known to run out of memory)")
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit(f"gpu_check: no CUDA GPU here (torch {torch.__version__}): it checks the GPU paths on one; "
                 "nothing was run")

    # the GPU's name and the packed attention path, asked in a process of their own: this one holds no CUDA memory
    probe = ("import json, torch, packing; k = packing.torch_varlen(0); "
             "print(json.dumps([torch.cuda.get_device_name(), torch.version.cuda, "
             "k and ('native' if packing.takes_gqa(k) else 'by repeated key/value heads')]))")
    gpu, cuda, gqa = json.loads(subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                                               check=True).stdout.splitlines()[-1])
    peak = args.peak_tflops or next((tf for part, tf in PEAK_TFLOPS if part in gpu), None)
    versions = {}
    for name in ("torch", "transformers", "deepspeed", "vllm", "flash-attn", "trl", "liger-kernel", "triton"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    try:  # a copy of the tree without its .git (or no git) has none
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip() or None
    except OSError:
        commit = None
    kernel = f"torch varlen_attn, GQA {gqa}" if gqa else "no varlen kernel: packed_sdpa loops over the pieces"
    print(f"{gpu}, dense bf16 peak {peak or '?'} TFLOP/s; CUDA {cuda}; commit {commit}; {versions}; packed "
          f"attention: {kernel}", flush=True)
    out = (ROOT / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t, rows = time.time(), []
    report = {"gpu": gpu, "cuda": cuda, "packed_attention": kernel, "peak_tflops": peak,
              "date": time.strftime("%Y-%m-%d"), "commit": commit, "versions": versions, "only": list(args.only),
              "seconds": None, "rows": [], "throughput": None, "failed": []}

    def save():
        report.update(seconds=time.time() - t, rows=[dict(zip(COLUMNS, r)) for r in rows],
                      failed=[r[0] for r in rows if r[4].startswith("FAILED")])
        (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")

    if "pipeline" in args.only:
        pipeline(out, rows)
        save()
    if "throughput" in args.only:
        chosen = args.rows or list(ROWS)
        report["throughput"] = throughput(out, rows, peak, sorted(set(args.micro)), chosen, args.rows is not None,
                                          save)
    save()
    print(f"\n## GPU self-check: {gpu}, {report['date']}, commit {commit}, {report['seconds']:.0f} s\n")
    print(markdown(("stage", "figure", "seconds", "peak GPU MiB", "status"), rows))
    if report["throughput"]:
        print(f"\n## SFT throughput, {report['throughput']['params'] / 1e6:.0f}M parameters\n")
        print(speed_table(report["throughput"]))
        if "profile" in report["throughput"]:
            print("\n" + profile_table(report["throughput"]["profile"]))
    print(f"\nwrote {out / 'gpu_check.json'}")
    failed = report["failed"]
    sys.exit(f"gpu_check: {len(failed)} failed: {', '.join(failed)}" if failed else 0)


if __name__ == "__main__":
    main()
