"""Peak memory of one log-prob pass, before and after issue 23 #6 (log-probs no longer materialise the whole
vocabulary in fp32, several times), on a 152k vocabulary.

    .venv/bin/python bench/logprob_memory.py [--seqs 8] [--prompt_len 128] [--response_len 512] [--bf16]
                                             [--no_train]

1. The model: a random-init Qwen2 with Qwen2.5's vocabulary (151,936 tokens), hidden 64, 2 layers, fp32 (or
   bf16, as on GPUs) on the CPU, built from a config here (nothing downloaded), the same seed in every
   process. Its body is tiny, so the pass's memory is the logits' and what is made of them.
2. The batch: --seqs (pairs), the default --micro_rollout_batch_size, of --prompt_len random prompt tokens
   and --response_len random response tokens, padded as the rollout runs them (no --packing_samples).
3. "before" is a copy of response_logprobs as it was (below, old_response_logprobs): the forward's logits at
   every position, the response rows gathered, upcast, divided, log-softmaxed, the entropy from all of it.
   "after" is common.response_logprobs itself: logits only at the response positions (logits_to_keep), then
   gather minus logsumexp in chunks of common.LOGPROB_CHUNK rows.
4. Each measurement runs in a fresh process: the peak resident set (ru_maxrss) during the pass minus the
   resident set just before it, after the model and inputs exist and one small warm-up forward has run (so
   thread pools and one-time buffers are not charged to the pass). The CPU allocator hands big blocks back
   to the system at once, so this is the pass's own high-water mark of live tensors, within a few MB.
   rollout: no_grad, log-probs only (rollout_logprobs). train: forward and backward of sum(log-probs), the
   entropy asked for as the training loop does with --entropy_loss_coef 0 (before: with its graph anyway;
   after: without one). train+bonus: the same with the entropy bonus in the loss (--entropy_loss_coef 0.01).
   The parameters' .grad are preallocated (zeros) before the baseline, so only the pass itself is counted.
5. Checks the rollout log-probs of the two against each other and against float64 (a log_softmax in
   float64 of the same fp32 logits, computed after the peak was taken).
"""

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import common  # noqa: E402

VOCAB = 151936  # Qwen2.5's
MODES = ("rollout", "train", "train+bonus")


def old_response_logprobs(model, batch, args, pad_id, with_entropy=False):
    """"before": grpo.response_logprobs as it was before issue 23 #6, verbatim."""
    # padded, or packed with a group's prompt laid out once (packing.pack_groups)
    inputs, where = common.response_inputs(model, batch, pad_id, args.packing_samples, share_prompts=True)
    out = model(**inputs)
    # [sum R, V]: the logits one position before each response token, the ones that predicted it
    logp_all = F.log_softmax(out.logits[where].float() / args.temperature, -1)
    logp = logp_all.gather(-1, torch.cat([r for _, r in batch]).to(logp_all.device)[:, None]).squeeze(-1)
    lengths = [len(r) for _, r in batch]
    entropy = pad_sequence((-(logp_all.exp() * logp_all).sum(-1)).split(lengths), batch_first=True) \
        if with_entropy else None  # differentiable: the bonus
    return pad_sequence(logp.split(lengths), batch_first=True), entropy, getattr(out, "aux_loss", None)




def build(opts):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    model.to(torch.bfloat16 if opts.bf16 else torch.float32)
    g = torch.Generator().manual_seed(1)
    batch = [tuple(torch.randint(VOCAB, (n,), generator=g) for n in (opts.prompt_len, opts.response_len))
             for _ in range(opts.seqs)]
    return model, batch, argparse.Namespace(temperature=1.0, packing_samples=False)  # grpo.py's defaults


def rss_kb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() // 1024


def new_response_logprobs(model, batch, args, pad_id, **kwargs):
    """"after": common.response_logprobs, called as old_response_logprobs is."""
    return common.response_logprobs(model, batch, pad_id, args.packing_samples, args.temperature, **kwargs)


