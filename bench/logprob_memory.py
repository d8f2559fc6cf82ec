"""Peak memory and time of the loss's pass, today (git HEAD before issue 52: the [tokens, V] logits, upcast to fp32)
against now (common.forward_hidden, then the output layer a chunk of rows at a time: SFT's gradient taken in the
forward pass, the log-probs' chunks recomputed in backward), for 16,384 tokens at vocabularies of 32,000 and 151,936.

    .venv/bin/python bench/logprob_memory.py [--bf16] [--vocabs 32000,151936] [--seqs 16] [--seq_len 1024]
                                             [--prompt_len 128] [--cap_gb 13] [--passes 3] [--time_budget_s 30]
                                             [--passes_to_run sft,"rl train",rollout]

   (about 20 minutes in fp32 on 2 shared CPU cores)

1. The model: a random-init Qwen2 (hidden 64, 2 layers, 4 heads, tied embeddings) with the vocabulary asked, fp32 (or
   bf16, as on GPUs) on the CPU, built from a config here (nothing downloaded), the same seed in every process. Its
   body is tiny, so the pass's memory and time are the output layer's and what is made of its logits.
2. The batch: --seqs sequences of --seq_len random tokens (16 x 1024 = 16,384 tokens), all the same length (no
   padding), the same in every process (the first k of them where a count k < --seqs is measured). SFT: the first
   --prompt_len tokens of each are labelled -100, so 16 x 896 = 14,336 tokens get a loss. RL: the same tokens as
   (prompt, response) pairs of 128 + 896, so 14,336 response tokens get a log-prob.
3. The passes, each today and now:
   sft       forward + backward of the SFT loss. today: model(...).logits, then today_sft_loss, a verbatim copy of
             HEAD's sft.sft_loss (the [B, T, V] logits shifted, upcast, cross_entropy). now: common.forward_hidden,
             then sft.sft_loss_chunked (sft.token_nll_sum's LinearNLL over the labelled positions).
   rl train  forward + backward of the sum of the response log-probs, called as grpo.actor_step calls it (entropy as
             a metric, without a graph, the --entropy_loss_coef 0 default). today: today_response_logprobs, a
             verbatim copy of HEAD's common.response_logprobs and its helpers (the logits of every response row
             from the model's LM head via logits_to_keep, then fp32 chunks under checkpoint). now:
             common.response_logprobs.
   rollout   the same log-probs under no_grad (grpo.rollout_logprobs), no entropy.
4. Memory: each measurement runs in a fresh process: the peak resident set (ru_maxrss) during the pass minus the
   resident set just before it, after the model and batch exist, one small warm-up pass of the same kind has run
   (thread pools, one-time buffers) and, for the training passes, the parameters' .grad are allocated (zeroed), so
   only the pass itself is counted. The process keeps freed memory as training does (common.keep_freed_memory);
   tensors over 32 MB go back to the system when freed, so this is the pass's own high-water mark of live tensors,
   within a few MB. The process's address space is capped (RLIMIT_AS) so that it stays within --cap_gb in all: a
   pass whose allocations pass the cap prints "out of memory (> N GB)", N the room it had over its baseline, and
   today/now the lower bound N / now's peak. Today is then measured again at the largest of --seqs/2, /4, ...
   sequences that fits, and at half that, and now at the fitting count too; "at --seqs by linear extrapolation"
   extends today's two fitting figures linearly in tokens (the logits are linear in tokens), an estimate.
5. Time: the wall time and the process's CPU time (all its threads: the steadier on a shared machine) of the pass
   (forward, loss, backward; grads accumulated in place), each the median of the memory pass and repeats: at most
   --passes in all, none begun once --time_budget_s of passes is spent (so a pass longer than that is timed once;
   column n: how many). t/n is today / now: above 1, now is faster. The load average is printed at the start and
   end: the other users of a shared machine slow the wall times.
6. Checks, where today and now ran on the same batch: the loss (sft) or the per-token log-probs (rl, rollout) of the
   two against each other and against float64 (a log_softmax in float64 of the model's own logits: model.model's
   hidden states through model.lm_head, computed after the peak was taken), and the training passes' gradients of
   every parameter against each other (max |difference| over max |gradient|). Fails if today and now differ by
   more than 4 fp32 spacings, or their gradients by more than 1e-5 of the largest (bf16: 1e-2).
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence
from torch.utils.checkpoint import checkpoint

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import common  # noqa: E402
import sft  # noqa: E402

PASSES = ("sft", "rl train", "rollout")
IMPLS = ("today", "now")


# ------------------------------------------------------------------------ today: HEAD's code, verbatim
def today_sft_loss(logits, labels):
    """"today": sft.sft_loss as git HEAD (before issue 52) has it, verbatim; sft.py trained with
    `loss = sft_loss(model(...).logits, labels)`."""
    logits, targets = logits[:, :-1], labels[:, 1:]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 logits: CE in fp32
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100)


def today_response_logits_to_keep(inputs, where):
    """"today": common.response_logits_to_keep as git HEAD has it, verbatim."""
    rows, cols = where
    if inputs["input_ids"].size(0) == 1:
        return cols, (rows, torch.arange(len(cols), device=cols.device))
    first = cols.min()
    return torch.arange(first, inputs["input_ids"].size(1), device=cols.device), (rows, cols - first)


TODAY_LOGPROB_CHUNK = 1024  # logit rows upcast to fp32 at a time: 0.6 GB for a 152k vocabulary


def today_response_logprobs(model, batch, pad_id, packing, temperature=1.0, per_token=True, with_entropy=False,
                            entropy_grad=True, share_prompts=True):
    """"today": common.response_logprobs as git HEAD has it, verbatim but for the helpers' names
    (common.response_inputs is unchanged)."""
    inputs, where = common.response_inputs(model, batch, pad_id, packing, share_prompts=share_prompts)
    keep, where = today_response_logits_to_keep(inputs, where)
    out = model(**inputs, logits_to_keep=keep)
    logits = out.logits[where]  # [sum R, V]: the logits one position before each response token, which predicted it
    tokens, lengths = torch.cat([r for _, r in batch]).to(logits.device), [len(r) for _, r in batch]
    chunks = []  # LOGPROB_CHUNK rows at a time; with a graph each chunk is recomputed in backward (checkpoint), so
    for x, t in zip(logits.split(TODAY_LOGPROB_CHUNK), tokens.split(TODAY_LOGPROB_CHUNK)):  # autograd keeps the logits
        chunks.append(checkpoint(today_chunk_logprobs, x, t, temperature, with_entropy, entropy_grad,
                                 use_reentrant=False)
                      if x.requires_grad else today_chunk_logprobs(x, t, temperature, with_entropy, entropy_grad))
    logp = torch.cat([c[0] for c in chunks])  # [sum R]
    entropy = pad_sequence(torch.cat([c[1] for c in chunks]).split(lengths), batch_first=True) if with_entropy \
        else None
    if per_token:
        return pad_sequence(logp.split(lengths), batch_first=True), entropy, getattr(out, "aux_loss", None)
    sequence = torch.repeat_interleave(torch.arange(len(batch), device=logp.device),
                                       torch.tensor(lengths, device=logp.device))
    return logp.new_zeros(len(batch)).index_add(0, sequence, logp), entropy, getattr(out, "aux_loss", None)


def today_chunk_logprobs(logits, tokens, temperature, with_entropy, entropy_grad):
    """"today": common.chunk_logprobs as git HEAD has it, verbatim."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    lse = x.logsumexp(-1)
    logp = x.gather(-1, tokens[:, None]).squeeze(-1) - lse
    if not with_entropy:
        return logp, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):  # the bonus, or just a metric
        logp_all = x - lse[:, None]
        return logp, -(logp_all.exp() * logp_all).sum(-1)


