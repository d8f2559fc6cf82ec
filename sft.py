"""Supervised fine-tuning: next-token cross-entropy on the response tokens only.

    python sft.py                                   # the toy world: learns two-digit addition
    deepspeed --num_gpus 8 sft.py --pretrain Qwen/Qwen2.5-7B --dataset data.jsonl \\
        --input_key question --output_key answer --apply_chat_template --zero_stage 3 --bf16 \\
        --learning_rate 5e-6 --packing_samples --flash_attn

Data: one record per sample, `input` (the prompt: a string, or a list of chat messages) and `output`
(the response). With --multiturn, `input` is a whole conversation and every assistant turn is trained on.
With --pretrain_mode, `input` (then `output`, if present) is plain text and every token is trained on.
"""

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers

import common
import deepspeed  # after common, which names DeepSpeed's accelerator first (else it guesses, with a warning)


def sft_loss(logits, labels):
    """Mean next-token cross-entropy over the tokens we train on.

    logits [B, T, V]; labels [B, T] hold the token id where the loss applies (the response) and -100
    elsewhere (prompt, padding). Position t predicts token t+1, hence the shift. In a packed row the
    shift crosses sequence boundaries, which is harmless: every sequence starts with a -100 label.
    The reference form (and public API): sft.py trains with sft_loss_chunked, the same number without the logits;
    a change to the loss goes in both (tests/test_chunked_loss.py holds them equal).
    """
    logits, targets = logits[:, :-1], labels[:, 1:]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 logits: CE in fp32
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100)


def sft_loss_chunked(model, hidden, labels):
    """sft_loss(model's logits, labels), what sft.py trains with, without the [B, T, V] logits: the final hidden
    states [B, T, H] of the positions that predict a label (common.forward_hidden) go through the output layer a chunk
    of tokens at a time (token_nll_sum)."""
    targets = labels[:, 1:]
    at = targets != -100
    return token_nll_sum(model, hidden[:, :-1][at], targets[at]) / at.sum()


def token_nll_sum(model, hidden, tokens):
    """-sum_i log softmax(logits_i)[tokens_i] over `tokens` [N], from their final hidden states [N, H]: linear_nll
    where the output layer is a plain matrix W (in training through LinearNLL, its gradient taken in forward), else
    (LoRA or a bias on it, ZeRO-3 partitions, a family's logit scaling: common.output_layer knows them)
    common.token_logprobs, whose chunks make their logits again in backward."""
    inner = common.unwrap(model)
    head, cfg = inner.get_output_embeddings(), inner.config.get_text_config()
    fused = type(head) is torch.nn.Linear and head.bias is None and not hasattr(head.weight, "ds_id") and not any(
        getattr(cfg, k, None) for k in common.LOGIT_SCALING)
    if fused and torch.is_grad_enabled() and hidden.requires_grad:
        return LinearNLL.apply(hidden, head.weight, tokens)
    if fused:  # an eval: the loss alone
        return linear_nll(hidden, head.weight, tokens, grads=False)[0]
    logprobs, _ = common.token_logprobs(model, hidden, tokens)
    return -logprobs.sum()


