"""Direct preference optimisation (DPO): move the policy toward the chosen response of each preference pair and away
from the rejected one, measured against a frozen reference; no reward model, no sampling. Or online DPO (--online):
pairs of the policy's own samples, ranked by a reward model or function.

    python dpo.py --pretrain runs/sft_short                                       # toy world: offline, the toy pairs
    python dpo.py --pretrain runs/sft_short --online --reward_pretrain runs/rm    # toy world: online, judged by an RM
    deepspeed --num_gpus 8 dpo.py --pretrain ckpt/sft --dataset prefs.jsonl --input_key prompt \\
        --chosen_key chosen --rejected_key rejected --apply_chat_template --zero_stage 3 --bf16 \\
        --beta 0.1 --learning_rate 5e-7 --packing_samples
    deepspeed --num_gpus 8 dpo.py --pretrain ckpt/sft --online --dataset prompts.jsonl --input_key prompt \\
        --apply_chat_template --reward_pretrain ckpt/rm --vllm --zero_stage 3 --bf16 --learning_rate 5e-7

The loss (dpo_loss) asks how much more the policy prefers the chosen response over the rejected one than the
reference does: delta = (log pi(chosen) - log pi_ref(chosen)) - (log pi(rejected) - log pi_ref(rejected)), each
log-prob summed over the response's tokens (sequence_logps). beta * (log pi - log pi_ref) is DPO's implicit reward:
its accuracy on held-out pairs (chosen scored higher) and its margins are the eval.

Offline (OpenRLHF's train_dpo, TRL's DPOTrainer): --dataset of pairs with rm.py's keys and formats (tokenize_pair).
Online (open-instruct's online DPO, TRL's OnlineDPOTrainer): each step samples two completions of every prompt from
the current policy (HF generate, or vLLM with --vllm / --ray, as in grpo.py and ppo.py), scores both
(--reward_pretrain, or --remote_rm_url: a /get_reward server or a reward_func file, your own code run in this
process), and trains on (higher, lower); a tie (equal scores, or the same completion twice) says nothing and is
dropped (counted). The reference is --ref_pretrain, by default the starting policy; with --lora_rank it is the
policy itself with its adapters switched off (adapters_off), no second copy.

The implementation details, each where it happens: dropout off (common.disable_dropout), the prompt tokenized as
generation sees it and a response through its EOS (tokenize_pair), chosen and rejected of a pair in one forward
(pair_logps; packed, they share one copy of their prompt), log-probs of the policy itself (temperature 1, not the
sampling temperature), ties dropped (sample_pairs), a step's loss the mean over the pairs it has (the update).
"""

import argparse
import contextlib
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import AutoModelForSequenceClassification

import common

TOY_REWARD = str(Path(__file__).resolve().parent / "toy.py")  # its reward_func checks the toy task's answers
LOSS_TYPES = ("sigmoid", "ipo", "hinge")
LOGPROB_CHUNK = 1024  # logit rows upcast to fp32 at a time: 0.6 GB for a 152k vocabulary