# ------------------------------------------------------------------------------ now: common's functions
def now_sft_loss(model, ids, mask, pos, labels):
    """"now": sft.py's loss after issue 52, sft.sft_loss_chunked itself (common.forward_hidden, then
    sft.token_nll_sum: LinearNLL, the gradient taken chunk by chunk in the forward pass)."""
    hidden, out = common.forward_hidden(model, dict(input_ids=ids, attention_mask=mask, position_ids=pos,
                                                    use_cache=False))
    return sft.sft_loss_chunked(model, hidden, labels)


# ----------------------------------------------------------------------------------- a measuring child
def build(opts):
    """-> the model, seeded."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=opts.vocab, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         tie_word_embeddings=True))
    return model.to(torch.bfloat16 if opts.bf16 else torch.float32)


def batches(opts, seqs, seq_len, prompt_len):
    """-> the SFT batch (ids, mask, pos, labels) and the RL batch [(prompt, response)] of the first `seqs` of the
    --seqs sequences (their first seq_len tokens, prompt_len of them prompt)."""
    g = torch.Generator().manual_seed(1)
    rows = list(torch.randint(opts.vocab, (opts.all_seqs, opts.seq_len), generator=g)[:seqs, :seq_len])
    ids, mask, pos = common.batch_sequences(rows, 0, False)
    labels, _, _ = common.batch_sequences([torch.cat([torch.full((prompt_len,), -100), r[prompt_len:]])
                                           for r in rows], -100, False)
    return (ids, mask, pos, labels), [(r[:prompt_len], r[prompt_len:]) for r in rows]


def run_pass(opts, model, sft_batch, rl_batch):
    """One pass of opts.impl / opts.kind -> what the checks compare (the loss, or the per-token log-probs)."""
    if opts.kind == "sft":
        ids, mask, pos, labels = sft_batch
        if opts.impl == "today":
            loss = today_sft_loss(model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits,
                                  labels)
        else:
            loss = now_sft_loss(model, ids, mask, pos, labels)
        loss.backward()
        return loss.detach()
    impl = today_response_logprobs if opts.impl == "today" else common.response_logprobs
    if opts.kind == "rollout":
        with torch.no_grad():
            return impl(model, rl_batch, 0, False, 1.0)[0]
    # grpo.actor_step's call; the entropy (a metric) is still referenced during backward, as there
    logp, entropy, _ = impl(model, rl_batch, 0, False, 1.0, with_entropy=True, entropy_grad=False)
    logp.sum().backward()
    del entropy
    return logp.detach()


@torch.no_grad()
def float64_truth(opts, model, sft_batch, rl_batch):
    """The loss or per-token log-probs in float64 of the model's own logits (model.model, then model.lm_head)."""
    ids, mask, pos, labels = sft_batch
    hidden = model.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).last_hidden_state
    targets = labels[:, 1:]
    at = targets != -100
    rows, tokens = hidden[:, :-1][at], targets[at]  # the same positions and tokens for SFT and RL (prompts of P)
    truth = torch.cat([torch.log_softmax(model.lm_head(h).double(), -1).gather(-1, t[:, None]).squeeze(-1)
                       for h, t in zip(rows.split(1024), tokens.split(1024))])
    return -truth.mean() if opts.kind == "sft" else truth.view(len(rl_batch), -1)


