"""Process reward model: a causal LM that judges every reasoning step.

    python prm.py --pretrain runs/sft_steps         # toy world: judge running sums (see demo.py)
    deepspeed --num_gpus 8 prm.py --pretrain Qwen/Qwen2.5-Math-7B --dataset math_shepherd.jsonl \\
        --input_key input --label_key label --placeholder_token "ки" --reward_tokens "+" "-" \\
        --zero_stage 3 --bf16 --packing_samples --learning_rate 2e-6

Data: `input` is the solution text with a placeholder token after every step; `label` is a list with one entry per
placeholder: a reward token ("+" good, "-" bad; hard labels) or a float, the probability that the step is good (soft
labels, e.g. Monte-Carlo estimates); or, as in raw Math-Shepherd rows, a string: the input with each placeholder
replaced by its reward token. The loss is read only at the placeholders, over the reward tokens' logits (a step's end
predicts "+" or "-"). Saved: a plain Hugging Face causal LM whose config names both kinds of token.
"""

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from tokenizers import AddedToken

import common
import deepspeed  # after common, which names DeepSpeed's accelerator first (else it guesses, with a warning)


def prm_loss(logits, input_ids, labels, placeholder_token_id, reward_token_ids):
    """Cross-entropy over the reward tokens, at placeholder positions only; -> (loss, accuracy).

    logits [B, T, V]; input_ids [B, T]; the positions judged are those where input_ids equals the placeholder. Hard
    labels: `labels` [B, T] (integer) holds the reward token id there. Soft labels: `labels` [B, T] (float) holds p,
    the probability of reward_token_ids[0]; the target is [p, 1 - p]. Mean over all placeholders in the batch;
    accuracy is the argmax match (soft: against p > 0.5)."""
    at = input_ids == placeholder_token_id
    step_logits = logits[at][:, reward_token_ids]  # [N, R]
    step_logits = step_logits.to(torch.promote_types(step_logits.dtype, torch.float32))
    log_probs = F.log_softmax(step_logits, -1)
    if labels.is_floating_point():
        p = labels[at].to(log_probs.dtype)
        target = torch.stack([p, 1 - p], -1)
        loss = -(target * log_probs).sum(-1).mean()
        accuracy = ((log_probs.argmax(-1) == 0) == (p > 0.5)).float().mean()
    else:
        index = (labels[at][:, None] == torch.tensor(reward_token_ids, device=labels.device)).int().argmax(-1)
        loss = F.nll_loss(log_probs, index)
        accuracy = (log_probs.argmax(-1) == index).float().mean()
    return loss, accuracy


def setup_tokens(tokenizer, placeholder, reward_tokens):
    """-> (placeholder id, reward token ids). Tokens are looked up by encoding text, never by their surface
    string (a byte-level vocabulary stores "ки" as "ÐºÐ¸"). The placeholder must come out as one and the same
    token wherever a step ends (after a space, a word or a newline); where the tokenizer would merge it with
    its neighbours (Qwen: " ки" is two tokens, neither of them "ки"), it is added to the vocabulary as a token
    of its own. Each reward token must be one token."""
    def one_token_everywhere():
        ids = tokenizer(placeholder, add_special_tokens=False)["input_ids"]
        contexts = [f"x {placeholder}\ny", f"x{placeholder} y", f"1.\n{placeholder}", f"x  {placeholder}"]
        ok = len(ids) == 1 and all(tokenizer(c, add_special_tokens=False)["input_ids"].count(ids[0]) == 1
                                   for c in contexts)
        return ids[0] if ok else None

    placeholder_id = one_token_everywhere()
    if placeholder_id is None:
        tokenizer.add_tokens([AddedToken(placeholder, normalized=False)])
        placeholder_id = one_token_everywhere()
    if placeholder_id is None:
        common.fail(f"--placeholder_token {placeholder!r} does not come out as one token of this tokenizer even "
                    f"after adding it to the vocabulary ({type(tokenizer).__name__}); choose another placeholder")
    reward_ids = []
    for token in reward_tokens:
        ids = tokenizer(token, add_special_tokens=False)["input_ids"]
        # a sentencepiece vocabulary may prefix "▁" to a lone token: then the token itself, if it is in it
        own = ids[0] if len(ids) == 1 else tokenizer.convert_tokens_to_ids(token)
        if own in (None, tokenizer.unk_token_id):
            common.fail(f"reward token {token!r} is {len(ids)} tokens for this tokenizer; it must be one")
        reward_ids.append(own)
    return placeholder_id, reward_ids


