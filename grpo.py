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
                  run in this process (the contract: rollout.reward_client)
  --reward_pretrain DIR   a sequence-classification reward model (rm.py's output) sharing the policy's
                  tokenizer, read at the EOS token; or a process reward model (prm.py's output): the min of its
                  step scores (--prm_reduce).
With --process_rewards the advantages come from per-step scores instead (process_advantages, DeepSeekMath's process
supervision): a PRM's, or step_rewards sent by the reward file or server (the contract: process_rewards.py).

The implementation details, each where it happens: dropout off (common.disable_dropout), prompts left-padded
for generation and a group's prompt prefilled once (rollout.generate_hf), the response cut at its EOS
(rollout.generate_hf, engines.vllm_sampling), rewards for completions without EOS or too long (score), groups
without signal dropped (keep_groups_with_signal, --dynamic_filtering), log-probs at the sampling temperature
(common.response_logprobs), advantages from group statistics (group_advantages), vLLM's sampling corrected
toward the trainer's policy (rollout.rollout_correction_weights).
"""

import argparse
import time

import torch
import torch.distributed as dist
from transformers import get_scheduler

import common
import deepspeed  # after common, which names DeepSpeed's accelerator first (else it guesses, with a warning)
import rollout

ESTIMATORS = ("group_norm", "dr_grpo", "rloo", "reinforce_baseline", "reinforce")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
POLICY_LOSSES = ("ppo", "cispo", "sapo")


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


def process_advantages(step_rewards, step_ends, group_size, eps=1e-6):
    """Per-token advantages [N, T] from step scores, DeepSeekMath's process supervision (its section 4.1.3).
    step_rewards [N, T] hold each step's score on the token that ends the step, step_ends [N, T] mark those tokens;
    groups are `group_size` consecutive samples. Every step score is normalized by the mean and std of all the step
    scores R of its group (all its samples' steps together), and a token's advantage is the sum of the normalized
    scores of its sample's steps that end at or after it:
        r~_j = (r_j - mean(R)) / (std(R) + eps),      A_t = sum_{j: end(j) >= t} r~_j
    (std unbiased, as group_advantages'; 0 after a sample's last step, and for a group whose scores are all equal)."""
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
    """Per-token advantages [B, T] when the KL penalty is part of the reward (gamma 1): the sequence's
    advantage ([B], or already per token [B, T]) plus the penalty still to come, A_t = a - kl_coef * sum_{s >= t}
    kl_s; 0 on padding."""
    mask = action_mask.to(kl.dtype)
    penalty_to_go = (kl * mask).flip(-1).cumsum(-1).flip(-1)
    return ((advantages if advantages.dim() == 2 else advantages[:, None]) - kl_coef * penalty_to_go) * mask


def importance_ratio(logprobs, old_logprobs, action_mask=None, level="token"):
    """pi / pi_old of each response token [B, T]; level "sequence" (GSPO) gives all of a sequence's tokens one
    ratio, exp of the mean over its response tokens of logprobs - old_logprobs, the gradient flowing through
    the mean."""
    log_ratio = logprobs - old_logprobs
    if level == "sequence":
        if action_mask is None:
            raise ValueError("sequence-level ratios need action_mask (which tokens a sequence has)")
        log_ratio = common.seq_mean(log_ratio, action_mask)[:, None].expand_as(log_ratio)
    elif level != "token":
        raise ValueError(f"unknown importance_sampling_level {level!r}: use token or sequence")
    return torch.exp(log_ratio)


def clipped_surrogate(ratio, advantages, eps_clip_low=0.2, eps_clip_high=0.2, dual_clip=None, delta=None):
    """PPO's clipped surrogate per token: -min(ratio * A, clip(ratio, 1 - eps_clip_low, 1 + eps_clip_high) * A),
    capped at -dual_clip * A where A < 0 (dual clip); with delta the unclipped ratio is capped at delta (INTELLECT-2's
    two-sided clip)."""
    unclipped = ratio if delta is None else ratio.clamp(max=delta)
    loss = -torch.min(unclipped * advantages, ratio.clamp(1 - eps_clip_low, 1 + eps_clip_high) * advantages)
    if dual_clip is not None:
        loss = torch.where(advantages < 0, torch.min(loss, -dual_clip * advantages), loss)
    return loss


def cispo_loss(ratio, advantages, logprobs, eps_clip_high=0.2):
    """CISPO (MiniMax-M1) per token: -sg(min(ratio, 1 + eps_clip_high)) * A * logprobs: the importance weight is
    clipped and stopped, so every token keeps its gradient."""
    return -ratio.clamp(max=1 + eps_clip_high).detach() * advantages * logprobs


def sapo_loss(ratio, advantages, tau_pos=1.0, tau_neg=1.05):
    """SAPO per token: -sigmoid(tau * (ratio - 1)) * 4 / tau * A, tau = tau_pos where A > 0, else tau_neg: a soft gate
    instead of a clip (its gradient is A * grad logprobs at ratio 1, like the surrogate's)."""
    tau = advantages.new_full(advantages.shape, tau_neg).masked_fill(advantages > 0, tau_pos)
    return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * advantages


def token_policy_loss(logprobs, old_logprobs, advantages, action_mask=None, eps_clip_low=0.2, eps_clip_high=0.2,
                      dual_clip=None, *, importance_sampling_level="token", policy_loss_type="ppo", delta=None,
                      tau_pos=1.0, tau_neg=1.05, ref_logprobs=None, kl_coef=0.0, kl_ratio_weighted=False,
                      rollout_logprobs=None, rollout_correction=None, rollout_correction_bounds=(0.0, 2.0)):
    """Policy loss per token [B, T]; advantages [B] or [B, T]; ratio = importance_ratio(...) (per token, or per
    sequence: GSPO). policy_loss_type picks clipped_surrogate ("ppo"), cispo_loss or sapo_loss. With
    rollout_correction, that loss times rollout_correction_weights (the engine sampled, not pi_old). With
    ref_logprobs, plus kl_coef * k3 KL to the reference (GRPO's KL loss), times the ratio if kl_ratio_weighted (not
    reweighted by the correction, as in TRL and OpenRLHF)."""
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    ratio = importance_ratio(logprobs, old_logprobs, action_mask, importance_sampling_level)
    if policy_loss_type not in POLICY_LOSSES:
        raise ValueError(f"unknown policy_loss_type {policy_loss_type!r}: use one of {', '.join(POLICY_LOSSES)}")
    if policy_loss_type != "ppo" and (dual_clip is not None or delta is not None):
        raise ValueError(f"dual_clip and delta cap the ppo surrogate, not {policy_loss_type}'s loss")
    if policy_loss_type == "ppo":
        loss = clipped_surrogate(ratio, advantages, eps_clip_low, eps_clip_high, dual_clip, delta)
    elif policy_loss_type == "cispo":
        loss = cispo_loss(ratio, advantages, logprobs, eps_clip_high)
    else:
        loss = sapo_loss(ratio, advantages, tau_pos, tau_neg)
    if rollout_correction is not None:
        if rollout_logprobs is None or action_mask is None:
            raise ValueError("rollout_correction needs rollout_logprobs and action_mask")
        weights, _ = rollout.rollout_correction_weights(old_logprobs, rollout_logprobs, action_mask,
                                                        rollout_correction, rollout_correction_bounds)
        loss = loss * weights
    if ref_logprobs is not None and kl_coef:
        kl = common.approx_kl(logprobs, ref_logprobs, "k3")
        loss = loss + kl_coef * (kl * ratio if kl_ratio_weighted else kl)
    return loss


def policy_loss(logprobs, old_logprobs, advantages, action_mask, eps_clip_low=0.2, eps_clip_high=0.2, dual_clip=None,
                *, loss_agg_mode="token-mean", generate_max_len=None, **family):
    """The policy loss, one number: token_policy_loss (`family`: its keywords, the loss type, ratio level,
    correction, KL) reduced over the response tokens by aggregate_loss."""
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
    """policy_loss's keywords from the flags: the aggregation, the loss type and ratio level, the KL loss, the
    rollout correction."""
    return dict(loss_agg_mode=args.loss_agg_mode, generate_max_len=args.generate_max_len,
                importance_sampling_level=args.importance_sampling_level, policy_loss_type=args.policy_loss_type,
                delta=args.delta, tau_pos=args.tau_pos, tau_neg=args.tau_neg, kl_coef=args.init_kl_coef,
                kl_ratio_weighted=args.kl_ratio_weighted, rollout_correction=args.rollout_correction,
                rollout_correction_bounds=args.rollout_correction_bounds)


# ------------------------------------------------------------------------------------------- rollout
def score(batch, reward_fn, args):
    """Rewards, scores and extra logs ([N] each) of a Rollout, with the length penalties on the rewards."""
    rewards, scores, logs = reward_fn(batch)
    rewards = rollout.penalize_unfinished(rewards, batch.stopped, args.non_stop_penalty)
    if args.overlong_buffer_len:  # DAPO: a linear penalty over the last --overlong_buffer_len tokens
        excess = batch.lengths.float() - (args.generate_max_len - args.overlong_buffer_len)
        rewards = rewards + (-excess / args.overlong_buffer_len * args.overlong_penalty_factor).clamp(max=0)
    return rewards, scores, {**logs, "stopped": batch.stopped.float()}


def sample_round(next_batch, reward_fn, args):
    """One round of a step's rollout: wait for this rank's next batch (in step: generate it), score it. -> (batch,
    rewards, scores, logs, metrics)."""
    t = time.time()
    batch = next_batch()
    t, wait_s = time.time(), time.time() - t
    rewards, scores, logs = score(batch, reward_fn, args)
    return batch, rewards, scores, {"score": scores, **logs}, dict(
        generate_s=batch.generate_s, wait_s=wait_s, reward_s=time.time() - t, rounds=1, groups_dropped=0,
        groups_topped_up=0)


def keep_groups_with_signal(first, sample, n, want, reward_range):
    """DAPO's dynamic filtering: keep the groups (n consecutive samples) whose mean score is strictly inside
    reward_range, drawing more rounds (sample() -> a round, as `first`: sample_round's five) until this rank has `want`
    of them; after 10 rounds dropped groups top the share up. All ranks run the same rounds (ZeRO-3 generate). -> a
    round of the kept groups, its metrics the rounds' summed, with groups_dropped and groups_topped_up."""
    lo, hi, rounds = *reward_range, [first]
    while True:
        group_scores = [s for _, _, scores, _, _ in rounds for s in scores.double().reshape(-1, n).mean(-1).tolist()]
        kept = [g for g, s in enumerate(group_scores) if lo < s < hi]
        if len(rounds) == 10:
            break
        (short,) = common.all_reduce_sum([float(len(kept) < want)])
        if not short:
            break
        rounds.append(sample())
    groups = (kept + [g for g in range(len(group_scores)) if g not in kept])[:want]
    idx = [g * n + j for g in groups for j in range(n)]
    batches, rewards, scores, logs, metrics = zip(*rounds)  # each: one per round
    kept_of = lambda values: torch.cat(values)[idx]  # noqa: E731  (every round's, the kept groups')
    summed = {k: sum(m[k] for m in metrics) for k in metrics[0]}
    summed.update(groups_dropped=len(group_scores) - len(kept), groups_topped_up=max(want - len(kept), 0))
    return (rollout.Rollout.cat(batches).select(idx), kept_of(rewards), kept_of(scores),
            {k: kept_of([log[k] for log in logs]) for k in logs[0]}, summed)


# ----------------------------------------------------------------------------------- model and DeepSpeed
def enable_router_loss(model, coef):
    """--aux_loss_coef: a mixture-of-experts model then returns its router load-balancing loss (aux_loss)."""
    if not coef:
        return
    if not hasattr(model.config, "output_router_logits"):
        common.fail(f"--aux_loss_coef: {model.config.model_type} is not a mixture-of-experts model (no router loss)")
    model.config.output_router_logits = True


def ds_config(args):
    """DeepSpeed's config from the flags: batch sizes and accumulation, clipping, ZeRO, bf16. A copy in each training
    script (tests compare them)."""
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
    scheduler = get_scheduler(
        args.lr_scheduler, optimizer, num_warmup_steps=int(args.lr_warmup_ratio * num_training_steps),
        num_training_steps=num_training_steps,
        scheduler_specific_kwargs={"min_lr_rate": 0.1} if args.lr_scheduler == "cosine_with_min_lr" else None,
    )
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    if dist.get_world_size() == 1 and args.zero_stage == 0 and not args.bf16:
        engine.enable_backward_allreduce = False  # one process: nothing to average; skips flattening every gradient
    if common.is_rank0():  # what --lora_rank leaves to train (a ZeRO-3 partition reports its full size as ds_numel)
        sizes = [(getattr(p, "ds_numel", p.numel()), p.requires_grad) for p in model.parameters()]
        trained, total = sum(size for size, grad in sizes if grad), sum(size for size, _ in sizes)
        common.console.print(f"training {trained:,} of {total:,} parameters ({100 * trained / total:.2f}%)")
    return engine


# ------------------------------------------------------------------------------------------------- flags
# The defaults, {flag: (a real run's, the toy world's)}: the toy world's apply when no --dataset is given
# (common.parse_args; "{toy}" is its directory), calibrated on 2 CPU cores from runs/sft_short: ~+23
# points in 200 steps, ~80 s.
DEFAULTS = {
    "save_path":                  ("runs/grpo",  "runs/grpo"),
    "dataset":                    (None,         "{toy}/prompts_train.jsonl"),
    "eval_dataset":               (None,         "{toy}/prompts_test.jsonl"),
    "label_key":                  (None,         "label"),
    "remote_rm_url":              (None,         rollout.TOY_REWARD),
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
    """The flags every training script takes (OpenRLHF's names): model, data, optimizer, LoRA, DeepSpeed, checkpoints,
    logging. Scripts set their own defaults; a copy in each training script (tests compare them)."""
    a, ranged = p.add_argument, common.ranged
    a("--pretrain", default=None, help="model: hub name or local path (default: the toy model)")
    a("--dataset", default=None, help="hub name, directory, or .json/.jsonl/.parquet/.csv file (default: toy)")
    a("--dataset_probs", default=None, help="with --dataset a,b: sampling weights of the mix, e.g. 0.7,0.3")
    a("--dataset_split", default="train")
    a("--eval_dataset", default=None, help="held-out data, same formats (default: toy test split)")
    a("--eval_split", default="test")
    a("--max_samples", type=ranged(int, 1), default=None, help="use at most this many training samples")
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
    a("--learning_rate", type=ranged(float, 0), default=1e-5)  # 0: the run's weights stay as loaded
    a("--lr_warmup_ratio", type=ranged(float, 0, 1), default=0.03)
    a("--lr_scheduler", default="cosine_with_min_lr", help="any transformers scheduler name")
    a("--l2", type=ranged(float, 0), default=0.0, help="AdamW weight decay")
    a("--adam_betas", type=ranged(float, 0, 1, hi_open=True), nargs=2, default=(0.9, 0.95))
    a("--max_norm", type=ranged(float, 0), default=1.0, help="gradient clipping (0: none)")
    a("--seed", type=int, default=42)
    a("--overlap_comm", action="store_true", help="ZeRO: overlap gradient reduction with the backward pass")
    # LoRA / QLoRA (peft)
    a("--lora_rank", type=ranged(int, 0), default=0, help="train LoRA adapters of this rank, not the weights (0: off)")
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


def parse_args():
    parser = add_training_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    rollout.add_rollout_args(parser)
    a = parser.add_argument
    a("--overlong_buffer_len", type=common.ranged(int, 0), default=0,
      help="DAPO overlong penalty over the last N tokens (0: off)")
    a("--overlong_penalty_factor", type=common.ranged(float, 0), default=1.0, help="the penalty at --generate_max_len")
    a("--eval_reward_func", help="a reward_func .py file scoring eval completions too (logged; e.g. a rule beside a "
      "reward model)")
    a("--dynamic_filtering", action="store_true", help="drop groups whose mean score is outside the range")
    a("--dynamic_filtering_reward_range", type=common.ranged(float), nargs=2, default=(0.0, 1.0), metavar=("LO", "HI"))
    # objective
    a("--advantage_estimator", default="group_norm", choices=ESTIMATORS)
    a("--no_advantage_std_norm", action="store_true", help="center advantages without dividing by their std")
    a("--init_kl_coef", type=common.ranged(float, 0), default=0.0, help="KL coefficient (0: no reference model at all)")
    a("--kl_estimator", default="k1", choices=("k1", "k2", "k3"), help="per-token KL in the reward (and logs)")
    a("--use_kl_loss", action="store_true", help="KL (k3) in the loss, GRPO style, instead of in the reward")
    a("--loss_agg_mode", default="token-mean", choices=LOSS_AGG_MODES)
    a("--eps_clip_low", type=common.ranged(float, 0), default=0.2)
    a("--eps_clip_high", type=common.ranged(float, 0), default=0.2, help="> eps_clip_low: DAPO's clip-higher")
    a("--dual_clip", type=common.ranged(float, 1, lo_open=True), default=None,
      help="cap the loss of negative advantages at dual_clip * |A| (> 1)")
    a("--policy_loss_type", default="ppo", choices=POLICY_LOSSES, help="clipped surrogate, CISPO or SAPO")
    a("--importance_sampling_level", default="token", choices=("token", "sequence"), help="sequence: GSPO")
    a("--delta", type=common.ranged(float, 1, lo_open=True), default=None,
      help="cap the unclipped ratio at delta (> 1 + eps_clip_high; INTELLECT-2)")
    a("--tau_pos", type=common.ranged(float, 0, lo_open=True), default=None,
      help="SAPO's gate temperature where A > 0 (default 1.0)")
    a("--tau_neg", type=common.ranged(float, 0, lo_open=True), default=None,
      help="SAPO's gate temperature where A <= 0 (default 1.05)")
    a("--kl_ratio_weighted", action="store_true", help="--use_kl_loss: weight each token's KL by its ratio")
    a("--entropy_loss_coef", type=common.ranged(float, 0), default=0.0, help="entropy bonus (0: off)")
    a("--aux_loss_coef", type=common.ranged(float, 0), default=0.0,
      help="MoE router load-balancing loss weight (policy)")
    a("--actor_learning_rate", dest="learning_rate", type=common.ranged(float, 0), help="same as --learning_rate")
    args = common.parse_args(parser, DEFAULTS)
    if (args.reward_pretrain or args.agent_func_path) and args.remote_rm_url == rollout.TOY_REWARD:
        args.remote_rm_url = None  # a reward model or an agent replaces the toy world's rule reward
    rollout.check_one_reward(args)
    if args.advantage_estimator == "rloo" and args.n_samples_per_prompt < 2:
        common.fail("rloo needs --n_samples_per_prompt >= 2 (its baseline is the other samples)")
    if args.policy_loss_type != "ppo" and (args.dual_clip is not None or args.delta is not None):
        common.fail(f"--dual_clip and --delta cap the ppo surrogate: not with --policy_loss_type "
                    f"{args.policy_loss_type}")
    if args.delta is not None and args.delta <= 1 + args.eps_clip_high:
        common.fail(f"--delta {args.delta} must be > 1 + --eps_clip_high ({1 + args.eps_clip_high})")
    if args.policy_loss_type != "sapo" and (args.tau_pos is not None or args.tau_neg is not None):
        common.fail("--tau_pos and --tau_neg are SAPO's: add --policy_loss_type sapo")
    args.tau_pos = 1.0 if args.tau_pos is None else args.tau_pos
    args.tau_neg = 1.05 if args.tau_neg is None else args.tau_neg
    if args.kl_ratio_weighted and not (args.use_kl_loss and args.init_kl_coef > 0):
        common.fail("--kl_ratio_weighted weights the KL loss: add --use_kl_loss and --init_kl_coef > 0")
    if args.overlong_buffer_len >= args.generate_max_len:
        common.fail(f"--overlong_buffer_len {args.overlong_buffer_len} must be below --generate_max_len "
                    f"{args.generate_max_len}")
    rollout.check_rl_options(args)
    if args.async_steps and args.dynamic_filtering:  # its extra rounds would wait on batches not yet allowed
        common.fail("--dynamic_filtering draws as many batches as a step needs, --async_steps samples a fixed "
                    "number ahead: use one of them")
    return args


def main():
    args = parse_args()
    client = rollout.args_client(args)  # before any model loads: a bad reward file stops the run at once
    eval_fn = args.eval_reward_func and rollout.reward_client(args.eval_reward_func)
    common.init_distributed(args)
    start = time.time()
    tokenizer = common.load_tokenizer(args.pretrain, args)
    pad_id, n = tokenizer.pad_token_id, args.n_samples_per_prompt
    prompts, eval_prompts, total_steps = rollout.load_prompt_sets(args, tokenizer, n)
    updates = args.rollout_batch_size * n // args.train_batch_size * args.max_epochs
    cfg = ds_config(args)
    model = common.load_model(args.pretrain, args, tokenizer, cfg)
    enable_router_loss(model, args.aux_loss_coef)
    common.disable_dropout(model)
    actor = setup_deepspeed(model, args, cfg, total_steps * updates)
    ref = common.load_frozen(args.pretrain, args, tokenizer, cfg) if args.init_kl_coef > 0 else None
    reward_fn = rollout.reward_fn(args, tokenizer, cfg, client)
    start_step, state = common.load_checkpoint(actor, args)
    # HF generate on the actor; --vllm / --ray: vLLM engines fed the actor's weights (and again after every update)
    engine = rollout.start_engine(args, actor.module, tokenizer, start_step)
    # --async_steps N: the next batches are sampled on the Ray engines while this process trains, on weights at most
    # N updates old (the rollout correction covers that too)
    next_batch, release = rollout.batches(prompts, engine, n, args, state.get("prompt_cursor", 0),
                                          total_steps - start_step)

    sample = lambda: sample_round(next_batch, reward_fn, args)  # noqa: E731

    def eval_metrics(batch):  # the mean reward and the reward function's extra logs (the toy task's accuracy)
        rewards, _, logs = score(batch, reward_fn, args)
        if eval_fn:  # --eval_reward_func's reward and logs beside
            rule_rewards, _, rule_logs = rollout.client_rewards(eval_fn, batch, tokenizer)
            logs.update(rule_reward=rule_rewards, **rule_logs)
        return {"reward": rewards, **dict(sorted(logs.items()))}

    def evaluate():  # eval_metrics of completions of the eval prompts (pass@n with several a prompt)
        actor.module.eval()
        return rollout.evaluate(eval_prompts, engine, eval_metrics, args.eval_n_samples_per_prompt,
                                args.eval_temperature, tokenizer=tokenizer, log_samples=args.log_samples)

    timed = ("generate_s", "wait_s", "train_s", *(("sync_s",) if args.vllm or args.ray else ()),
             "step_s")  # summed per step for eval_results.json
    logger, results = common.Logger(args, total_steps, start_step, timed), {}
    if eval_prompts:
        common.log_eval(logger, start_step, evaluate(), results, "_before")
    # One optimizer step per rollout and no reference model: the policy being updated is the one that sampled
    # (a vLLM engine's numbers differ slightly: the rollout correction's business), so the old log-probs are
    # the update's own, detached, and their separate forward pass is skipped.
    on_policy = updates == 1 and ref is None
    for step in range(start_step, total_steps):
        step_start = time.time()
        # 1. rollout: sample groups, score them (--dynamic_filtering: more rounds until the share is full of groups
        #    with signal); the log-probs the update starts from (no gradients)
        actor.module.eval()
        batch, rewards, scores, logs, metrics = sample()
        if args.dynamic_filtering:
            batch, rewards, scores, logs, metrics = keep_groups_with_signal(
                (batch, rewards, scores, logs, metrics), sample, n, args.rollout_batch_size // dist.get_world_size(),
                args.dynamic_filtering_reward_range)
        t = time.time()
        action_mask = batch.action_mask  # [N, R]: 0 on padding and on an agent's environment tokens
        old_logprobs = None if on_policy else rollout.rollout_logprobs(  # [N, R]
            actor.module, batch, pad_id, args.packing_samples, args.temperature, args.micro_rollout_batch_size)
        ref_logprobs = None if ref is None else rollout.rollout_logprobs(  # [N, R]
            ref, batch, pad_id, args.packing_samples, args.temperature, args.micro_rollout_batch_size)

        # 2. advantages: group statistics (--process_rewards: of the step scores, per token), the KL penalty when
        #    it is a reward, batch whitening (REINFORCE++)
        advantages = group_advantages(rewards, n, args.advantage_estimator,
                                      std_norm=not args.no_advantage_std_norm)  # [N]
        if args.process_rewards:  # [N, R]; plus the outcome's only when a rule or server gives it beside the PRM
            outcome = args.remote_rm_url and args.reward_pretrain
            advantages = process_advantages(*batch.step_rewards, n) + (advantages[:, None] if outcome else 0.0)
        kl = common.approx_kl(old_logprobs, ref_logprobs, args.kl_estimator) * action_mask if ref is not None \
            else torch.zeros(action_mask.shape)  # [N, R]
        advantages = token_advantages(advantages, kl, action_mask, 0.0 if args.use_kl_loss else args.init_kl_coef)
        if args.advantage_estimator in ("reinforce", "reinforce_baseline"):
            advantages = common.masked_whiten(advantages, action_mask, across_ranks=True,
                                              std_norm=not args.no_advantage_std_norm)

        # 3. update: --max_epochs passes over shuffled micro-batches (index slices, each cut to its own longest
        #    response); DeepSpeed steps the optimizer every train_batch_size samples (accumulation over micro-batches
        #    and ranks)
        actor.module.train()
        stats = {k: [] for k in ("policy_loss", "clip_frac", "entropy", "engine_logprob_gap", "rollout_corrected_frac")}
        for epoch in range(args.max_epochs):
            for mb in torch.randperm(len(batch.records)).split(args.micro_train_batch_size):
                # the entropy is logged; its graph is kept only when it is in the loss
                logprobs, entropy, aux_loss = common.response_logprobs(
                    actor, batch.pairs(mb), pad_id, args.packing_samples, args.temperature, with_entropy=True,
                    entropy_grad=bool(args.entropy_loss_coef))  # [b, T]
                T, device = logprobs.size(1), logprobs.device
                mask = action_mask[mb, :T].to(device)
                old = logprobs.detach() if on_policy else old_logprobs[mb, :T].to(device)
                engine_lp = batch.logprobs[mb, :T].to(device) if batch.logprobs is not None else None
                # GRPO's KL in the loss (--use_kl_loss), not in the reward
                ref_lp = ref_logprobs[mb, :T].to(device) if args.use_kl_loss and ref is not None else None
                # the per-token loss of --policy_loss_type (clipped_surrogate, cispo_loss, sapo_loss), aggregated
                loss = policy_loss(logprobs, old, advantages[mb, :T].to(device), mask, args.eps_clip_low,
                                   args.eps_clip_high, args.dual_clip, ref_logprobs=ref_lp, rollout_logprobs=engine_lp,
                                   **loss_family(args))
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
                if epoch == 0 and engine_lp is not None:  # how far the engine is from the trainer, and the correction
                    for k, v in rollout.engine_gap(engine_lp, old, mask, args.rollout_correction,
                                                   args.rollout_correction_bounds).items():
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
            "reward": rewards.tolist(), "response_len": lengths, **logs, **metrics,
            "kl": [kl[i, :length].mean().item() for i, length in enumerate(lengths)],
            **{k: torch.cat(v) if v and torch.is_tensor(v[0]) else v for k, v in stats.items()}},
            stds={"reward": rewards})
        out.update(rollout.lag_and_turns(batch, step, logs, args.async_steps, args.agent_func_path))
        out["lr"] = actor.get_lr()[0]
        logger.log(step + 1, out)
        if not eval_prompts and (step == start_step or common.due(args.logging_steps, step + 1)):  # nothing else shows
            logger.log_samples(step + 1, rollout.eval_samples(batch, {"reward": rewards}, tokenizer, args.log_samples),
                               prefix="train")  # what the policy writes
        if common.due(args.save_steps, step + 1):
            common.save_checkpoint(actor, args, step + 1, extra={"prompt_cursor": batch.cursor})
        if eval_prompts and common.due(args.eval_steps, step + 1, total_steps):
            common.log_eval(logger, step + 1, evaluate())

    results.update(logger.run_times(start))
    common.finish(actor, tokenizer, args, results, logger, evaluate=evaluate if eval_prompts else None)


if __name__ == "__main__":
    main()
