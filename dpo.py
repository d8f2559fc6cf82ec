"""Direct preference optimisation (DPO): move the policy toward the chosen response of each preference pair and away
from the rejected one, measured against a frozen reference; no reward model, no sampling. Online DPO (pairs of the
policy's own samples, ranked by a reward) is online_dpo.py, with its own copy of this file's loss.

    python dpo.py --pretrain runs/sft_start                                       # toy world: the toy pairs
    deepspeed --num_gpus 8 dpo.py --pretrain ckpt/sft --dataset prefs.jsonl --input_key prompt \\
        --chosen_key chosen --rejected_key rejected --apply_chat_template --zero_stage 3 --bf16 \\
        --beta 0.1 --learning_rate 5e-7 --packing_samples

The loss (dpo_loss) asks how much more the policy prefers the chosen response over the rejected one than the
reference does: delta = (log pi(chosen) - log pi_ref(chosen)) - (log pi(rejected) - log pi_ref(rejected)), each
log-prob summed over the response's tokens (pair_logps). beta * (log pi - log pi_ref) is DPO's implicit reward:
its accuracy on held-out pairs (chosen scored higher) and its margins are the eval.

Data (OpenRLHF's train_dpo, TRL's DPOTrainer): --dataset of pairs with rm.py's keys and formats (tokenize_pair). The
reference is --ref_pretrain, by default the starting policy; with --lora_rank it is the policy itself with its
adapters switched off (adapters_off), no second copy.

The implementation details, each where it happens: dropout off (common.disable_dropout), the prompt tokenized as
generation sees it and a response through its EOS (tokenize_pair), chosen and rejected of a pair in one forward
(pair_logps; packed, they share one copy of their prompt), log-probs of the policy itself (temperature 1), a step's
loss the mean over the pairs it has (train_on_pairs).
"""

import argparse
import contextlib
import time
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers

import common
import deepspeed  # after common, which names DeepSpeed's accelerator first (else it guesses, with a warning)

LOSS_TYPES = ("sigmoid", "ipo", "hinge")


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
class PairLogps(NamedTuple):
    chosen: torch.Tensor  # [B] log pi(chosen | prompt), summed over its tokens
    rejected: torch.Tensor  # [B] the same of the rejected
    chosen_len: torch.Tensor  # [B] token counts
    rejected_len: torch.Tensor
    aux_loss: torch.Tensor  # the forward's MoE router loss (None unless --aux_loss_coef)


