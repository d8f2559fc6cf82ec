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

import common


def sft_loss(logits, labels):
    """Mean next-token cross-entropy over the tokens we train on.

    logits [B, T, V]; labels [B, T] hold the token id where the loss applies (the response) and -100
    elsewhere (prompt, padding). Position t predicts token t+1, hence the shift. In a packed row the
    shift crosses sequence boundaries, which is harmless: every sequence starts with a -100 label.
    """
    logits, targets = logits[:, :-1], labels[:, 1:]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 logits: CE in fp32
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100)


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


@torch.no_grad()
def evaluate(engine, data, records, tokenizer, args):
    """Eval loss (token mean), and exact match of greedy answers on the first --eval_generate_samples."""
    model = engine.module
    model.eval()
    loss_sum, tokens = 0.0, 0
    for batch, real in common.eval_shard(data, args.micro_train_batch_size):
        # a filler runs the forward, as ZeRO-3 needs every rank, but has no label to count
        labels = [y if keep else torch.full_like(y, -100) for (_, y), keep in zip(batch, real)]
        ids, mask, pos = common.batch_sequences([x for x, _ in batch], tokenizer.pad_token_id, False)
        labels, _, _ = common.batch_sequences(labels, -100, False)
        logits = model(input_ids=ids.to(engine.device), attention_mask=mask.to(engine.device),
                       position_ids=pos.to(engine.device), use_cache=False).logits
        n = (labels[:, 1:] != -100).sum().item()
        loss_sum += sft_loss(logits, labels.to(engine.device)).item() * n if n else 0.0
        tokens += n
    correct, total = 0, 0
    for batch, real in common.eval_shard(records[:max(args.eval_generate_samples, 0)], args.micro_train_batch_size):
        prompts = [tokenizer(common.format_prompt(r[args.input_key], tokenizer, args),
                             add_special_tokens=not args.apply_chat_template)["input_ids"] for r in batch]
        answers = common.greedy_generate(model, prompts, tokenizer, args.generate_max_len,
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
    parser = common.add_common_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    parser.add_argument("--output_key", default="output")
    parser.add_argument("--multiturn", action="store_true", help="train on every assistant turn of `input`")
    parser.add_argument("--eval_steps", type=common.ranged(int, 1, also=[-1]), default=-1,
                        help="evaluate every N steps (-1: at the end)")
    parser.add_argument("--eval_generate_samples", type=common.ranged(int, 0),
                        help="greedy-generate this many eval prompts and report exact match (not in --pretrain_mode)")
    parser.add_argument("--pretrain_mode", action="store_true", help="plain text, loss on every token")
    parser.add_argument("--aux_loss_coef", type=common.ranged(float, 0), default=0.0,
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

    tokenizer = common.load_tokenizer(args.pretrain, args)
    keys = [args.input_key] if args.multiturn or args.pretrain_mode else [args.input_key, args.output_key]
    hint = None if args.multiturn else "for chat conversations: --multiturn --apply_chat_template --input_key KEY"
    records = common.load_records(args.dataset, args.dataset_split, keys, args.max_samples, probs=args.dataset_probs,
                                  seed=args.seed, hint=hint)
    train = [s for s in (tokenize_sample(r, tokenizer, args) for r in records) if s is not None]
    if len(train) < len(records) and common.is_rank0():
        common.console.print(f"dropped {len(records) - len(train)} samples whose prompt exceeds --max_len "
                             f"{args.max_len}")
    if len(train) < args.train_batch_size:
        common.fail(f"{args.dataset}: {len(train)} usable samples, fewer than --train_batch_size "
                    f"{args.train_batch_size}")
    eval_records = common.load_records(args.eval_dataset, args.eval_split, keys, hint=hint) if args.eval_dataset else []
    eval_data = [s for s in (tokenize_sample(r, tokenizer, args) for r in eval_records) if s is not None]

    cfg = common.ds_config(args)
    model = common.load_model(args.pretrain, args, tokenizer, cfg)
    common.enable_router_loss(model, args.aux_loss_coef)
    total_steps = len(train) // args.train_batch_size * args.max_epochs
    engine = common.setup_deepspeed(model, args, cfg, total_steps)
    start_step, _ = common.load_checkpoint(engine, args)
    logger = common.Logger(args, total_steps, start_step)

    for step, epoch, micro_batches in common.train_batches(len(train), args, start_step):
        t0, tokens, losses = time.time(), 0, []
        for idx in micro_batches:
            ids, mask, pos = common.batch_sequences([train[i][0] for i in idx], tokenizer.pad_token_id,
                                                    args.packing_samples)
            labels, _, _ = common.batch_sequences([train[i][1] for i in idx], -100, args.packing_samples)
            out = engine(input_ids=ids.to(engine.device), position_ids=pos.to(engine.device),
                         attention_mask=None if mask is None else mask.to(engine.device),
                         use_cache=False)  # use_cache=False keeps packed rows apart
            loss = sft_loss(out.logits, labels.to(engine.device))
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

    results = {"train_time_s": time.time() - start, "steps": total_steps}
    if eval_data:
        metrics = evaluate(engine, eval_data, eval_records, tokenizer, args)
        logger.log(total_steps, metrics, prefix="eval")
        results.update({f"eval_{k}": v for k, v in metrics.items()})
    common.finish(engine, tokenizer, args, results, logger)


if __name__ == "__main__":
    main()
