"""Reward model: a scalar score per sequence, trained on preference pairs with the Bradley-Terry loss.

    python rm.py                                    # the toy world: starts from the toy SFT model
    deepspeed --num_gpus 8 rm.py --pretrain ./runs/sft --dataset prefs.jsonl --input_key prompt \\
        --chosen_key chosen --rejected_key rejected --apply_chat_template --zero_stage 3 --bf16 \\
        --learning_rate 9e-6 --packing_samples

The model is a stock `AutoModelForSequenceClassification` (num_labels=1): its `score` head, a linear
layer over the last hidden state, gives a reward at every position, and the reward of a sequence is the
one at its last token, which we make an EOS. The saved directory loads with stock `from_pretrained` and
scores the same; its config also carries the eval reward `mean` and `std` (for --normalize_reward in RL).

Data: `input` (prompt, string or chat messages; `--input_key ''` when chosen/rejected hold the whole
text), `chosen` and `rejected` (responses), and optionally a per-pair margin (`--margin_key`).
"""

import argparse
import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from transformers import AutoConfig, AutoModelForSequenceClassification

import common
import deepspeed  # after common, which names DeepSpeed's accelerator first (else it guesses, with a warning)


def pairwise_loss(chosen_rewards, rejected_rewards, margin=None):
    """Bradley-Terry negative log-likelihood that chosen beats rejected, optionally by a margin m:
    mean(-log σ(r_chosen - r_rejected - m)). Rewards [B], margin [B] or None."""
    diff = chosen_rewards - rejected_rewards
    if margin is not None:
        diff = diff - margin
    return -F.logsigmoid(diff).mean()


def last_token_index(attention_mask=None, seq_lens=None):
    """Where each sequence's reward is read: its last real token.
    Padded [B, T] rows: the last 1 of the attention mask (left or right padding alike, and never the pad
    id, which may equal a real token). Packed rows: the end of each sequence, from the lengths."""
    if seq_lens is not None:
        return torch.tensor(seq_lens).cumsum(0) - 1
    T = attention_mask.size(1)
    return T - 1 - attention_mask.flip(-1).argmax(-1)


def sequence_rewards(model, input_ids, attention_mask, position_ids, seq_lens=None):
    """The value head, visible: score(hidden state) at every position, read at each sequence's last token.
    -> [B] for padded input, [num sequences] for a packed row."""
    backbone = getattr(model, model.base_model_prefix)  # e.g. model.model for Llama/Qwen
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      use_cache=False).last_hidden_state  # [B, T, H]
    values = model.score(hidden).squeeze(-1)  # [B, T]: a reward at every position
    index = last_token_index(attention_mask, seq_lens).to(values.device)
    if seq_lens is not None:
        return values[0, index].float()
    return values.gather(1, index[:, None]).squeeze(1).float()


def tokenize_response(record, key, tokenizer, args, where="a record"):
    """prompt + response, truncated to --max_len, always ending in EOS: the token the reward is read at."""
    prompt, response = record[args.input_key] if args.input_key else None, record[key]
    if not args.apply_chat_template and any(isinstance(x, list) for x in (prompt, response)):
        common.fail(f"{where}: chat messages need --apply_chat_template")
    if prompt is not None and isinstance(response, list) and response and response[0].get("role") != "assistant":
        common.fail(f"{where}: a {key} conversation that repeats the prompt: give --input_key '' (the whole "
                    f"conversation is then scored)")
    if args.apply_chat_template:
        messages = ([] if prompt is None else prompt if isinstance(prompt, list) else
                    [{"role": "user", "content": prompt}])
        reply = response if isinstance(response, list) else [{"role": "assistant", "content": response}]
        messages = messages + reply  # a new list: `+=` would extend the record's prompt, and rejected follow chosen
        text = tokenizer.apply_chat_template(messages, tokenize=False).rstrip()  # drop "\n" after eos
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        text = ("" if prompt is None else common.format_prompt(prompt, tokenizer, args)) + str(response)
        ids = tokenizer(text)["input_ids"]
    if not ids or ids[-1] != tokenizer.eos_token_id:
        ids.append(tokenizer.eos_token_id)
    if len(ids) > args.max_len:  # keep the start, and put EOS back as the last token
        ids = ids[:args.max_len - 1] + [tokenizer.eos_token_id]
    return torch.tensor(ids)