def measure(opts):
    """One pass in this (fresh) process -> prints {"peak_mb": MB over the baseline}; saves rollout log-probs."""
    model, batch, args = build(opts)
    impl = old_response_logprobs if opts.impl == "before" else new_response_logprobs
    with torch.no_grad():  # warm-up: one-time allocations (thread pools, kernels' buffers) before the baseline
        impl(model, batch[:1], args, 0)
    if opts.mode != "rollout":
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
    base, before_kb = rss_kb(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if opts.mode == "rollout":
        with torch.no_grad():
            logp, _, _ = impl(model, batch, args, 0)
    else:  # the training loop's: the entropy is still referenced during backward (logged after the step)
        bonus = opts.mode == "train+bonus"
        logp, entropy, _ = impl(model, batch, args, 0, with_entropy=True,
                                **({} if opts.impl == "before" else {"entropy_grad": bonus}))
        (logp.sum() - 0.01 * entropy.sum() if bonus else logp.sum()).backward()
        del entropy
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert peak > before_kb, "the pass did not reach the process's earlier high-water mark: not measured"
    result = {"peak_mb": (peak - base) / 1024}
    if opts.mode == "rollout":
        torch.save(logp.detach(), Path(opts.out) / f"{opts.impl}.pt")
        if opts.impl == "after":  # the float64 truth for these logits, now that the peak is taken
            with torch.no_grad():
                inputs, where = common.response_inputs(model, batch, 0, False)
                logits = model(**inputs).logits[where]
            tokens = torch.cat([r for _, r in batch])
            truth = torch.cat([torch.log_softmax(x.double(), -1).gather(-1, t[:, None]).squeeze(-1)
                               for x, t in zip(logits.split(1024), tokens.split(1024))])
            torch.save(truth.view(len(batch), -1), Path(opts.out) / "float64.pt")
    print(json.dumps(result))


def run(impl, mode, opts, out):
    cmd = [sys.executable, __file__, "--impl", impl, "--mode", mode, "--out", out, "--seqs", str(opts.seqs),
           "--prompt_len", str(opts.prompt_len), "--response_len", str(opts.response_len)] + ["--bf16"] * opts.bf16
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{impl} {mode} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["peak_mb"]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", type=int, default=8)
    p.add_argument("--prompt_len", type=int, default=128)
    p.add_argument("--response_len", type=int, default=512)
    p.add_argument("--bf16", action="store_true", help="bf16 weights and logits, as on GPUs (default: fp32)")
    p.add_argument("--no_train", action="store_true", help="only the rollout (no_grad) pass")
    p.add_argument("--impl", choices=("before", "after"), help=argparse.SUPPRESS)  # a measuring child
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    opts = p.parse_args()
    if opts.impl:
        return measure(opts)
    rows = opts.seqs * opts.response_len
    print(f"{opts.seqs} sequences x ({opts.prompt_len} prompt + {opts.response_len} response) tokens, vocabulary "
          f"{VOCAB}, {'bf16' if opts.bf16 else 'fp32'} on the CPU: {rows} response rows; one [rows x vocabulary] "
          f"fp32 copy is {rows * VOCAB * 4 / 2**20:.0f} MB, one chunk of {common.LOGPROB_CHUNK} rows "
          f"{common.LOGPROB_CHUNK * VOCAB * 4 / 2**20:.0f} MB", flush=True)
    with tempfile.TemporaryDirectory() as out:
        for mode in MODES[:1] if opts.no_train else MODES:
            before, after = run("before", mode, opts, out), run("after", mode, opts, out)
            print(f"{mode:11s} peak over baseline: before {before:8.0f} MB   after {after:8.0f} MB   "
                  f"before/after {before / after:5.1f}x")
        old, new, truth = (torch.load(Path(out) / f"{n}.pt") for n in ("before", "after", "float64"))
    diff = (old - new).abs().max().item()
    rel = ((old - new).abs() / new.abs()).max().item()
    largest = new.abs().max()
    spacing = (torch.nextafter(largest, torch.tensor(float("inf"))) - largest).item()
    print(f"rollout log-probs: |before - after| <= {diff:.2e} (relative {rel:.1e}; fp32's spacing at |logp| = "
          f"{largest:.1f} is {spacing:.1e}); against float64: before {(old.double() - truth).abs().max():.2e}, "
          f"after {(new.double() - truth).abs().max():.2e}")
    assert rel <= 1e-6, "before and after disagree beyond fp32 rounding"


if __name__ == "__main__":
    main()