def pair_logps(model, pairs, pad_id, packing):
    """(prompt, chosen, rejected) triples -> PairLogps: log pi(response | prompt) summed over the response tokens, at
    temperature 1 (the policy itself, whatever temperature sampled it), of the chosen and the rejected, both in one
    forward (packed, a pair shares one copy of its prompt), in fp32 at least and with the graph when gradients are
    on; their token counts; the forward's router loss."""
    n = len(pairs)
    logps, _, aux_loss = common.response_logprobs(model, [(p, c) for p, c, _ in pairs] + [(p, r) for p, _, r in pairs],
                                                  pad_id, packing, per_token=False)
    lengths = torch.tensor([len(c) for _, c, _ in pairs] + [len(r) for _, _, r in pairs], device=logps.device)
    return PairLogps(logps[:n], logps[n:], lengths[:n], lengths[n:], aux_loss)


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
    (online_dpo.py drops ties)."""
    return [[c.tolist() for c in piece.tensor_split(gas)] for piece in torch.arange(n).tensor_split(updates)]


@torch.no_grad()
def reference_logps(reference, pairs, layout, filler, pad_id, packing):
    """pair_logps of the reference for every pair, in the update's micro-batches (`layout`; an empty one runs the
    filler, as ZeRO-3 runs every forward on all ranks) -> [P, (chosen, rejected)] float64 on the CPU."""
    ref_logps = torch.zeros(len(pairs), 2, dtype=torch.float64)
    with reference() as ref_model:  # one pass: an offloaded reference moves once, adapters switch off once
        for mb in (mb for update in layout for mb in update):
            lp = pair_logps(ref_model, [pairs[i] for i in mb] or [filler], pad_id, packing)
            if mb:
                ref_logps[mb] = torch.stack([lp.chosen, lp.rejected], -1).double().cpu()
    return ref_logps


def train_on_pairs(actor, pairs, ref_logps, layout, counts, filler, pad_id, args):
    """One pass over the pairs: len(layout) optimizer steps of micro-batches (layout: micro_batches'; counts: each
    optimizer step's pairs on all ranks). A micro-batch's mean loss counts by its share of its optimizer step's
    pairs, so each step's gradient is that of the mean over the pairs it has on all ranks (DeepSpeed averages
    micro-batches and ranks). -> per-pair stats, of the policy before its optimizer step."""
    gas, world = len(layout[0]), dist.get_world_size()
    stats = {k: [] for k in ("objective/loss", "logps/chosen", "logps/rejected", "rewards/chosen", "rewards/rejected",
                             "rewards/margin", "rewards/accuracy", *(["nll_loss"] if args.nll_loss_coef else []),
                             *(["aux_loss"] if args.aux_loss_coef else []))}
    for update, count in zip(layout, counts):
        if not count:  # not a pair on any rank: no optimizer step
            continue
        for idx in update:
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
            if not idx:
                continue
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
    return stats


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
                                         seed=args.seed, text_keys=keys)
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


def train_batches(num_samples, args, start_step=0):
    """Yield (step, epoch, micro-batches of sample indices for this rank), resumable at any step.
    Each epoch is a seeded permutation, so the data position is just the step number."""
    rank, world = dist.get_rank(), dist.get_world_size()
    steps_per_epoch = num_samples // args.train_batch_size
    for step in range(start_step, steps_per_epoch * args.max_epochs):
        epoch, k = divmod(step, steps_per_epoch)
        perm = torch.randperm(num_samples, generator=torch.Generator().manual_seed(args.seed + epoch))
        mine = perm[k * args.train_batch_size:(k + 1) * args.train_batch_size][rank::world].tolist()
        m = args.micro_train_batch_size
        yield step, epoch, [mine[i:i + m] for i in range(0, len(mine), m)]


# ---------------------------------------------------------------------------------------------- eval
def eval_shard(items, batch_size):
    """This rank's share of `items` (every world-th) in batches of (items, real). Every rank gets the same count (a
    ZeRO-3 forward needs all ranks): the shortfall is filled with items[0], marked real=False, which the caller runs
    but does not count."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = list(range(rank, len(items), world))
    mine += [-1] * (-(-len(items) // world) - len(mine))
    shard, real = [items[max(j, 0)] for j in mine], [j >= 0 for j in mine]
    return [(shard[i:i + batch_size], real[i:i + batch_size]) for i in range(0, len(shard), batch_size)]


@torch.no_grad()
def greedy_generate(model, prompts, tokenizer, max_new_tokens, synced=False):
    """Greedy answers (text, special tokens skipped) to prompts given as token-id tensors, left-padded in one batch
    (generation appends on the right). `synced`: ZeRO-3 over several processes, where every rank runs every forward."""
    batch = tokenizer.pad({"input_ids": [p.tolist() for p in prompts]}, padding_side="left",
                          return_attention_mask=True, return_tensors="pt")
    ids, mask = batch["input_ids"].to(model.device), batch["attention_mask"].to(model.device)
    with common.sampling_as_asked(model):  # greedy: no repetition penalty from generation_config.json
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                             synced_gpus=synced, use_cache=True)
    return tokenizer.batch_decode(out[:, ids.size(1):], skip_special_tokens=True)


@torch.no_grad()
def evaluate_pairs(model, reference, pairs, answers, tokenizer, args):
    """Offline: DPO's implicit reward on held-out pairs, accuracy (chosen's higher) and margin, the loss and the
    log-probs; and the exact match of greedy answers with the chosen response on the first --eval_generate_samples."""
    shards = eval_shard(pairs, args.micro_train_batch_size)  # fillers: run, not counted
    with reference() as ref:  # one pass each: an offloaded reference moves once, adapters switch off once
        refs = [pair_logps(ref, batch, tokenizer.pad_token_id, False) for batch, _ in shards]
    stats = {k: [] for k in ("loss", "accuracy", "margin", "logps/chosen", "logps/rejected")}
    for (batch, real), ref_lp in zip(shards, refs):
        lp = pair_logps(model, batch, tokenizer.pad_token_id, False)
        real = torch.tensor(real)
        if not real.any():
            continue
        picked = [x.cpu()[real] for x in (lp.chosen, lp.rejected, ref_lp.chosen, ref_lp.rejected, lp.chosen_len,
                                          lp.rejected_len)]
        loss, chosen_rewards, rejected_rewards = pairs_loss(*picked, args)
        stats["loss"] += [loss.item()] * len(picked[0])  # a batch mean, weighted by its pairs
        stats["accuracy"] += (chosen_rewards > rejected_rewards).float().tolist()
        stats["margin"] += (chosen_rewards - rejected_rewards).tolist()
        stats["logps/chosen"] += picked[0].tolist()
        stats["logps/rejected"] += picked[1].tolist()
    stats["exact_match"] = []
    for batch, real in eval_shard(list(zip(pairs, answers))[:max(args.eval_generate_samples, 0)],
                                  args.micro_train_batch_size):
        texts = greedy_generate(model, [p for (p, _, _), _ in batch], tokenizer, args.generate_max_len,
                                synced=args.zero_stage == 3 and dist.get_world_size() > 1)
        stats["exact_match"] += [float(text.strip() == answer.strip()) for (_, answer), text, keep in
                                 zip(batch, texts, real) if keep]
    return common.all_reduce_means(stats)


# --------------------------------------------------------------------------- the model and DeepSpeed
def enable_router_loss(model, coef):
    """--aux_loss_coef: a mixture-of-experts model then returns its router load-balancing loss (aux_loss)."""
    if not coef:
        return
    if not hasattr(model.config, "output_router_logits"):
        common.fail(f"--aux_loss_coef: {model.config.model_type} is not a mixture-of-experts model (no router loss)")
    model.config.output_router_logits = True


def ds_config(args):
    """DeepSpeed's config from the flags: global and per-device batch (hence gradient accumulation), ZeRO, bf16."""
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
    if common.is_rank0():  # what --lora_rank leaves to train; ZeRO-3 partitions report their full size as ds_numel
        sizes = [(getattr(p, "ds_numel", p.numel()), p.requires_grad) for p in model.parameters()]
        trained, total = sum(n for n, grad in sizes if grad), sum(n for n, _ in sizes)
        common.console.print(f"training {trained:,} of {total:,} parameters ({100 * trained / total:.2f}%)")
    return engine


# ---------------------------------------------------------------------------------------------- main
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


def add_dpo_args(parser):
    """The objective's and the reference's flags (online_dpo.py has a copy)."""
    a = parser.add_argument
    a("--beta", type=common.ranged(float, 1e-6, 1e6), default=0.1,
      help="the KL strength: implicit reward = beta * (log pi - log pi_ref)")
    a("--loss_type", default="sigmoid", choices=LOSS_TYPES, help="sigmoid (DPO), ipo or hinge (SLiC)")
    a("--ipo", action="store_true", help="same as --loss_type ipo (OpenRLHF's flag)")
    a("--label_smoothing", type=common.ranged(float, 0, 0.5, hi_open=True), default=0.0,
      help="conservative DPO: the chance a label is wrong (sigmoid)")
    a("--nll_loss_coef", type=common.ranged(float, 0, 1e6), default=0.0,
      help="weight of an SFT term: the chosen's per-token NLL")
    a("--aux_loss_coef", type=common.ranged(float, 0, 1e6), default=0.0, help="MoE router load-balancing loss weight")
    a("--ref_pretrain", default=None, help="the reference (default: --pretrain; with --lora_rank the base model)")
    a("--ref_offload", action="store_true", help="keep the reference on the CPU between uses")


def check_dpo_args(args):
    if args.ipo:
        if args.loss_type not in ("sigmoid", "ipo"):
            common.fail(f"--ipo is --loss_type ipo: not with --loss_type {args.loss_type}")
        args.loss_type = "ipo"
    if args.label_smoothing and args.loss_type != "sigmoid":
        common.fail(f"--label_smoothing is conservative DPO's (--loss_type sigmoid), not {args.loss_type}'s")
    if args.ref_offload and args.lora_rank and not args.ref_pretrain:
        common.fail("--ref_offload: with --lora_rank the reference is the policy's base (adapters off), no copy to "
                    "offload; drop it, or give --ref_pretrain")


def load_reference(actor, args, tokenizer, cfg):
    """A context giving the model of the reference log-probs: the policy with its adapters off (--lora_rank without
    --ref_pretrain), or a frozen --ref_pretrain (default --pretrain), on the CPU between uses with --ref_offload."""
    if args.lora_rank and not args.ref_pretrain:
        return lambda: adapters_off(actor.module)
    ref = common.load_frozen(args.ref_pretrain or args.pretrain, args, tokenizer, cfg, args.ref_offload)
    return lambda: common.on_accelerator(ref, args.ref_offload and args.zero_stage != 3)


# The defaults, {flag: (a real run's, the toy world's)}: the toy world's apply when no --dataset is given
# (common.parse_args; "{toy}" is its directory), calibrated on 2 CPU cores from the demo's start (README).
DEFAULTS = {
    "save_path":                  ("runs/dpo",   "runs/dpo"),
    "dataset":                    (None,         "{toy}/pref_train.jsonl"),
    "eval_dataset":               (None,         "{toy}/pref_test.jsonl"),
    "max_len":                    (512,          32),
    "eval_generate_samples":      (0,            500),
    "generate_max_len":           (1024,         5),
    "micro_train_batch_size":     (8,            64),
    "learning_rate":              (5e-7,         1e-4),
    "lr_warmup_ratio":            (0.03,         0.05),
    "beta":                       (0.1,          0.5),
}


def parse_args():
    parser = add_training_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    add_dpo_args(parser)
    a = parser.add_argument
    a("--chosen_key", default="chosen")
    a("--rejected_key", default="rejected")
    a("--eval_generate_samples", type=common.ranged(int, 0),
      help="greedy-generate this many eval prompts, exact match with the chosen")
    a("--generate_max_len", type=common.ranged(int, 1), help="new tokens of an eval answer")
    a("--eval_steps", type=common.ranged(int, 1, also=[-1]), default=-1,
      help="evaluate every N steps (-1: before and after training only)")
    a("--online", action="store_true", help=argparse.SUPPRESS)  # moved to online_dpo.py: one line saying so
    parser.error = common.fail  # one line for a bad value here too, not argparse's usage block
    known, _ = parser.parse_known_args()  # before the full parse, which would refuse online_dpo.py's flags
    if known.online:
        common.fail("online DPO is online_dpo.py now: run `python online_dpo.py` with the same flags, less --online")
    args = common.parse_args(parser, DEFAULTS)
    check_dpo_args(args)
    return args


def main():
    args = parse_args()
    common.init_distributed(args)
    start = time.time()
    tokenizer = common.load_tokenizer(args.pretrain, args)
    pad_id = tokenizer.pad_token_id
    train, _ = load_pairs(args.dataset, args.dataset_split, tokenizer, args, args.max_samples, args.dataset_probs)
    eval_pairs, eval_answers = load_pairs(args.eval_dataset, args.eval_split, tokenizer, args,
                                          args.max_eval_samples) if args.eval_dataset else ([], [])
    if len(train) < args.train_batch_size:
        common.fail(f"{args.dataset}: {len(train)} pairs, fewer than --train_batch_size {args.train_batch_size}")
    total_steps = len(train) // args.train_batch_size * args.max_epochs  # a step: one optimizer step
    cfg = ds_config(args)
    model = common.load_model(args.pretrain, args, tokenizer, cfg)
    enable_router_loss(model, args.aux_loss_coef)
    common.disable_dropout(model)  # the policy and the reference compared as the same function
    actor = setup_deepspeed(model, args, cfg, total_steps)
    reference = load_reference(actor, args, tokenizer, cfg)
    start_step, _ = common.load_checkpoint(actor, args, total_steps)
    batches = train_batches(len(train), args, start_step)

    def evaluate():
        actor.module.eval()
        return evaluate_pairs(actor.module, reference, eval_pairs, eval_answers, tokenizer, args)

    timed = ("ref_s", "train_s", "step_s")  # summed per step for eval_results.json
    logger, results = common.Logger(args, total_steps, start_step, timed), {}
    if eval_pairs:
        common.log_eval(logger, start_step, evaluate(), results, "_before")
        if start_step == 0 and args.ref_pretrain in (None, args.pretrain) and common.is_rank0():
            common.console.print("(step 0: the policy is its reference, so every implicit reward is 0 and each pair "
                                 "ties: accuracy and margin 0 by definition)", markup=False)
    for step in range(start_step, total_steps):
        step_start = time.time()
        # 1. pairs: this rank's share of the next --train_batch_size, in the micro-batches of one optimizer step
        actor.module.eval()
        _, _, micro = next(batches)
        pairs = [train[i] for mb in micro for i in mb]
        layout = micro_batches(len(pairs), 1, cfg["gradient_accumulation_steps"])  # [1][gas] lists of pair indices
        counts = common.all_reduce_sum([float(len(pairs))])  # the pairs of the optimizer step on all ranks

        # 2. reference log-probs (no gradients)
        t = time.time()
        ref_logps = reference_logps(reference, pairs, layout, pairs[0], pad_id, args.packing_samples)  # [P, 2]
        metrics = {"ref_s": time.time() - t}

        # 3. update: one optimizer step on the mean loss over the step's pairs
        t = time.time()
        actor.module.train()
        stats = train_on_pairs(actor, pairs, ref_logps, layout, counts, pairs[0], pad_id, args)
        metrics["train_s"] = time.time() - t

        # 4. log (means over all ranks), save, eval
        metrics["step_s"] = time.time() - step_start
        out = common.all_reduce_means({**stats, **metrics})
        out["lr"] = actor.get_lr()[0]
        logger.log(step + 1, out)
        if common.due(args.save_steps, step + 1):
            common.save_checkpoint(actor, args, step + 1)
        if eval_pairs and common.due(args.eval_steps, step + 1, total_steps):
            common.log_eval(logger, step + 1, evaluate())

    results.update(logger.run_times(start))
    common.finish(actor, tokenizer, args, results, logger, evaluate=evaluate if eval_pairs else None)


if __name__ == "__main__":
    main()