# ------------------------------------------------------------------------------------------------ math
def dpo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta=0.1, loss_type="sigmoid",
             label_smoothing=0.0):
    """Per-sequence log-probs [B] of the chosen and rejected responses under the policy and the reference, used as
    given (the loop feeds sums over the response tokens, and per-token means for ipo, the IPO paper's and TRL's
    convention; OpenRLHF feeds sums). With delta = (chosen - ref_chosen) - (rejected - ref_rejected):
      sigmoid  -log sigmoid(beta * delta)                                  DPO (Rafailov et al.)
               with label_smoothing e > 0: -(1 - e) log sigmoid(beta * delta) - e log sigmoid(-beta * delta),
               the conservative DPO of Mitchell (the label is wrong with probability e)
      ipo      (delta - 1 / (2 beta))^2                                    IPO (Azar et al.)
      hinge    relu(1 - beta * delta)                                      SLiC
    -> (the batch mean of the loss, chosen_rewards, rejected_rewards), the implicit rewards beta * (logps -
    ref_logps) [B], detached."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}: use one of {', '.join(LOSS_TYPES)}")
    if label_smoothing and loss_type != "sigmoid":
        raise ValueError("label_smoothing is conservative DPO's: loss_type sigmoid only")
    delta = (chosen_logps - ref_chosen_logps) - (rejected_logps - ref_rejected_logps)
    if loss_type == "sigmoid":
        loss = -(1 - label_smoothing) * F.logsigmoid(beta * delta) - label_smoothing * F.logsigmoid(-beta * delta)
    elif loss_type == "ipo":
        loss = (delta - 1 / (2 * beta)) ** 2
    else:
        loss = torch.relu(1 - beta * delta)
    chosen_rewards = beta * (chosen_logps - ref_chosen_logps).detach()
    rejected_rewards = beta * (rejected_logps - ref_rejected_logps).detach()
    return loss.mean(), chosen_rewards, rejected_rewards


def pairs_loss(chosen, rejected, ref_chosen, ref_rejected, chosen_len, rejected_len, args):
    """dpo_loss of summed log-probs [B] as the loop has them: for ipo each divided by its response's token count
    [B] first (per-token means)."""
    if args.loss_type == "ipo":
        chosen, ref_chosen = chosen / chosen_len, ref_chosen / chosen_len
        rejected, ref_rejected = rejected / rejected_len, ref_rejected / rejected_len
    return dpo_loss(chosen, rejected, ref_chosen, ref_rejected, args.beta, args.loss_type, args.label_smoothing)


# ---------------------------------------------------------------------------------------- log-probs
def sequence_logps(model, batch, pad_id, packing):
    """log pi(response | prompt), summed over the response tokens, at temperature 1 (the policy itself, whatever
    temperature sampled it). batch: (prompt_ids, response_ids) pairs -> (logps [B] in fp32 at least, with the graph
    when gradients are on; token counts [B]; the forward's MoE router loss, None unless --aux_loss_coef)."""
    # padded rows, or one packed row with each prompt laid out once (common.pack_groups)
    inputs, where = common.response_inputs(model, batch, pad_id, packing, share_prompts=True)
    keep, where = common.response_logits_to_keep(inputs, where)
    out = model(**inputs, logits_to_keep=keep)
    logits = out.logits[where]  # [sum R, V]: the logits one position before each response token, which predicted it
    logp = token_logprobs(logits, torch.cat([r for _, r in batch]).to(logits.device))  # [sum R]
    lengths = torch.tensor([len(r) for _, r in batch], device=logp.device)
    sequence = torch.repeat_interleave(torch.arange(len(batch), device=logp.device), lengths)
    return logp.new_zeros(len(batch)).index_add(0, sequence, logp), lengths, getattr(out, "aux_loss", None)


def token_logprobs(logits, tokens):
    """[N, V] logits and the [N] tokens they predicted -> log-probs [N], the token's logit minus the logsumexp, in
    fp32 at least, LOGPROB_CHUNK rows at a time; with a graph each chunk is recomputed in backward (checkpoint), so
    autograd keeps the logits, not every chunk's fp32 copy."""
    chunks = [checkpoint(chunk_logprobs, x, t, use_reentrant=False) if x.requires_grad else chunk_logprobs(x, t)
              for x, t in zip(logits.split(LOGPROB_CHUNK), tokens.split(LOGPROB_CHUNK))]
    return torch.cat(chunks)


def chunk_logprobs(logits, tokens):
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return x.gather(-1, tokens[:, None]).squeeze(-1) - x.logsumexp(-1)


def pair_logps(model, pairs, pad_id, packing):
    """(prompt, chosen, rejected) triples -> sequence_logps of the chosen [B] and the rejected [B], both in one
    forward, their token counts [B] each, and the router loss."""
    n = len(pairs)
    logps, lengths, aux_loss = sequence_logps(model, [(p, c) for p, c, _ in pairs] + [(p, r) for p, _, r in pairs],
                                              pad_id, packing)
    return logps[:n], logps[n:], lengths[:n], lengths[n:], aux_loss


# ------------------------------------------------------------------------------------------- the update
@contextlib.contextmanager
def adapters_off(model):
    """--lora_rank: inside the block the model is its base, the adapters switched off: the reference, no copy."""
    model.disable_adapters()
    try:
        yield model
    finally:
        model.enable_adapters()


def micro_batches(n, updates, gas):
    """Indices 0..n-1 in `updates` optimizer steps of `gas` near-equal micro-batches each, some possibly empty: every
    rank runs the same number of forwards (ZeRO-3 runs each on all ranks together) whatever number of pairs it has
    (online, ties are dropped)."""
    return [[c.tolist() for c in piece.tensor_split(gas)] for piece in torch.arange(n).tensor_split(updates)]


# ---------------------------------------------------------------------------------------------- data
def tokenize_pair(record, tokenizer, args, where):
    """A preference record -> (prompt, chosen, rejected) token ids [P], [C], [R]: the prompt as generation sees it
    (grpo.py and ppo.py tokenize prompts alike), each response the tokens that follow the prompt in the whole text
    (tokenized alone where the boundary would merge), through its EOS (not what a chat template writes after it).
    input: a string or chat messages, or with --input_key '' (and the chat template) chosen and rejected are whole
    conversations differing in their last turn; chosen / rejected: a string, or chat messages."""
    chat = args.apply_chat_template
    prompt = record[args.input_key] if args.input_key else None
    responses = [record[args.chosen_key], record[args.rejected_key]]
    if responses[0] == responses[1]:
        common.fail(f"{where}: chosen and rejected are the same response; a pair needs two different ones")
    if not chat and any(isinstance(x, list) for x in [prompt] + responses):
        common.fail(f"{where}: chat messages need --apply_chat_template")
    if chat:
        if prompt is None:  # whole conversations: the prompt is everything before the last turn
            if not all(isinstance(r, list) and r for r in responses) or responses[0][:-1] != responses[1][:-1]:
                common.fail(f"{where}: with --input_key '' the chosen and rejected conversations must differ only "
                            "in their last turn (the prompt is what comes before it)")
            prompt, responses = responses[0][:-1], [r[-1:] for r in responses]
        if any(isinstance(r, list) and (not r or r[0].get("role") != "assistant") for r in responses):
            common.fail(f"{where}: a chosen or rejected conversation that repeats the prompt: give --input_key '' "
                        "(the prompt is then what precedes the last turn)")
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        prompt_text = render(tokenizer, messages, where, add_generation_prompt=True)
        texts, eos = [], tokenizer.eos_token
        for r in responses:
            full = render(tokenizer, messages + (r if isinstance(r, list) else [{"role": "assistant", "content": r}]),
                          where)
            if not full.startswith(prompt_text):
                common.fail(f"{where}: the chat template renders the prompt differently once a reply follows")
            reply = full[len(prompt_text):]
            texts.append(reply[:reply.rfind(eos) + len(eos)] if eos in reply else reply)
    else:
        prompt_text = "" if prompt is None else common.format_prompt(prompt, tokenizer, args)
        texts = [str(r) for r in responses]
    prompt_ids = tokenizer(prompt_text, add_special_tokens=not chat)["input_ids"]
    if not prompt_ids:  # the first response token needs a position before it
        common.fail(f"{where}: an empty prompt (and this tokenizer adds no BOS): give --input_key")
    out = [torch.tensor(prompt_ids)]
    for text in texts:
        whole = tokenizer(prompt_text + text, add_special_tokens=not chat)["input_ids"]
        ids = whole[len(prompt_ids):] if whole[:len(prompt_ids)] == prompt_ids else \
            tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids or ids[-1] != tokenizer.eos_token_id:
            ids.append(tokenizer.eos_token_id)
        out.append(torch.tensor(ids))
    return tuple(out)


def render(tokenizer, messages, where, add_generation_prompt=False):
    """The chat template's text; its own raise_exception (roles that do not alternate, ...) as one line."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # jinja2's TemplateError and what a template raises
        common.fail(f"{where}: the chat template cannot render it ({' '.join(str(e).split())[:200]})")


def load_pairs(source, split, tokenizer, args, max_samples=None, probs=None):
    """Offline data -> (prompt, chosen, rejected) triples, and the chosen text of each (what --eval_generate_samples
    compares greedy answers with). A pair longer than --max_len keeps its prompt and cuts its responses; one whose
    prompt alone does not fit, or whose responses are the same once cut (no preference left), is dropped; all
    counted."""
    keys = [k for k in (args.input_key, args.chosen_key, args.rejected_key) if k]
    records, where = common.load_records(source, split, keys, max_samples, with_locations=True, probs=probs,
                                         seed=args.seed)
    pairs, answers, cut = [], [], 0
    for record, location in zip(records, where):
        prompt, chosen, rejected = tokenize_pair(record, tokenizer, args, location)
        room = args.max_len - len(prompt)
        if room <= 0 or torch.equal(chosen[:room], rejected[:room]):
            continue
        cut += max(len(chosen), len(rejected)) > room
        pairs.append((prompt, chosen[:room], rejected[:room]))
        answer = record[args.chosen_key]
        answers.append(str(answer[-1]["content"] if isinstance(answer, list) else answer))
    if not pairs:
        common.fail(f"{source}: no pair's prompt fits in --max_len {args.max_len}")
    if (cut or len(pairs) < len(records)) and common.is_rank0():
        common.console.print(f"{source}: {len(records) - len(pairs)} pairs dropped (the prompt over --max_len, or "
                             f"the responses the same once cut to fit), {cut} with responses cut")
    return pairs, answers


# ------------------------------------------------------------------------------------- online rollout
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
        cache = common.shared_prompt_cache(model, ids, mask, synced)  # a prompt's two samples: prefilled once
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


def generate_vllm(engine, prompts, args, eos_id, temperature):
    """vLLM (common.VLLMEngine in this process, or common.RayEngines): the same contract as generate_hf."""
    # ignore_eos: stop at eos_id only, not also at the eos ids of the checkpoint's tokenizer and
    # generation_config.json (vLLM adds those), exactly as generate_hf stops
    return engine.generate(prompts, temperature=temperature, top_p=args.top_p if temperature > 0 else 1.0,
                           max_tokens=args.generate_max_len, stop_token_ids=[eos_id], ignore_eos=True)


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


def sample_pairs(prompt_records, generate, reward_fn, tokenizer, args):
    """Two completions of each prompt from the current policy, scored -> a dict: pairs (prompt, chosen, rejected),
    chosen the higher score; pair_scores [P, 2], their scores; ties, the prompts whose two samples scored the same or
    are the same completion (no preference: not trained on); and per-sample logs."""
    records = [r for r in prompt_records for _ in range(2)]  # a prompt's two samples are consecutive
    t = time.time()
    responses = generate([r["ids"] for r in records], args.temperature)
    generate_s, t = time.time() - t, time.time()
    scores, extra_logs = reward_fn(records, responses)  # [2N]
    stopped = torch.tensor([len(r) > 0 and r[-1].item() == tokenizer.eos_token_id for r in responses])
    if args.non_stop_penalty is not None:  # a completion cut off at --generate_max_len gets a fixed score
        scores = torch.where(stopped, scores, torch.tensor(args.non_stop_penalty, dtype=scores.dtype))
    pairs, pair_scores, ties = [], [], []
    for i in range(0, len(records), 2):
        first, second = (i, i + 1) if scores[i] >= scores[i + 1] else (i + 1, i)
        triple = (records[i]["ids"], responses[first], responses[second])
        if scores[i] == scores[i + 1] or torch.equal(responses[i], responses[i + 1]):
            ties.append(triple)
        else:
            pairs.append(triple)
            pair_scores.append([scores[first].item(), scores[second].item()])
    logs = {"objective/scores": scores, "val/sequence_lengths": [float(len(r)) for r in responses],
            "val/stopped": stopped.float(), **extra_logs}
    return dict(pairs=pairs, pair_scores=torch.tensor(pair_scores).reshape(-1, 2), ties=ties, logs=logs,
                generate_s=generate_s, reward_s=time.time() - t)


# ---------------------------------------------------------------------------------------------- eval
@torch.no_grad()
def evaluate_pairs(model, reference, pairs, answers, tokenizer, args):
    """Offline: DPO's implicit reward on held-out pairs, accuracy (chosen's higher) and margin, the loss and the
    log-probs; and the exact match of greedy answers with the chosen response on the first --eval_generate_samples."""
    shards = common.eval_shard(pairs, args.micro_train_batch_size)  # fillers: run, not counted
    with reference() as ref:  # one pass each: an offloaded reference moves once, adapters switch off once
        ref_logps = [pair_logps(ref, batch, tokenizer.pad_token_id, False)[:2] for batch, _ in shards]
    stats = {k: [] for k in ("loss", "accuracy", "margin", "logps/chosen", "logps/rejected")}
    for (batch, real), (ref_chosen, ref_rejected) in zip(shards, ref_logps):
        chosen, rejected, chosen_len, rejected_len, _ = pair_logps(model, batch, tokenizer.pad_token_id, False)
        real = torch.tensor(real)
        if not real.any():
            continue
        picked = [x.cpu()[real] for x in (chosen, rejected, ref_chosen, ref_rejected, chosen_len, rejected_len)]
        loss, chosen_rewards, rejected_rewards = pairs_loss(*picked, args)
        stats["loss"] += [loss.item()] * len(picked[0])  # a batch mean, weighted by its pairs
        stats["accuracy"] += (chosen_rewards > rejected_rewards).float().tolist()
        stats["margin"] += (chosen_rewards - rejected_rewards).tolist()
        stats["logps/chosen"] += picked[0].tolist()
        stats["logps/rejected"] += picked[1].tolist()
    stats["exact_match"] = []
    for batch, real in common.eval_shard(list(zip(pairs, answers))[:max(args.eval_generate_samples, 0)],
                                         args.micro_train_batch_size):
        completions = generate_hf(model, [p for (p, _, _), _ in batch], args, tokenizer, temperature=0.0)
        for (_, answer), completion, keep in zip(batch, completions, real):
            if keep:
                text = tokenizer.decode(completion, skip_special_tokens=True)
                stats["exact_match"].append(float(text.strip() == answer.strip()))
    return common.all_reduce_means(stats)


@torch.no_grad()
def evaluate_online(eval_records, generate, reward_fn, eval_fn, tokenizer, args):
    """Online: one greedy completion of each eval prompt, split over ranks: the mean training reward, and the
    --eval_reward_func's mean and extra logs (the toy task's accuracy)."""
    mine, real = common.rank_share(eval_records)  # fillers keep ZeRO-3 ranks in step
    responses = generate([r["ids"] for r in mine], 0.0)
    rewards, _ = reward_fn(mine, responses)
    metrics = {"reward": rewards}
    if eval_fn is not None:
        rule_rewards, _, logs = client_rewards(eval_fn, mine, responses, tokenizer)
        metrics.update(rule_reward=rule_rewards, **logs)
    real = torch.tensor(real)
    return common.all_reduce_means({k: v[real] for k, v in metrics.items()})


# ---------------------------------------------------------------------------------------------- main
def parse_args():
    parser = common.add_common_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    a = parser.add_argument
    # the objective
    a("--beta", type=float, default=0.1, help="the KL strength: implicit reward = beta * (log pi - log pi_ref)")
    a("--loss_type", default="sigmoid", choices=LOSS_TYPES, help="sigmoid (DPO), ipo or hinge (SLiC)")
    a("--ipo", action="store_true", help="same as --loss_type ipo (OpenRLHF's flag)")
    a("--label_smoothing", type=float, default=0.0, help="conservative DPO: the chance a label is wrong (sigmoid)")
    a("--nll_loss_coef", type=float, default=0.0, help="weight of an SFT term: the chosen's per-token NLL")
    a("--aux_loss_coef", type=float, default=0.0, help="MoE router load-balancing loss weight")
    a("--ref_pretrain", default=None, help="the reference (default: --pretrain; with --lora_rank the base model)")
    a("--ref_offload", action="store_true", help="keep the reference on the CPU between uses")
    # offline data
    a("--chosen_key", default="chosen")
    a("--rejected_key", default="rejected")
    a("--eval_generate_samples", type=int, default=0,
      help="offline: greedy-generate this many eval prompts, exact match with the chosen response")
    # online: sampling and scoring
    a("--online", action="store_true", help="pairs of the policy's own samples, ranked by a reward")
    a("--rollout_batch_size", type=int, default=64, help="--online: prompts per step (all ranks), two samples each")
    a("--micro_rollout_batch_size", type=int, default=8, help="--online: samples per generate / reward chunk")
    a("--num_episodes", type=int, default=1, help="--online: passes over the prompts")
    a("--prompt_max_len", type=int, default=1024, help="--online: longer prompts are dropped")
    a("--generate_max_len", type=int, default=1024, help="new tokens per completion (offline: eval answers)")
    a("--temperature", type=float, default=1.0, help="--online: sampling temperature")
    a("--top_p", type=float, default=1.0)
    a("--label_key", default=None, help="--online: dataset field passed to reward functions as labels")
    a("--vllm", action="store_true", help="--online: generate with an in-process vLLM engine")
    a("--vllm_gpu_memory_utilization", type=float, default=None,
      help="GPU share for vLLM (default: 0.3 for --vllm beside training, 0.9 for --ray engines on their own GPUs)")
    a("--enforce_eager", action="store_true", help="vLLM without CUDA graphs (less memory, slower decoding)")
    a("--ray", action="store_true", help="--online: generate on vLLM engines that are Ray actors")
    a("--ray_address", default=None, help="an existing Ray cluster (default: $RAY_ADDRESS, else start one here)")
    a("--vllm_num_engines", type=int, default=1, help="with --ray: how many vLLM engines")
    a("--vllm_tensor_parallel_size", type=int, default=1, help="GPUs per engine (--vllm: that many ranks share one)")
    a("--enable_prefix_caching", action="store_true", help="vLLM reuses the KV cache of shared prompt prefixes")
    a("--reward_pretrain", default=None, help="--online: a sequence-classification reward model")
    a("--remote_rm_url", default=None, help="--online: reward server URL (/get_reward) or a .py file with reward_func")
    a("--remote_rm_batch_size", type=int, default=64, help="queries per HTTP request")
    a("--remote_rm_timeout", type=float, default=60.0, help="seconds per HTTP request")
    a("--remote_rm_retries", type=int, default=3, help="retries after a failed HTTP request (1 s, 2 s, 4 s...)")
    a("--eval_reward_func", default=None, help="--online: a reward_func .py file scoring eval completions (logged)")
    a("--non_stop_penalty", type=float, default=None, help="--online: score of a completion without EOS")
    a("--eval_steps", type=int, default=-1, help="evaluate every N steps (-1: before and after training only)")
    parser.set_defaults(save_path="runs/dpo", learning_rate=5e-7, train_batch_size=64, micro_train_batch_size=8)
    online = parser.parse_known_args()[0].online  # the toy world's data and settings differ by mode
    args = common.parse_args(parser, lambda root: dict(
        # calibrated on 2 CPU cores from runs/sft_short: see README
        dataset=str(root / "pref_train.jsonl"), eval_dataset=str(root / "pref_test.jsonl"), max_len=32,
        eval_generate_samples=500, generate_max_len=5, learning_rate=1e-4, lr_warmup_ratio=0.05,
        train_batch_size=64, micro_train_batch_size=64, beta=0.5, max_epochs=1) if not online else dict(
        dataset=str(root / "prompts_train.jsonl"), eval_dataset=str(root / "prompts_test.jsonl"),
        label_key="label", eval_reward_func=TOY_REWARD, prompt_max_len=16, generate_max_len=8,
        rollout_batch_size=64, train_batch_size=64, micro_train_batch_size=64, micro_rollout_batch_size=128,
        learning_rate=1e-4, lr_warmup_ratio=0.05, beta=0.1, num_episodes=4))
    if args.ipo:
        if args.loss_type not in ("sigmoid", "ipo"):
            common.fail(f"--ipo is --loss_type ipo: not with --loss_type {args.loss_type}")
        args.loss_type = "ipo"
    if args.beta <= 0:
        common.fail("--beta must be > 0")
    if args.label_smoothing and args.loss_type != "sigmoid":
        common.fail(f"--label_smoothing is conservative DPO's (--loss_type sigmoid), not {args.loss_type}'s")
    if not 0 <= args.label_smoothing < 0.5:
        common.fail("--label_smoothing is the chance a label is wrong: in [0, 0.5)")
    if args.ref_offload and args.lora_rank and not args.ref_pretrain:
        common.fail("--ref_offload: with --lora_rank the reference is the policy's base (adapters off), no copy to "
                    "offload; drop it, or give --ref_pretrain")
    if not args.online:
        given = [o for o in ("vllm", "ray", "reward_pretrain", "remote_rm_url", "eval_reward_func", "non_stop_penalty",
                             "label_key", "enforce_eager", "enable_prefix_caching", "vllm_gpu_memory_utilization")
                 if getattr(args, o) not in (None, False)]
        if given:
            common.fail(f"--{given[0]} is for --online (pairs of the policy's own samples); offline DPO trains on "
                        "the --dataset pairs")
    else:
        if (args.remote_rm_url is None) == (args.reward_pretrain is None):
            common.fail("--online ranks each prompt's two samples by a reward: give exactly one of --reward_pretrain "
                        "or --remote_rm_url (URL or .py file)")
        if args.eval_generate_samples:
            common.fail("--eval_generate_samples is offline DPO's (exact match with the chosen response); --online "
                        "evaluates greedy completions of --eval_dataset with the reward (and --eval_reward_func)")
        if args.temperature <= 0:
            common.fail("--online needs --temperature > 0: two greedy completions of a prompt are the same (a tie)")
        if args.rollout_batch_size % args.train_batch_size:
            common.fail(f"--rollout_batch_size {args.rollout_batch_size} must be a multiple of --train_batch_size "
                        f"{args.train_batch_size} (prompts, one pair each before ties are dropped)")
    common.check_engine_options(args)
    return args


def main():
    args = parse_args()
    client = args.remote_rm_url and common.reward_client(
        args.remote_rm_url, args.remote_rm_batch_size, args.remote_rm_timeout, args.remote_rm_retries)
    eval_fn = args.eval_reward_func and common.reward_client(args.eval_reward_func)
    _, world = common.init_distributed(args)
    start = time.time()
    tokenizer = common.load_tokenizer(args.pretrain, args)
    pad_id, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    # a step: offline, one optimizer step over --train_batch_size pairs of the dataset; online, --rollout_batch_size
    # prompts sampled and scored, then --max_epochs passes of `updates` optimizer steps over their pairs
    if args.online:
        if args.rollout_batch_size % world:
            common.fail(f"--rollout_batch_size {args.rollout_batch_size} must split over {world} processes")
        prompts = common.load_prompts(args.dataset, args.dataset_split, tokenizer, args, args.max_samples,
                                      args.dataset_probs)
        eval_prompts = common.load_prompts(args.eval_dataset, args.eval_split, tokenizer, args) \
            if args.eval_dataset else []
        if len(prompts) < args.rollout_batch_size:
            common.fail(f"{args.dataset}: {len(prompts)} usable prompts, fewer than --rollout_batch_size")
        total_steps = args.num_episodes * len(prompts) // args.rollout_batch_size
        updates = args.rollout_batch_size // args.train_batch_size
        optimizer_steps = total_steps * updates * args.max_epochs
    else:
        train, _ = load_pairs(args.dataset, args.dataset_split, tokenizer, args, args.max_samples, args.dataset_probs)
        eval_pairs, eval_answers = load_pairs(args.eval_dataset, args.eval_split, tokenizer, args) \
            if args.eval_dataset else ([], [])
        if len(train) < args.train_batch_size:
            common.fail(f"{args.dataset}: {len(train)} pairs, fewer than --train_batch_size")
        total_steps = optimizer_steps = len(train) // args.train_batch_size * args.max_epochs
        updates = 1
    cfg = common.ds_config(args)
    gas = cfg["gradient_accumulation_steps"]  # micro-batches per optimizer step and rank

    model = common.load_model(args.pretrain, args, tokenizer, cfg)
    common.enable_router_loss(model, args.aux_loss_coef)
    common.disable_dropout(model)  # the policy and the reference compared as the same function
    actor = common.setup_deepspeed(model, args, cfg, optimizer_steps)
    offloaded = args.ref_offload and args.zero_stage != 3  # the whole reference on the CPU, moved for each use
    ref = None if args.lora_rank and not args.ref_pretrain else \
        common.load_frozen(args.ref_pretrain or args.pretrain, args, tokenizer, cfg, args.ref_offload)

    def reference():  # a context: the model that gives the reference log-probs
        return adapters_off(actor.module) if ref is None else common.on_accelerator(ref, offloaded)

    start_step, state = common.load_checkpoint(actor, args, with_state=True)
    engine = None
    if args.online:
        if args.reward_pretrain:
            rm = common.load_frozen(args.reward_pretrain, args, tokenizer, cfg,
                                    model_class=AutoModelForSequenceClassification, num_labels=1)

            def reward_fn(records, responses):
                return rm_scores(rm, [r["ids"] for r in records], responses, tokenizer, args), {}
        else:
            def reward_fn(records, responses):
                rewards, _, logs = client_rewards(client, records, responses, tokenizer)
                return rewards, logs
        cursor = [state.get("prompt_cursor", 0)]
        stream = common.prompt_batches(prompts, args, cursor)
        # --vllm / --ray: vLLM engines fed the policy's weights (and again after every step); else HF generate
        engine = common.start_rollout_engine(args, actor.module, start_step) if args.vllm or args.ray else None

        def generate(prompts, temperature):
            if engine is None:
                return generate_hf(actor.module, prompts, args, tokenizer, temperature)
            return generate_vllm(engine, prompts, args, eos, temperature)

        def next_pairs():  # two samples of each of this rank's prompts, scored; chosen = the higher, ties dropped
            return sample_pairs(next(stream), generate, reward_fn, tokenizer, args)

        def evaluate():
            return evaluate_online(eval_prompts, generate, reward_fn, eval_fn, tokenizer, args)
    else:
        batches = common.train_batches(len(train), args, start_step)

        def next_pairs():  # this rank's share of the next --train_batch_size pairs
            _, _, micro = next(batches)
            return dict(pairs=[train[i] for mb in micro for i in mb], ties=[], logs={})

        def evaluate():
            return evaluate_pairs(actor.module, reference, eval_pairs, eval_answers, tokenizer, args)

    has_eval = bool(eval_prompts if args.online else eval_pairs)
    logger, results = common.Logger(args, total_steps, start_step), {}
    totals = dict(generate_s=0.0, reward_s=0.0, ref_s=0.0, train_s=0.0, sync_s=0.0, step_s=0.0) if args.online \
        else dict(ref_s=0.0, train_s=0.0, step_s=0.0)
    if has_eval:
        actor.module.eval()
        before = evaluate()
        logger.log(start_step, before, prefix="eval")
        results.update({f"eval_{k}_before": v for k, v in before.items()})
    for step in range(start_step, total_steps):
        step_start = time.time()
        # 1. pairs: offline, this rank's share of the next --train_batch_size; online, two samples of each prompt
        #    from the current policy, scored, chosen = the higher (ties dropped)
        actor.module.eval()
        drawn = next_pairs()
        pairs, ties = drawn["pairs"], drawn["ties"]
        metrics = {k: drawn[k] for k in ("generate_s", "reward_s") if k in drawn}
        filler = (pairs + ties)[0]  # what an empty micro-batch runs, with weight 0 (ZeRO-3 runs every forward)
        layout = micro_batches(len(pairs), updates, gas)  # [updates][gas] lists of pair indices
        # the pairs each optimizer step has on all ranks: its loss is their mean
        counts = common.all_reduce_sum([float(sum(map(len, update))) for update in layout])

        # 2. reference log-probs (no gradients), in the update's micro-batches
        t = time.time()
        ref_logps = torch.zeros(len(pairs), 2, dtype=torch.float64)  # [P, (chosen, rejected)]
        with torch.no_grad(), reference() as ref_model:
            for mb in (mb for update in layout for mb in update):
                chosen, rejected, _, _, _ = pair_logps(ref_model, [pairs[i] for i in mb] or [filler], pad_id,
                                                       args.packing_samples)
                if mb:
                    ref_logps[mb] = torch.stack([chosen, rejected], -1).double().cpu()
        metrics["ref_s"], t = time.time() - t, time.time()

        # 3. update: --max_epochs passes over the pairs (online; offline a step is one batch), each `updates`
        #    optimizer steps of `gas` micro-batches. A micro-batch's mean loss counts by its share of its
        #    optimizer step's pairs, so each step's gradient is that of the mean over the pairs it has on all ranks
        #    (DeepSpeed averages micro-batches and ranks).
        actor.module.train()
        stats = {k: [] for k in ("objective/loss", "logps/chosen", "logps/rejected", "rewards/chosen",
                                 "rewards/rejected", "rewards/margin", "rewards/accuracy",
                                 *(["nll_loss"] if args.nll_loss_coef else []),
                                 *(["aux_loss"] if args.aux_loss_coef else []),
                                 *(["objective/kl", "objective/rlhf_reward"] if args.online else []))}
        for epoch in range(args.max_epochs if args.online else 1):
            order = torch.randperm(len(pairs)).tolist() if epoch else list(range(len(pairs)))
            for update, count in zip(layout, counts):
                if not count:  # not a pair on any rank: no optimizer step
                    continue
                for mb in update:
                    idx = [order[i] for i in mb]
                    chosen, rejected, chosen_len, rejected_len, aux_loss = pair_logps(
                        actor, [pairs[i] for i in idx] or [filler], pad_id, args.packing_samples)  # [b] each
                    ref_chosen, ref_rejected = (ref_logps[idx] if idx else torch.zeros(1, 2)).to(chosen).unbind(-1)
                    loss, chosen_rewards, rejected_rewards = pairs_loss(chosen, rejected, ref_chosen, ref_rejected,
                                                                        chosen_len, rejected_len, args)
                    nll = (-chosen / chosen_len).mean()  # the chosen responses' per-token NLL, a mean over pairs
                    total = loss + args.nll_loss_coef * nll if args.nll_loss_coef else loss
                    total = total * (len(idx) * gas * world / count)  # 0 for a filler
                    if args.aux_loss_coef:  # a mixture of experts' router loss, of every forward (a filler's too)
                        total = total + args.aux_loss_coef * aux_loss
                    actor.backward(total)
                    actor.step()
                    if epoch or not idx:
                        continue
                    # per pair, from the first pass: before any of this step's optimizer steps when updates == 1
                    stats["objective/loss"] += [loss.item()] * len(idx)
                    stats["logps/chosen"] += chosen.tolist()
                    stats["logps/rejected"] += rejected.tolist()
                    stats["rewards/chosen"] += chosen_rewards.tolist()
                    stats["rewards/rejected"] += rejected_rewards.tolist()
                    stats["rewards/margin"] += (chosen_rewards - rejected_rewards).tolist()
                    stats["rewards/accuracy"] += (chosen_rewards > rejected_rewards).float().tolist()
                    if args.nll_loss_coef:
                        stats["nll_loss"] += [nll.item()] * len(idx)
                    if args.aux_loss_coef:
                        stats["aux_loss"].append(aux_loss.item())
                    if args.online:  # open-instruct's objective per sampled response: the score minus beta * KL
                        kl = torch.stack([chosen - ref_chosen, rejected - ref_rejected], -1).detach()  # [b, 2]
                        stats["objective/kl"] += kl.flatten().tolist()
                        stats["objective/rlhf_reward"] += (drawn["pair_scores"][idx].to(kl) -
                                                           args.beta * kl).flatten().tolist()
        metrics["train_s"] = time.time() - t

        # 4. weight sync: the rollout engines sample with the updated policy from the next step on
        if args.online:
            metrics["sync_s"], t = 0.0, time.time()
            if engine is not None:
                engine.sync(actor.module, args, version=step + 1)
                metrics["sync_s"] = time.time() - t

        # 5. log (means over all ranks), save, eval
        metrics["step_s"] = time.time() - step_start
        logs = dict(drawn["logs"])
        if args.online:  # open-instruct's set; the KL and what follows from it per sampled response trained on
            stats.update({"objective/non_score_reward": [-args.beta * x for x in stats["objective/kl"]],
                          "objective/entropy": [-x for x in stats["logps/chosen"] + stats["logps/rejected"]]})
            logs.update({"objective/scores_margin": drawn["pair_scores"][:, 0] - drawn["pair_scores"][:, 1],
                         "pairs_tied": [float(len(ties))], "pairs_trained": [float(len(pairs))]})
        out = common.all_reduce_means({**logs, **stats, **metrics})
        if args.online:  # totals over all ranks, per step
            out["pairs_tied"], out["pairs_trained"] = out["pairs_tied"] * world, out["pairs_trained"] * world
            out["val/num_stop_token_ids"] = out.pop("val/stopped") * 2 * args.rollout_batch_size
        out["lr"] = actor.get_lr()[0]
        totals = {k: v + out[k] for k, v in totals.items()}
        logger.log(step + 1, out)
        if args.save_steps > 0 and (step + 1) % args.save_steps == 0:
            common.save_checkpoint(actor, args, step + 1, extra={"prompt_cursor": cursor[0]} if args.online else None)
        if has_eval and args.eval_steps > 0 and (step + 1) % args.eval_steps == 0 and step + 1 < total_steps:
            actor.module.eval()
            logger.log(step + 1, evaluate(), prefix="eval")

    done = max(total_steps - start_step, 1)
    results.update(train_time_s=time.time() - start, steps=total_steps,
                   **{f"{k[:-2]}_s_per_step": v / done for k, v in totals.items()})
    if has_eval:
        actor.module.eval()
        metrics = evaluate()
        logger.log(total_steps, metrics, prefix="eval")
        results.update({f"eval_{k}": v for k, v in metrics.items()})
    common.finish(actor, tokenizer, args, results, logger)


if __name__ == "__main__":
    main()