def rss_kb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() // 1024


def vm_size_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


def out_of_memory(e):
    return isinstance(e, MemoryError) or "can't allocate memory" in str(e) or "Cannot allocate memory" in str(e)


def measure(opts):
    """One measurement in this (fresh) process -> prints {"peak_mb", "times"} or {"oom_gb"}; saves the outputs."""
    common.keep_freed_memory()  # as every training process does (common.init_distributed on a CPU)
    model = build(opts)
    sft_batch, rl_batch = batches(opts, opts.seqs, opts.seq_len, opts.prompt_len)
    run_pass(opts, model, *batches(opts, 1, 64, 16))  # warm-up: 1 sequence of 64 tokens, 16 of them prompt
    if opts.kind != "rollout":
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
    room = int(opts.cap_gb * 2**30) - rss_kb() * 1024  # the cap on the whole process, here on its address space
    resource.setrlimit(resource.RLIMIT_AS, (vm_size_bytes() + room, resource.RLIM_INFINITY))
    base, before_kb = rss_kb(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start, cpu = time.perf_counter(), time.process_time()
    try:
        result = run_pass(opts, model, sft_batch, rl_batch)
    except (RuntimeError, MemoryError) as e:
        if not out_of_memory(e):
            raise
        print(json.dumps({"oom_gb": room / 2**30}))
        return
    times, cpu_times = [time.perf_counter() - start], [time.process_time() - cpu]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert peak > before_kb, "the pass did not reach the process's earlier high-water mark: not measured"
    saved = {"result": result.float()}
    if opts.kind != "rollout":
        saved["grads"] = torch.cat([p.grad.float().flatten() for p in model.parameters()])
    if opts.impl == "now":
        saved["truth"] = float64_truth(opts, model, sft_batch, rl_batch)
    torch.save(saved, Path(opts.out) / f"{opts.impl}-{opts.kind}-{opts.vocab}-{opts.seqs}.pt")
    del saved
    while len(times) < opts.passes and sum(times) < opts.time_budget_s:
        start, cpu = time.perf_counter(), time.process_time()
        run_pass(opts, model, sft_batch, rl_batch)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu)
    print(json.dumps({"peak_mb": (peak - base) / 1024, "times": times, "cpu_times": cpu_times}))