def step_labels(record, where, reward_tokens, args):
    """The label of each step: a list (reward tokens or probabilities), or Math-Shepherd's raw form, a string:
    the input with each placeholder replaced by the step's reward token ("...= 3 +\n...= 7 -")."""
    labels, text, p = record[args.label_key], str(record[args.input_key]), args.placeholder_token
    n = text.count(p)
    if not isinstance(labels, (list, str)) or labels in reward_tokens:  # one step's label, unwrapped
        labels = [labels]
    if isinstance(labels, list):
        if len(labels) != n:
            common.fail(f"{where}: {n} placeholders {p!r} in {args.input_key!r} but {len(labels)} labels; "
                        f"{args.label_key!r} must hold one per placeholder: a list of reward tokens "
                        f"{reward_tokens} or probabilities, or Math-Shepherd's text (the input with each "
                        f"placeholder replaced by its reward token)")
        return labels
    pieces, out, at = text.split(p), [], 0
    for piece in pieces[:-1]:  # walk the label text along the input's pieces, reading the token at each step
        token = next((t for t in reward_tokens if labels.startswith(piece + t, at)), None)
        if token is None:
            break
        out.append(token)
        at += len(piece) + len(token)
    if len(out) < len(pieces) - 1 or labels[at:] != pieces[-1]:
        common.fail(f"{where}: {args.label_key!r} is a string but not the input with each placeholder {p!r} "
                    f"replaced by a reward token {reward_tokens} (Math-Shepherd's form); it differs after "
                    f"step {len(out)}. Or give a list with one label per placeholder")
    return out


def tokenize_sample(record, where, tokenizer, placeholder_id, reward_tokens, reward_ids, args):
    """-> (input_ids, labels, truncated) with labels at the placeholder positions (reward token id, or
    float p) and -100 elsewhere; None if not even the first step fits in --max_len. A longer sample is
    cut after its last whole step that fits."""
    text = common.format_prompt(record[args.input_key], tokenizer, args)
    ids = torch.tensor(tokenizer(text, add_special_tokens=not args.apply_chat_template)["input_ids"])  # one BOS
    steps = (ids == placeholder_id).nonzero().squeeze(-1)
    written = text.count(args.placeholder_token)
    if written == 0:
        common.fail(f"{where}: no placeholder {args.placeholder_token!r} in {args.input_key!r}")
    values = step_labels(record, where, reward_tokens, args)
    if len(steps) != written:
        common.fail(f"{where}: the placeholder {args.placeholder_token!r} is written {written} times but tokenizes "
                    f"to {len(steps)} placeholder tokens (the tokenizer merges it with the text around it here); "
                    "separate it with a space")
    soft = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in values)
    bad = [x for x in values if not (0 <= x <= 1 if soft else x in reward_tokens)]
    if bad:
        common.fail(f"{where}: label {bad[0]!r} is neither a reward token {reward_tokens} nor a probability in [0, 1]")
    labels = torch.full(ids.shape, -100.0 if soft else -100, dtype=torch.float32 if soft else torch.long)
    labels[steps] = torch.tensor([float(x) if soft else reward_ids[reward_tokens.index(x)] for x in values],
                                 dtype=labels.dtype)
    if len(ids) > args.max_len:
        fitting = steps[steps < args.max_len]
        return (ids[:fitting[-1] + 1], labels[:fitting[-1] + 1], True) if len(fitting) else None
    return ids, labels, False


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