def batch_sequences(seqs, pad_value, packing):
    """1-D LongTensors -> input tensor plus position_ids and attention mask.
    padded: [B, T] right-padded, mask 1 on real tokens. packed: [1, sum(T_i)], position_ids restarting
    at 0 for every sequence and no mask (transformers finds the boundaries from position_ids; the
    forward must run with use_cache=False or the boundaries are lost)."""
    if packing:
        ids = torch.cat(seqs)[None]
        pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
        return ids, None, pos
    ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=pad_value)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(s) for s in seqs], batch_first=True)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, pos


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


def eval_shard(items, batch_size):
    """This rank's share of `items` (every world-th) in batches of (items, real). Every rank gets the same count (a
    ZeRO-3 forward needs all ranks): the shortfall is filled with items[0], marked real=False, which the caller runs
    but does not count."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = list(range(rank, len(items), world))
    mine += [-1] * (-(-len(items) // world) - len(mine))
    shard, real = [items[max(j, 0)] for j in mine], [j >= 0 for j in mine]
    return [(shard[i:i + batch_size], real[i:i + batch_size]) for i in range(0, len(shard), batch_size)]


def pair_rewards(model, chosen, rejected, pad_id, packing, device):
    """Chosen and rejected in one forward: [chosen..., rejected...] -> (chosen_rewards, rejected_rewards)."""
    seqs = chosen + rejected
    ids, mask, pos = batch_sequences(seqs, pad_id, packing)
    rewards = sequence_rewards(model, ids.to(device), None if mask is None else mask.to(device),
                               pos.to(device), [len(s) for s in seqs] if packing else None)
    return rewards[:len(chosen)], rewards[len(chosen):]


@torch.no_grad()
def evaluate(engine, data, tokenizer, args):
    """Pair accuracy (chosen scored higher), loss, and the mean/std of all rewards."""
    model = engine.module
    model.eval()
    n = correct = loss_sum = r_sum = r_sq = 0.0
    for batch, real in eval_shard(data, args.micro_train_batch_size):  # fillers: run, not counted
        chosen, rejected = pair_rewards(model, [pair[0] for pair in batch], [pair[1] for pair in batch],
                                        tokenizer.pad_token_id, False, engine.device)
        real = torch.tensor(real)
        chosen, rejected = chosen.cpu()[real], rejected.cpu()[real]
        n += len(chosen)
        correct += (chosen > rejected).sum().item()
        loss_sum += pairwise_loss(chosen, rejected).item() * len(chosen) if len(chosen) else 0.0
        r_sum += (chosen.sum() + rejected.sum()).item()
        r_sq += (chosen.pow(2).sum() + rejected.pow(2).sum()).item()
    n, correct, loss_sum, r_sum, r_sq = common.all_reduce_sum([n, correct, loss_sum, r_sum, r_sq])
    model.train()
    mean = r_sum / (2 * n)
    return {"acc": correct / n, "loss": loss_sum / n, "reward_mean": mean,
            "reward_std": math.sqrt(max(r_sq / (2 * n) - mean**2, 0.0))}


# --------------------------------------------------------------------------- the model and DeepSpeed
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


# ---------------------------------------------------------------------------------------------- args
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


# The defaults, {flag: (a real run's, the toy world's)}: the toy world's apply when no --dataset is given
# (common.parse_args; "{toy}" is its directory).
DEFAULTS = {
    "save_path":                  ("runs/rm",    "runs/rm"),
    "dataset":                    (None,         "{toy}/pref_train.jsonl"),
    "eval_dataset":               (None,         "{toy}/pref_test.jsonl"),
    "max_len":                    (512,          32),
    "max_epochs":                 (1,            4),
    "micro_train_batch_size":     (8,            32),
    "learning_rate":              (9e-6,         3e-4),
    "lr_warmup_ratio":            (0.03,         0.1),
}


def main():
    # 1. flags (the toy world's defaults without --dataset) and processes
    parser = add_training_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    parser.add_argument("--chosen_key", default="chosen")
    parser.add_argument("--rejected_key", default="rejected")
    parser.add_argument("--margin_key", default=None, help="optional per-pair margin in the loss")
    parser.add_argument("--eval_steps", type=common.ranged(int, 1, also=[-1]), default=-1,
                        help="evaluate every N steps (-1: at the end)")
    args = common.parse_args(parser, DEFAULTS)
    common.init_distributed(args)
    start = time.time()

    # 2. data: (chosen, rejected, margin), each prompt + response ending in EOS, where the reward is read
    tokenizer = common.load_tokenizer(args.pretrain, args)
    keys = [k for k in (args.input_key, args.chosen_key, args.rejected_key, args.margin_key) if k]
    texts = [k for k in keys if k != args.margin_key]

    def read_margin(record, where):
        try:
            value = float(record[args.margin_key]) if args.margin_key else 0.0
        except (TypeError, ValueError):
            value = math.nan
        if not math.isfinite(value):  # (NaN, a string of no number: every loss would be NaN)
            common.fail(f"{where}: {args.margin_key!r} is {record[args.margin_key]!r}, not a number (its margin)")
        return value

    def tokenize(records, locations):
        return [(tokenize_response(r, args.chosen_key, tokenizer, args, where),
                 tokenize_response(r, args.rejected_key, tokenizer, args, where), read_margin(r, where))
                for r, where in zip(records, locations)]

    train = tokenize(*common.load_records(args.dataset, args.dataset_split, keys, args.max_samples,
                                          with_locations=True, probs=args.dataset_probs, seed=args.seed,
                                          text_keys=texts))
    if len(train) < args.train_batch_size:
        common.fail(f"{args.dataset}: {len(train)} pairs, fewer than --train_batch_size {args.train_batch_size}")
    eval_data = tokenize(*common.load_records(args.eval_dataset, args.eval_split, keys, args.max_eval_samples,
                                              with_locations=True, text_keys=texts)) if args.eval_dataset else []

    # 3. model (a one-output score head) and DeepSpeed engine, resumed with --load_checkpoint
    cfg = ds_config(args)
    model = common.load_model(args.pretrain, args, tokenizer, cfg, AutoModelForSequenceClassification, new_head=True,
                              num_labels=1)
    if not any(a.endswith("ForSequenceClassification") for a in AutoConfig.from_pretrained(
            args.pretrain, trust_remote_code=args.trust_remote_code).architectures or []):
        # a new head on a causal LM: small init, std 1/sqrt(H+1), so the first rewards are near 0
        with deepspeed.zero.GatheredParameters([model.score.weight], modifier_rank=0, enabled=args.zero_stage == 3):
            torch.nn.init.normal_(model.score.weight, std=1 / math.sqrt(model.config.hidden_size + 1))
    total_steps = len(train) // args.train_batch_size * args.max_epochs
    engine = setup_deepspeed(model, args, cfg, total_steps)
    start_step, _ = common.load_checkpoint(engine, args, total_steps)
    logger = common.Logger(args, total_steps, start_step)

    # 4. train on the pairwise loss: one optimizer step per --train_batch_size pairs; log, save, eval
    for step, epoch, micro_batches in train_batches(len(train), args, start_step):
        t0, stats = time.time(), []
        for idx in micro_batches:
            chosen, rejected = pair_rewards(engine, [train[i][0] for i in idx], [train[i][1] for i in idx],
                                            tokenizer.pad_token_id, args.packing_samples, engine.device)
            margin = torch.tensor([train[i][2] for i in idx], device=engine.device) if args.margin_key else None
            loss = pairwise_loss(chosen, rejected, margin)
            engine.backward(loss)
            engine.step()
            stats.append([loss.item(), (chosen > rejected).float().mean().item(), (chosen - rejected).mean().item()])
        loss, acc, gap = common.all_reduce_sum(torch.tensor(stats).mean(0).tolist())
        world = dist.get_world_size()
        logger.log(step + 1, {"loss": loss / world, "acc": acc / world, "reward_gap": gap / world,
                              "lr": engine.get_lr()[0], "pairs_per_s": args.train_batch_size / (time.time() - t0),
                              "epoch": epoch})
        if common.due(args.save_steps, step + 1):
            common.save_checkpoint(engine, args, step + 1)
        if eval_data and common.due(args.eval_steps, step + 1, total_steps):
            logger.log(step + 1, evaluate(engine, eval_data, tokenizer, args), prefix="eval")

    # 5. the final eval (its reward mean/std saved with the model: OpenRLHF's normalisation), then save
    results, extra = {"train_time_s": time.time() - start, "steps": total_steps}, {}
    if eval_data:
        metrics = evaluate(engine, eval_data, tokenizer, args)
        logger.log(total_steps, metrics, prefix="eval")
        results.update({f"eval_{k}": v for k, v in metrics.items()})
        extra = {"mean": metrics["reward_mean"], "std": metrics["reward_std"]}  # OpenRLHF's names
    common.finish(engine, tokenizer, args, results, logger, extra_config=extra)


if __name__ == "__main__":
    main()