# ------------------------------------------------------------------------------------------ the parent
def run(impl, kind, vocab, seqs, opts, out):
    cmd = [sys.executable, __file__, "--impl", impl, "--kind", kind, "--vocab", str(vocab), "--out", out,
           "--seqs", str(seqs), "--all_seqs", str(opts.seqs)]
    for flag in ("seq_len", "prompt_len", "cap_gb", "passes", "time_budget_s"):
        cmd += [f"--{flag}", str(getattr(opts, flag))]
    proc = subprocess.run(cmd + ["--bf16"] * opts.bf16, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{impl} {kind} {vocab} x {seqs} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def memory(r):
    return "-" if r is None else f"out of memory (> {r['oom_gb']:.1f} GB)" if "oom_gb" in r else f"{r['peak_mb']:,.0f}"


def seconds(r, key="times"):
    return "-" if r is None or "oom_gb" in r else f"{statistics.median(r[key]):.1f}"


def ratio(today, now, key):
    if today is None or now is None or "oom_gb" in now:
        return "-"
    if key == "peak_mb":
        return f"> {today['oom_gb'] * 1024 / now['peak_mb']:.1f}x" if "oom_gb" in today \
            else f"{today['peak_mb'] / now['peak_mb']:.1f}x"
    return "-" if "oom_gb" in today else f"{statistics.median(today[key]) / statistics.median(now[key]):.2f}x"


def row(kind, seqs, opts, today, now=None):
    passes = max((len(r["times"]) for r in (today, now) if r and "times" in r), default=0)
    print(f"{kind:9s} {seqs * opts.seq_len:>7,} {memory(today):>25s} {memory(now):>7s} "
          f"{ratio(today, now, 'peak_mb'):>9s} | {seconds(today):>7s} {seconds(now):>7s} "
          f"{ratio(today, now, 'times'):>6s} | {seconds(today, 'cpu_times'):>7s} {seconds(now, 'cpu_times'):>7s} "
          f"{ratio(today, now, 'cpu_times'):>6s} {passes}", flush=True)


def check(kind, vocab, seqs, out):
    """Today's and now's loss or log-probs against each other and float64, and their gradients -> (a line, the
    differences in fp32 spacings at the largest |value|: today - now, today - float64, now - float64, and the
    gradients' max |today - now| / max |gradient|)."""
    today, now = (torch.load(Path(out) / f"{impl}-{kind}-{vocab}-{seqs}.pt") for impl in IMPLS)
    a, b, truth = today["result"], now["result"], now["truth"]
    largest = b.abs().max()
    ulp = (torch.nextafter(largest, torch.tensor(float("inf"))) - largest).item()
    diffs = [(a - b).abs().max().item(), (a.double() - truth).abs().max().item(),
             (b.double() - truth).abs().max().item()]
    grads = ((today["grads"] - now["grads"]).abs().max() / now["grads"].abs().max()).item() if "grads" in now \
        else None
    line = (f"  {kind:9s} {seqs:>2} seqs: {'loss' if kind == 'sft' else 'log-probs':9s} "
            f"|today - now| {diffs[0]:.1e} ({diffs[0] / ulp:.1f} ulp at {largest:.2f}); vs float64: today "
            f"{diffs[1]:.1e}, now {diffs[2]:.1e}" + (f"; grads {grads:.1e}" if grads is not None else ""))
    return line, [d / ulp for d in diffs], grads


def one_pass(kind, vocab, opts, out):
    """Prints the rows of one pass at one vocabulary -> the sequence count at which both today and now ran, or 0."""
    now, today = (run(impl, kind, vocab, opts.seqs, opts, out) for impl in IMPLS[::-1])
    row(kind, opts.seqs, opts, today, now)
    if "oom_gb" in now:
        return 0
    if "oom_gb" not in today:
        return opts.seqs
    seqs, fitted = opts.seqs, today
    while seqs > 1 and "oom_gb" in fitted:  # the largest of --seqs / 2, / 4, ... at which today fits
        seqs //= 2
        fitted = run("today", kind, vocab, seqs, opts, out)
    if "oom_gb" in fitted:
        print(f"  {kind}: today does not fit even at 1 sequence")
        return 0
    now_there = run("now", kind, vocab, seqs, opts, out)
    row(kind, seqs, opts, fitted, now_there)
    if seqs > 1:
        half = run("today", kind, vocab, seqs // 2, opts, out)
        row(kind, seqs // 2, opts, half)
        estimate = fitted["peak_mb"] + (fitted["peak_mb"] - half["peak_mb"]) / (seqs // 2) * (opts.seqs - seqs)
        print(f"  {kind}: today at {opts.seqs * opts.seq_len:,} tokens by linear extrapolation from "
              f"{seqs // 2 * opts.seq_len:,} and {seqs * opts.seq_len:,}: ~{estimate:,.0f} MB, "
              f"~{estimate / now['peak_mb']:.1f}x now's {now['peak_mb']:,.0f}", flush=True)
    return 0 if "oom_gb" in now_there else seqs


SFT_RUN = ["--input_key", "input", "--output_key", "output", "--max_len", "256", "--train_batch_size", "8",
           "--micro_train_batch_size", "8", "--max_samples", "16", "--max_epochs", "1", "--learning_rate", "1e-4"]


def sft_runs(opts):
    """sft.py as a user runs it, 2 steps of a micro-batch of 8 samples of ~250 tokens (~1,650 of them labelled, what
    the output layer reads), on a random 2-layer hidden-64 Llama at each vocabulary (the toy tokenizer: its ids are the
    model's first ones), each run in a
    process of its own: its peak RSS (eval_results.json's peak_rss_mb) and wall time, with the output layer's chunks
    sized by the vocabulary (common.chunk_rows, now) and at 1,024 rows whatever the vocabulary (before issue 66:
    common.CHUNK_LOGITS set past any vocabulary). The figure to read: how much the peak grows from the first
    vocabulary to the last."""
    import random

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    import toy

    tokenizer = AutoTokenizer.from_pretrained(toy.ensure_toy_world() / "model")
    rng = random.Random(0)
    sums = lambda n: " ".join(f"{rng.randrange(100):02d}+{rng.randrange(100):02d}" for _ in range(n))  # noqa: E731
    peaks = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data.jsonl"
        data.write_text("".join(json.dumps({"input": sums(7), "output": sums(34)}) + "\n" for _ in range(16)))
        records = [json.loads(line) for line in data.read_text().splitlines()]
        lengths = [len(tokenizer(r["input"] + r["output"])["input_ids"]) for r in records]
        labelled = sum(len(tokenizer(r["output"])["input_ids"]) for r in records[:8])
        print(f"sft.py, 2 steps of 8 samples ({min(lengths)}-{max(lengths)} tokens, ~{labelled:,} labelled a step), a "
              f"random Llama (2 layers, hidden "
              f"64), fp32, load average {os.getloadavg()[0]:.1f}\n{'vocabulary':>10s} {'chunks':>28s} "
              f"{'peak RSS MB':>11s} {'wall s':>7s}", flush=True)
        for vocab in map(int, opts.vocabs.split(",")):
            model = Path(tmp) / f"llama{vocab}"
            torch.manual_seed(0)
            LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).save_pretrained(model)
            tokenizer.save_pretrained(model)
            for name, budget in (("sized by the vocabulary", "common.CHUNK_LOGITS"), ("1,024 rows", "10**15")):
                out = Path(tmp) / f"out{vocab}{budget[:2]}"
                code = (f"import common, runpy, sys; common.CHUNK_LOGITS = {budget}; sys.argv = ['sft.py'] + "
                        f"sys.argv[1:]; runpy.run_path('sft.py', run_name='__main__')")
                t0 = time.time()
                proc = subprocess.run([sys.executable, "-c", code, "--pretrain", str(model), "--dataset", str(data),
                                       *SFT_RUN, "--save_path", str(out)], cwd=ROOT, capture_output=True, text=True)
                if proc.returncode:
                    sys.exit(f"sft.py failed at vocabulary {vocab}:\n{proc.stderr[-3000:]}")
                peaks[vocab, name] = json.loads((out / "eval_results.json").read_text())["peak_rss_mb"]
                rows = common.chunk_rows(vocab) if budget.startswith("common") else 1024
                print(f"{vocab:>10,} {f'{name} ({rows})':>28s} {peaks[vocab, name]:>11,.0f} {time.time() - t0:>7.1f}",
                      flush=True)
    vocabs = [int(v) for v in opts.vocabs.split(",")]
    first, last = vocabs[0], vocabs[-1]
    for name in ("sized by the vocabulary", "1,024 rows"):
        print(f"growth {first:,} -> {last:,}, chunks {name}: {peaks[last, name] - peaks[first, name]:,.0f} MB")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bf16", action="store_true", help="bf16 weights and logits, as on GPUs (default: fp32)")
    p.add_argument("--vocabs", default="32000,151936")
    p.add_argument("--passes_to_run", default=",".join(PASSES), help="of: " + ", ".join(PASSES))
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--prompt_len", type=int, default=128, help="tokens of each sequence without a loss / log-prob")
    p.add_argument("--cap_gb", type=float, default=13.0, help="the most memory one measuring process may take")
    p.add_argument("--passes", type=int, default=3, help="timed passes at most (the median is printed)")
    p.add_argument("--time_budget_s", type=float, default=30.0, help="no further timed pass once this is spent")
    p.add_argument("--impl", choices=IMPLS, help=argparse.SUPPRESS)  # a measuring child
    p.add_argument("--kind", choices=PASSES, help=argparse.SUPPRESS)
    p.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    p.add_argument("--all_seqs", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--sft_runs", action="store_true", help="sft.py's own runs instead (issue 66's case): peak RSS "
                   "at each vocabulary, with chunks sized by the vocabulary and with 1,024 rows whatever it is")
    opts = p.parse_args()
    if opts.impl:
        return measure(opts)
    if opts.sft_runs:
        return sft_runs(opts)
    dtype, tokens = "bf16" if opts.bf16 else "fp32", opts.seqs * opts.seq_len
    labelled = opts.seqs * (opts.seq_len - opts.prompt_len)
    print(f"{opts.seqs} sequences x {opts.seq_len} tokens = {tokens:,} tokens, each {opts.prompt_len} prompt / "
          f"unlabelled + {opts.seq_len - opts.prompt_len} response / labelled: {labelled:,} tokens get a log-prob;\n"
          f"{dtype}, a random-init Qwen2 (hidden 64, 2 layers) on the CPU, {torch.get_num_threads()} threads, load "
          f"average {os.getloadavg()[0]:.1f};\nmemory: peak RSS over the baseline, a fresh process each, capped at "
          f"{opts.cap_gb:g} GB;\ntime: median of n passes, at most {opts.passes}, none begun after "
          f"{opts.time_budget_s:g} s of them; t/n: today / now (above 1: now is faster)", flush=True)
    checks = []
    with tempfile.TemporaryDirectory() as out:
        for vocab in map(int, opts.vocabs.split(",")):
            rows = common.chunk_rows(vocab)
            print(f"\nvocabulary {vocab:,}: one [{tokens:,} x V] fp32 tensor is {tokens * vocab * 4 / 2**20:,.0f} MB, "
                  f"one chunk of {rows} rows {rows * vocab * 4 / 2**20:,.0f} MB")
            print(f"{'':9s} {'':7s} {'peak MB over the baseline':>43s} | {'wall s':^22s} | {'CPU s':^22s}\n"
                  f"{'pass':9s} {'tokens':>7s} {'today':>25s} {'now':>7s} {'today/now':>9s}"
                  f" | {'today':>7s} {'now':>7s} {'t/n':>6s} | {'today':>7s} {'now':>7s} {'t/n':>6s} n")
            lines = []
            for kind in opts.passes_to_run.split(","):
                seqs = one_pass(kind, vocab, opts, out)
                if seqs:
                    line, ulps, grads = check(kind, vocab, seqs, out)
                    lines.append(line)
                    checks.append((ulps, grads))
            print("checks where both ran, max |difference| (ulp: fp32's spacing at the largest |value|; grads: "
                  "max |today - now| / max |grad|):\n" + "\n".join(lines), flush=True)
    print(f"\nload average {os.getloadavg()[0]:.1f}")
    worst = max(u[0] for u, _ in checks)
    assert worst <= 4, f"today and now differ by {worst:.1f} fp32 spacings"
    worst = max(g for _, g in checks if g is not None)
    assert worst <= (1e-2 if opts.bf16 else 1e-5), f"today's and now's gradients differ by {worst:.1e} of the largest"

if __name__ == "__main__":
    main()