def linear_nll(hidden, weight, tokens, grads=True, weight_grad=True):
    """The fused linear cross-entropy (Liger Kernel's and TRL's), written out -> (loss, dloss/dhidden, dloss/dW; the
    gradients None without `grads`, dW None without `weight_grad`: a frozen head). For each chunk of tokens (rows):

        x = hidden @ W.T                              [C, V] logits: the only ones that exist at a time
        loss += sum over rows of logsumexp(x) - x[token]          (-log softmax(x)[token])
        dloss/dx = softmax(x) - onehot(token)
        dloss/dhidden = dx @ W,  dloss/dW += dx.T @ hidden

    The loss ends the graph, so its gradient is known here (LinearNLL keeps it for backward) and the chunk's logits
    are dropped: one [C, V] matmul a chunk fewer than making them again in backward. The softmax runs in fp32 at least.
    A change to the loss goes in the lines marked (1) and (2), in sft_loss (the reference it is tested against) and in
    token_nll_sum's other way, which reads only each token's log-prob (common.token_logprobs): label smoothing eps
    makes (1) (1 - eps) * (lse - x[token]) + eps * (lse - x.mean(-1)) and (2) softmax(x) - (1 - eps) * onehot -
    eps / V, and needs the whole distribution there too (or refuse that way); a weight w_i per token scales token i's
    term in (1) and its gradient row after (2), and sft_loss_chunked then divides by sum(w), not the token count."""
    loss = hidden.new_zeros((), dtype=torch.promote_types(weight.dtype, torch.float32))
    grad_hidden = torch.empty_like(hidden) if grads else None
    grad_weight = torch.zeros_like(weight) if grads and weight_grad else None
    rows = common.chunk_rows(weight.shape[0])
    for start in range(0, len(tokens), rows):
        h, t = hidden[start:start + rows], tokens[start:start + rows]
        x = (h @ weight.T).to(loss.dtype)
        lse = x.logsumexp(-1)
        at = torch.arange(len(t), device=t.device)
        loss += (lse - x[at, t]).sum()  # (1)
        if not grads:
            continue
        grad = x.sub_(lse[:, None]).exp_()  # softmax(x), in place of the logits
        grad[at, t] -= 1  # (2)
        grad = grad.to(h.dtype)
        grad_hidden[start:start + rows] = grad @ weight
        if grad_weight is not None:
            grad_weight.addmm_(grad.T, h)  # in the weight's dtype per chunk, as Liger's
    return loss, grad_hidden, grad_weight


class LinearNLL(torch.autograd.Function):
    """linear_nll for autograd: forward takes the gradients with the loss, backward only scales them by the gradient
    coming in."""

    @staticmethod
    def forward(ctx, hidden, weight, tokens):
        loss, grad_hidden, grad_weight = linear_nll(hidden, weight, tokens, weight_grad=ctx.needs_input_grad[1])
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        scale = lambda g: None if g is None else g * grad_loss.to(g.dtype)  # noqa: E731
        return scale(grad_hidden), scale(grad_weight), None


def tokenize_sample(record, tokenizer, args):
    """-> (input_ids, labels) as 1-D LongTensors, labels -100 on every token that is not a response.
    None if the prompt alone does not fit in --max_len (the sample is dropped, and counted)."""
    chat = args.apply_chat_template
    if args.pretrain_mode:
        pieces = [(str(record[args.input_key]) + str(record.get(args.output_key) or ""), True)]
    elif args.multiturn:
        pieces = multiturn_pieces(record[args.input_key], tokenizer)
    else:
        prompt = common.format_prompt(record[args.input_key], tokenizer, args)
        if chat:  # the template renders the assistant turn, eos included
            messages = record[args.input_key] if isinstance(record[args.input_key], list) else [
                {"role": "user", "content": record[args.input_key]}]
            full = tokenizer.apply_chat_template(
                messages + [{"role": "assistant", "content": record[args.output_key]}], tokenize=False)
            if not full.startswith(prompt):
                common.fail("the chat template renders the prompt differently once a reply follows")
            pieces = [(prompt, False), (full[len(prompt):], True)]
        else:
            pieces = [(prompt, False), (str(record[args.output_key]), True)]
    if chat:  # a reply is trained through the turn's stop token (eos), not what the template writes after it
        eos, split = tokenizer.eos_token, []
        for text, trained in pieces:
            cut = text.rfind(eos) + len(eos) if trained and eos in text else len(text)
            split += [(text[:cut], trained), (text[cut:], False)]
        pieces = [(text, trained) for text, trained in split if text]
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
    first_trained = next((i for i, label in enumerate(labels) if label != -100), len(labels))
    if first_trained >= args.max_len:
        return None
    return torch.tensor(ids[:args.max_len]), torch.tensor(labels[:args.max_len])


def multiturn_pieces(messages, tokenizer):
    """Split a rendered conversation into (text, is_assistant) pieces, by rendering growing prefixes."""
    if not isinstance(messages, list):
        common.fail("--multiturn needs the input to be a list of chat messages")
    pieces, done = [], ""
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        through = tokenizer.apply_chat_template(messages[:i + 1], tokenize=False)
        if not (before.startswith(done) and through.startswith(before)):
            common.fail("this chat template does not render conversations as growing prefixes; "
                        "--multiturn cannot find the assistant turns")
        pieces += [(before[len(done):], False), (through[len(before):], True)]
        done = through
    return pieces


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