def steps_of(text, separator):
    """The steps of a solution's text: its pieces between separators, blank pieces not counted, at least one (the
    whole text). -> (the indices of the step pieces, the pieces)."""
    pieces = text.split(separator)
    steps = [i for i, p in enumerate(pieces) if p.strip()]
    return steps or [len(pieces) - 1], pieces


def completion_text(text, tokenizer):
    """What the step contract reads of a completion: its text decoded with the special tokens kept (as a /get_reward
    query carries it), every special token's text removed. A BOS or EOS the policy wrote inside a completion, its
    stop token and pads are no step: the trainer (process_rewards.py) and serve_rm.py read steps by copies of this
    rule, which tests compare, so they count the same steps."""
    specials = set(tokenizer.all_special_tokens) | {t.content for t in tokenizer.added_tokens_decoder.values()
                                                    if t.special}
    for token in sorted(specials, key=len, reverse=True):  # "<|im_end|>" before a shorter token inside it
        text = text.replace(token, "")
    return text


def with_placeholders(text, separator, placeholder):
    """A solution written as this script's data has it: the placeholder after every step ("07+45=52 ки\n..."). One
    the text holds already (a policy may write it) is dropped, as it would read as one more step end; the steps are
    still those of the text as written."""
    steps, pieces = steps_of(text, separator)
    pieces = [p.replace(placeholder, "") for p in pieces]
    for i in steps:
        pieces[i] = pieces[i].rstrip() + " " + placeholder
    return separator.join(pieces)


def check_saved(config, tokenizer, path):
    """A saved PRM as a judge: its config names the placeholder and the two reward tokens (this script writes
    them; a config with only their ids gets their text from the tokenizer), and its tokenizer still makes each of
    them one token; else one line saying what is wrong."""
    if getattr(config, "placeholder_token_id", None) is None:
        common.fail(f"{path} has no placeholder_token_id in its config: not a prm.py model")
    if len(config.reward_token_ids) != 2 or len(set(config.reward_token_ids)) != 2:
        common.fail(f"{path}: reward_token_ids {config.reward_token_ids} must be two distinct tokens (good, bad)")
    if getattr(config, "placeholder_token", None) is None:  # a config with the ids alone: the tokens' own text
        config.placeholder_token = tokenizer.decode([config.placeholder_token_id])
    if getattr(config, "reward_tokens", None) is None:
        config.reward_tokens = [tokenizer.decode([i]) for i in config.reward_token_ids]
    for token, want in [(config.placeholder_token, config.placeholder_token_id),
                        *zip(config.reward_tokens, config.reward_token_ids)]:
        ids = tokenizer(token, add_special_tokens=False)["input_ids"]
        if ids != [want] and tokenizer.convert_tokens_to_ids(token) != want:  # (sentencepiece: a lone "▁+")
            common.fail(f"{path}: {token!r} encodes to {ids} in its tokenizer, not to the one token {want} its config "
                        "names (a PRM reads its judgement at one token)")


@torch.no_grad()
def step_probabilities(model, seqs, pad_id):
    """A saved PRM's judgement of token sequences (1-D tensors, one padded forward): for each, the probability of
    the first reward token (good) at every placeholder, as prm_loss trained it (serve_rm.py and process_rewards.py
    hold copies; tests compare them)."""
    cfg, device = model.config, next(model.parameters()).device
    ids, mask = (t.to(device) for t in batch_sequences(list(seqs), pad_id, False)[:2])
    hidden, _ = common.forward_hidden(model, dict(input_ids=ids, attention_mask=mask))
    at = (ids == cfg.placeholder_token_id) & mask.bool()  # the judged positions: logits there only, not [B, T, V]
    probs = torch.softmax(common.output_layer(model)(hidden[at])[:, cfg.reward_token_ids].float(), -1)[:, 0]
    return [p.tolist() for p in probs.split(at.sum(-1).tolist())]