@torch.no_grad()
def greedy_generate(model, prompts, tokenizer, max_new_tokens, synced=False):
    """Greedy answers (text, special tokens skipped) to prompts given as token ids, left-padded in one batch (generation
    appends on the right). `synced`: ZeRO-3 over several processes, where every rank runs every forward."""
    batch = tokenizer.pad({"input_ids": prompts}, padding_side="left", return_attention_mask=True, return_tensors="pt")
    ids, mask = batch["input_ids"].to(model.device), batch["attention_mask"].to(model.device)
    with common.sampling_as_asked(model):  # greedy: no repetition penalty from generation_config.json
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                             synced_gpus=synced, use_cache=True)
    return tokenizer.batch_decode(out[:, ids.size(1):], skip_special_tokens=True)


@torch.no_grad()
def evaluate(engine, data, records, tokenizer, args):
    """Eval loss (token mean), and exact match of greedy answers on the first --eval_generate_samples."""
    model = engine.module
    model.eval()
    loss_sum, tokens = 0.0, 0
    for batch, real in eval_shard(data, args.micro_train_batch_size):
        # a filler runs the forward, as ZeRO-3 needs every rank, but has no label to count
        labels = [y if keep else torch.full_like(y, -100) for (_, y), keep in zip(batch, real)]
        ids, mask, pos = batch_sequences([x for x, _ in batch], tokenizer.pad_token_id, False)
        labels, _, _ = batch_sequences(labels, -100, False)
        ids, mask, pos = ids.to(engine.device), mask.to(engine.device), pos.to(engine.device)
        hidden, _ = common.forward_hidden(model, dict(input_ids=ids, attention_mask=mask, position_ids=pos))
        targets = labels[:, 1:].to(engine.device)
        at = targets != -100  # on every rank, fillers too (ZeRO-3's gathers): their sum is 0
        loss_sum += token_nll_sum(model, hidden[:, :-1][at], targets[at]).item()
        tokens += at.sum().item()
    correct, total = 0, 0
    for batch, real in eval_shard(records[:max(args.eval_generate_samples, 0)], args.micro_train_batch_size):
        prompts = [tokenizer(common.format_prompt(r[args.input_key], tokenizer, args),
                             add_special_tokens=not args.apply_chat_template)["input_ids"] for r in batch]
        answers = greedy_generate(model, prompts, tokenizer, args.generate_max_len,
                                  synced=args.zero_stage == 3 and dist.get_world_size() > 1)
        for record, answer, keep in zip(batch, answers, real):
            if keep:
                correct += answer.strip() == str(record[args.output_key]).strip()
                total += 1
    loss_sum, tokens, correct, total = common.all_reduce_sum([loss_sum, tokens, correct, total])
    model.train()
    metrics = {"loss": loss_sum / max(tokens, 1)}
    if total:
        metrics["exact_match"] = correct / total
    return metrics


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
# (common.parse_args; "{toy}" is its directory), calibrated on 2 CPU cores: ~98% held-out exact match
# in about 80 s.
DEFAULTS = {
    "save_path":                  ("runs/sft",   "runs/sft"),
    "dataset":                    (None,         "{toy}/sft_train.jsonl"),
    "eval_dataset":               (None,         "{toy}/sft_test.jsonl"),
    "eval_generate_samples":      (0,            500),
    "generate_max_len":           (64,           5),
    "max_len":                    (512,          32),
    "max_epochs":                 (1,            10),
    "micro_train_batch_size":     (8,            64),
    "learning_rate":              (5e-6,         1e-3),
    "lr_warmup_ratio":            (0.03,         0.1),
}