def score_steps(model, tokenizer, text):
    """Per-step probability that the step is good (of the first reward token), for a saved PRM: one text with its
    placeholders, tokenized as prm.py tokenizes its data."""
    ids = tokenizer(text, return_tensors="pt")["input_ids"][0]
    return step_probabilities(model, [ids], tokenizer.pad_token_id)[0]


@torch.no_grad()
def evaluate(engine, data, reward_ids, placeholder_id, pad_id, args):
    """Step accuracy, and solution accuracy: a solution is judged good iff all its steps are (a soft label
    counts as good when p > 0.5)."""
    model = engine.module
    model.eval()
    steps = step_correct = solutions = solution_correct = loss_sum = 0.0
    for batch, real in eval_shard(data, args.micro_train_batch_size):
        ids, mask, pos = (t.to(engine.device) for t in batch_sequences([x for x, _ in batch], pad_id, False))
        hidden, _ = common.forward_hidden(model, dict(input_ids=ids, attention_mask=mask, position_ids=pos))
        judged = common.output_layer(model)(hidden[(ids == placeholder_id) & mask.bool()])  # as in training
        for (seq_ids, labels), keep in zip(batch, real):
            at = seq_ids == placeholder_id
            n = at.sum().item()
            logits, judged = judged[:n], judged[n:]  # this sample's steps, [n, V]
            if not keep:  # a filler that keeps ZeRO-3 ranks in step
                continue
            loss, acc = prm_loss(logits[None], seq_ids[at][None].to(engine.device), labels[at][None].to(engine.device),
                                 placeholder_id, reward_ids)
            steps, step_correct, loss_sum = steps + n, step_correct + round(acc.item() * n), loss_sum + loss.item() * n
            predicted_good = logits[:, reward_ids].argmax(-1) == 0
            truly_good = labels[at] > 0.5 if labels.is_floating_point() else labels[at] == reward_ids[0]
            solutions += 1
            solution_correct += bool(predicted_good.all()) == bool(truly_good.all())
    steps, step_correct, loss_sum, solutions, solution_correct = common.all_reduce_sum(
        [steps, step_correct, loss_sum, solutions, solution_correct])
    model.train()
    return {"loss": loss_sum / steps, "step_acc": step_correct / steps, "solution_acc": solution_correct / solutions}


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
    "save_path":                  ("runs/prm",   "runs/prm"),
    "dataset":                    (None,         "{toy}/prm_train.jsonl"),
    "eval_dataset":               (None,         "{toy}/prm_test.jsonl"),
    "max_len":                    (512,          64),
    "max_epochs":                 (1,            6),
    "train_batch_size":           (64,           32),
    "micro_train_batch_size":     (8,            32),
    "learning_rate":              (2e-6,         3e-4),
    "lr_warmup_ratio":            (0.03,         0.1),
}


def main():
    parser = add_training_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    parser.add_argument("--label_key", default="label")
    parser.add_argument("--placeholder_token", default="ки", help="marks the end of every step in the input")
    parser.add_argument("--reward_tokens", nargs="+", default=["+", "-"], help="good first, then bad")
    parser.add_argument("--eval_steps", type=common.ranged(int, 1, also=[-1]), default=-1,
                        help="evaluate every N steps (-1: at the end)")
    parser.add_argument("--aux_loss_coef", type=common.ranged(float, 0, 1e6), default=0.0,
                        help="MoE router load-balancing loss weight")
    args = common.parse_args(parser, DEFAULTS)
    common.init_distributed(args)
    start = time.time()

    # 1. data: every step ends in the placeholder, labelled with a reward token; the other tokens masked
    tokenizer = common.load_tokenizer(args.pretrain, args)
    placeholder_id, reward_ids = setup_tokens(tokenizer, args.placeholder_token, args.reward_tokens)
    keys = [args.input_key, args.label_key]

    def tokenize(source, split, max_samples=None, probs=None):
        records, where = common.load_records(source, split, keys, max_samples, with_locations=True, probs=probs,
                                             seed=args.seed, text_keys=keys[:1])
        samples = [tokenize_sample(r, w, tokenizer, placeholder_id, args.reward_tokens, reward_ids, args)
                   for r, w in zip(records, where)]
        kept = [s for s in samples if s is not None]
        cut = sum(s[2] for s in kept)
        if (cut or len(kept) < len(samples)) and common.is_rank0():
            common.console.print(f"{source}: --max_len {args.max_len} cut {cut} samples after their last whole "
                                 f"step and dropped {len(samples) - len(kept)} whose first step does not fit")
        return [(ids, labels) for ids, labels, _ in kept]

    train = tokenize(args.dataset, args.dataset_split, args.max_samples, args.dataset_probs)
    if len(train) < args.train_batch_size:
        common.fail(f"{args.dataset}: {len(train)} usable samples, fewer than --train_batch_size "
                    f"{args.train_batch_size}")
    eval_data = tokenize(args.eval_dataset, args.eval_split, args.max_eval_samples) if args.eval_dataset else []

    # 2. model and DeepSpeed engine, resumed with --load_checkpoint
    cfg = ds_config(args)
    model = common.load_model(args.pretrain, args, tokenizer, cfg)
    enable_router_loss(model, args.aux_loss_coef)
    total_steps = len(train) // args.train_batch_size * args.max_epochs
    engine = setup_deepspeed(model, args, cfg, total_steps)
    start_step, _ = common.load_checkpoint(engine, args, total_steps)
    logger = common.Logger(args, total_steps, start_step)

    # 3. train: one optimizer step per --train_batch_size samples; log, save, eval
    for step, epoch, micro_batches in train_batches(len(train), args, start_step):
        t0, stats = time.time(), []
        for idx in micro_batches:
            ids, mask, pos = batch_sequences([train[i][0] for i in idx], tokenizer.pad_token_id, args.packing_samples)
            labels, _, _ = batch_sequences([train[i][1] for i in idx], -100, args.packing_samples)
            hidden, out = common.forward_hidden(engine, dict(
                input_ids=ids.to(engine.device), position_ids=pos.to(engine.device),
                attention_mask=None if mask is None else mask.to(engine.device)))
            at = ids == placeholder_id  # the judged positions: logits there only, [steps, V], not [B, T, V]
            logits = common.output_layer(engine)(hidden[at.to(engine.device)])
            loss, acc = prm_loss(logits[None], ids[at][None].to(engine.device), labels[at][None].to(engine.device),
                                 placeholder_id, reward_ids)
            if args.aux_loss_coef:  # a mixture of experts' router load-balancing loss
                loss = loss + args.aux_loss_coef * out.aux_loss
            engine.backward(loss)
            engine.step()
            stats.append([loss.item(), acc.item()])
        loss, acc = [v / dist.get_world_size() for v in common.all_reduce_sum(torch.tensor(stats).mean(0).tolist())]
        logger.log(step + 1, {"loss": loss, "step_acc": acc, "lr": engine.get_lr()[0],
                              "samples_per_s": args.train_batch_size / (time.time() - t0), "epoch": epoch})
        if common.due(args.save_steps, step + 1):
            common.save_checkpoint(engine, args, step + 1)
        if eval_data and common.due(args.eval_steps, step + 1, total_steps):
            logger.log(step + 1, evaluate(engine, eval_data, reward_ids, placeholder_id, tokenizer.pad_token_id, args),
                       prefix="eval")

    # 4. the final eval, then save the model with its step tokens (serve_rm.py and --process_rewards read them)
    results = {"train_time_s": time.time() - start, "steps": total_steps}
    if eval_data:
        metrics = evaluate(engine, eval_data, reward_ids, placeholder_id, tokenizer.pad_token_id, args)
        logger.log(total_steps, metrics, prefix="eval")
        results.update({f"eval_{k}": v for k, v in metrics.items()})
    extra = {"placeholder_token": args.placeholder_token, "placeholder_token_id": placeholder_id,
             "reward_tokens": args.reward_tokens, "reward_token_ids": reward_ids}
    common.finish(engine, tokenizer, args, results, logger, extra_config=extra)


if __name__ == "__main__":
    main()