def main():
    # 1. flags (the toy world's defaults without --dataset) and processes
    parser = add_training_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    parser.add_argument("--output_key", default="output")
    parser.add_argument("--multiturn", action="store_true", help="train on every assistant turn of `input`")
    parser.add_argument("--eval_steps", type=common.ranged(int, 1, also=[-1]), default=-1,
                        help="evaluate every N steps (-1: at the end)")
    parser.add_argument("--eval_generate_samples", type=common.ranged(int, 0),
                        help="greedy-generate this many eval prompts and report exact match (not in --pretrain_mode)")
    parser.add_argument("--pretrain_mode", action="store_true", help="plain text, loss on every token")
    parser.add_argument("--aux_loss_coef", type=common.ranged(float, 0, 1e6), default=0.0,
                        help="MoE router load-balancing loss weight")
    parser.add_argument("--generate_max_len", type=common.ranged(int, 1), help="new tokens for eval generation")
    args = common.parse_args(parser, DEFAULTS)
    if args.pretrain_mode and (args.apply_chat_template or args.multiturn):
        common.fail("--pretrain_mode trains on raw text: it does not combine with --apply_chat_template or --multiturn")
    if args.multiturn and not args.apply_chat_template:
        common.fail("--multiturn renders each conversation with the chat template: add --apply_chat_template")
    if args.pretrain_mode:
        args.eval_generate_samples = 0  # no prompt/answer split to compare
    common.init_distributed(args)
    start = time.time()

    # 2. data: records -> (input ids, labels), prompt tokens masked
    tokenizer = common.load_tokenizer(args.pretrain, args)
    keys = [args.input_key] if args.multiturn or args.pretrain_mode else [args.input_key, args.output_key]
    hint = None if args.multiturn else "for chat conversations: --multiturn --apply_chat_template --input_key KEY"
    records = common.load_records(args.dataset, args.dataset_split, keys, args.max_samples, probs=args.dataset_probs,
                                  seed=args.seed, hint=hint, text_keys=keys)
    train = [s for s in (tokenize_sample(r, tokenizer, args) for r in records) if s is not None]
    if len(train) < len(records) and common.is_rank0():
        common.console.print(f"dropped {len(records) - len(train)} samples whose prompt exceeds --max_len "
                             f"{args.max_len}")
    if len(train) < args.train_batch_size:
        common.fail(f"{args.dataset}: {len(train)} usable samples, fewer than --train_batch_size "
                    f"{args.train_batch_size}")
    eval_records = common.load_records(args.eval_dataset, args.eval_split, keys, args.max_eval_samples, hint=hint,
                                       text_keys=keys) if args.eval_dataset else []
    eval_data = [s for s in (tokenize_sample(r, tokenizer, args) for r in eval_records) if s is not None]

    # 3. model and DeepSpeed engine, resumed with --load_checkpoint
    cfg = ds_config(args)
    model = common.load_model(args.pretrain, args, tokenizer, cfg)
    enable_router_loss(model, args.aux_loss_coef)
    total_steps = len(train) // args.train_batch_size * args.max_epochs
    engine = setup_deepspeed(model, args, cfg, total_steps)
    start_step, _ = common.load_checkpoint(engine, args, total_steps)
    logger = common.Logger(args, total_steps, start_step)

    # 4. train: one optimizer step per --train_batch_size samples; log, save, eval
    for step, epoch, micro_batches in train_batches(len(train), args, start_step):
        t0, tokens, losses = time.time(), 0, []
        for idx in micro_batches:
            ids, mask, pos = batch_sequences([train[i][0] for i in idx], tokenizer.pad_token_id, args.packing_samples)
            labels, _, _ = batch_sequences([train[i][1] for i in idx], -100, args.packing_samples)
            hidden, out = common.forward_hidden(engine, dict(
                input_ids=ids.to(engine.device), position_ids=pos.to(engine.device),
                attention_mask=None if mask is None else mask.to(engine.device)))
            loss = sft_loss_chunked(engine, hidden, labels.to(engine.device))
            if args.aux_loss_coef:  # a mixture of experts' router load-balancing loss
                loss = loss + args.aux_loss_coef * out.aux_loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            tokens += sum(len(train[i][0]) for i in idx)
        loss, tokens = common.all_reduce_sum([sum(losses) / len(losses), tokens])
        logger.log(step + 1, {"loss": loss / dist.get_world_size(), "lr": engine.get_lr()[0],
                              "tokens_per_s": tokens / (time.time() - t0), "epoch": epoch})
        if common.due(args.save_steps, step + 1):
            common.save_checkpoint(engine, args, step + 1)
        if eval_data and common.due(args.eval_steps, step + 1, total_steps):
            logger.log(step + 1, evaluate(engine, eval_data, eval_records, tokenizer, args), prefix="eval")

    # 5. the final eval, then save the model and its figures
    results = {"train_time_s": time.time() - start, "steps": total_steps}
    if eval_data:
        metrics = evaluate(engine, eval_data, eval_records, tokenizer, args)
        logger.log(total_steps, metrics, prefix="eval")
        results.update({f"eval_{k}": v for k, v in metrics.items()})
    common.finish(engine, tokenizer, args, results, logger)


if __name__ == "__main__":
    main()
