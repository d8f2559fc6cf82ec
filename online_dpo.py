"""Online DPO: each step samples two completions of every prompt from the current policy, ranks them by a reward
model or function, and takes a DPO step on (higher, lower) against a frozen reference (open-instruct's online DPO,
TRL's OnlineDPOTrainer). The loss and the update are copies of dpo.py's (tests compare them); then the rollout.

    python online_dpo.py --pretrain runs/sft_short --reward_pretrain runs/rm      # toy world, judged by an RM
    deepspeed --num_gpus 8 online_dpo.py --pretrain ckpt/sft --dataset prompts.jsonl --input_key prompt \\
        --apply_chat_template --reward_pretrain ckpt/rm --vllm --zero_stage 3 --bf16 --learning_rate 5e-7

Samples come from HF generate, or vLLM with --vllm / --ray (as in grpo.py and ppo.py); scores from --reward_pretrain
or --remote_rm_url (a /get_reward server or a reward_func file: your own code, run in this process). A tie (equal
scores, or the same completion twice) says nothing and is dropped (counted). The reference is --ref_pretrain, by
default the starting policy; with --lora_rank it is the policy itself with its adapters switched off.

The implementation details, each where it happens: dropout off (common.disable_dropout), a prompt's two samples
prefilled once (rollout.generate_hf), log-probs of the policy itself (temperature 1, not the sampling temperature:
pair_logps), ties dropped (rank_pairs), a step's loss the mean over the pairs it has, every rank running the same
forwards whatever its number of ties (micro_batches, train_on_pairs).
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
import rollout

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
    (rank_pairs drops ties)."""
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


def train_on_pairs(actor, pairs, ref_logps, layout, counts, filler, pad_id, args, epochs, pair_scores):
    """`epochs` passes over the pairs (shuffled after the first), each len(layout) optimizer steps of micro-batches
    (layout: micro_batches'; counts: each optimizer step's pairs on all ranks). A micro-batch's mean loss counts by
    its share of its optimizer step's pairs, so each step's gradient is that of the mean over the pairs it has on
    all ranks (DeepSpeed averages micro-batches and ranks). -> per-pair stats from the first pass (before any of its
    optimizer steps when there is one), with open-instruct's objective/kl and objective/rlhf_reward per sampled
    response (pair_scores: the pairs' scores [P, 2])."""
    gas, world = len(layout[0]), dist.get_world_size()
    stats = {k: [] for k in ("objective/loss", "logps/chosen", "logps/rejected", "rewards/chosen", "rewards/rejected",
                             "rewards/margin", "rewards/accuracy", *(["nll_loss"] if args.nll_loss_coef else []),
                             *(["aux_loss"] if args.aux_loss_coef else []), "objective/kl", "objective/rlhf_reward")}
    for epoch in range(epochs):
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
                # open-instruct's objective per sampled response: the score - beta * KL
                kl = torch.stack([chosen - ref_chosen, rejected - ref_rejected], -1).detach()  # [b, 2]
                stats["objective/kl"] += kl.flatten().tolist()
                stats["objective/rlhf_reward"] += (pair_scores[idx].to(kl) - args.beta * kl).flatten().tolist()
    return stats


# ------------------------------------------------------------------------------------------- rollout
def rank_pairs(batch, scores):
    """A Rollout of two samples per prompt (consecutive) and their scores [2N] -> (prompt, chosen, rejected) pairs,
    chosen the higher score, with their scores [P, 2]; and the ties: prompts whose two samples scored the same or are
    the same completion (no preference: not trained on)."""
    pairs, pair_scores, ties = [], [], []
    samples = batch.pairs()  # (prompt, response)
    for i in range(0, len(samples), 2):
        first, second = (i, i + 1) if scores[i] >= scores[i + 1] else (i + 1, i)
        triple = (samples[i][0], samples[first][1], samples[second][1])
        if scores[i] == scores[i + 1] or torch.equal(samples[i][1], samples[i + 1][1]):
            ties.append(triple)
        else:
            pairs.append(triple)
            pair_scores.append([scores[first].item(), scores[second].item()])
    return pairs, torch.tensor(pair_scores).reshape(-1, 2), ties


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
    a("--learning_rate", type=ranged(float, 0), default=1e-5)  # 0: the run's weights stay as loaded
    a("--lr_warmup_ratio", type=ranged(float, 0, 1), default=0.03)
    a("--lr_scheduler", default="cosine_with_min_lr", help="any transformers scheduler name")
    a("--l2", type=ranged(float, 0), default=0.0, help="AdamW weight decay")
    a("--adam_betas", type=ranged(float, 0, 1, hi_open=True), nargs=2, default=(0.9, 0.95))
    a("--max_norm", type=ranged(float, 0), default=1.0, help="gradient clipping (0: none)")
    a("--seed", type=int, default=42)
    a("--overlap_comm", action="store_true", help="ZeRO: overlap gradient reduction with the backward pass")
    # LoRA / QLoRA (peft)
    a("--lora_rank", type=ranged(int, 0), default=0, help="train LoRA adapters of this rank, not the weights (0: off)")
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
    """The objective's and the reference's flags (dpo.py has a copy)."""
    a = parser.add_argument
    a("--beta", type=common.ranged(float, 0, lo_open=True), default=0.1,
      help="the KL strength: implicit reward = beta * (log pi - log pi_ref)")
    a("--loss_type", default="sigmoid", choices=LOSS_TYPES, help="sigmoid (DPO), ipo or hinge (SLiC)")
    a("--ipo", action="store_true", help="same as --loss_type ipo (OpenRLHF's flag)")
    a("--label_smoothing", type=common.ranged(float, 0, 0.5, hi_open=True), default=0.0,
      help="conservative DPO: the chance a label is wrong (sigmoid)")
    a("--nll_loss_coef", type=common.ranged(float, 0), default=0.0,
      help="weight of an SFT term: the chosen's per-token NLL")
    a("--aux_loss_coef", type=common.ranged(float, 0), default=0.0, help="MoE router load-balancing loss weight")
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
# (common.parse_args; "{toy}" is its directory), calibrated on 2 CPU cores from runs/sft_short (README).
DEFAULTS = {
    "save_path":                  ("runs/online_dpo", "runs/online_dpo"),
    "dataset":                    (None,              "{toy}/prompts_train.jsonl"),
    "eval_dataset":               (None,              "{toy}/prompts_test.jsonl"),
    "label_key":                  (None,              "label"),
    "eval_reward_func":           (None,              rollout.TOY_REWARD),
    "prompt_max_len":             (1024,              16),
    "generate_max_len":           (1024,              8),
    "micro_rollout_batch_size":   (8,                 128),
    "num_episodes":               (1,                 4),
    "micro_train_batch_size":     (8,                 64),
    "learning_rate":              (5e-7,              1e-4),
    "lr_warmup_ratio":            (0.03,              0.05),
}


def parse_args():
    parser = add_training_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    rollout.add_rollout_args(parser, policy_gradient=False)
    add_dpo_args(parser)
    parser.add_argument("--eval_reward_func", help="a reward_func .py file scoring eval completions (logged)")
    args = common.parse_args(parser, DEFAULTS)
    check_dpo_args(args)
    if (args.remote_rm_url is None) == (args.reward_pretrain is None):
        common.fail("online DPO ranks each prompt's two samples by a reward: give exactly one of --reward_pretrain "
                    "or --remote_rm_url (URL or .py file)")
    rollout.check_engine_options(args)
    return args


def main():
    args = parse_args()
    client = rollout.args_client(args)  # before any model loads: a bad reward file stops the run at once
    eval_fn = args.eval_reward_func and rollout.reward_client(args.eval_reward_func)
    _, world = common.init_distributed(args)
    start = time.time()
    tokenizer = common.load_tokenizer(args.pretrain, args)
    pad_id = tokenizer.pad_token_id
    # a step: --rollout_batch_size prompts sampled and scored, then --max_epochs passes of `updates` optimizer steps
    prompts, eval_prompts, total_steps = rollout.load_prompt_sets(args, tokenizer, 1)
    updates = args.rollout_batch_size // args.train_batch_size
    cfg = ds_config(args)
    model = common.load_model(args.pretrain, args, tokenizer, cfg)
    enable_router_loss(model, args.aux_loss_coef)
    common.disable_dropout(model)  # the policy and the reference compared as the same function
    actor = setup_deepspeed(model, args, cfg, total_steps * updates * args.max_epochs)
    reference = load_reference(actor, args, tokenizer, cfg)
    start_step, state = common.load_checkpoint(actor, args)
    reward_fn = rollout.reward_fn(args, tokenizer, cfg, client)
    # HF generate on the policy; --vllm / --ray: vLLM engines fed its weights (and again after every step)
    engine = rollout.start_engine(args, actor.module, tokenizer, start_step)
    next_batch, _ = rollout.batches(prompts, engine, 2, args, state.get("prompt_cursor", 0), total_steps - start_step)

    def evaluate():  # a greedy completion of each eval prompt: the reward's mean, --eval_reward_func's (toy: accuracy)
        actor.module.eval()
        return rollout.evaluate(eval_prompts, engine, rollout.eval_rewards(reward_fn, eval_fn, tokenizer),
                                tokenizer=tokenizer, log_samples=args.log_samples)

    timed = ("generate_s", "reward_s", "ref_s", "train_s", *(("sync_s",) if args.vllm or args.ray else ()),
             "step_s")  # summed for eval_results.json
    logger, results = common.Logger(args, total_steps, start_step, timed), {}
    if eval_prompts:
        common.log_eval(logger, start_step, evaluate(), results, "_before")
    for step in range(start_step, total_steps):
        step_start = time.time()
        # 1. rollout: two samples of each of this rank's prompts from the current policy, scored; chosen = the higher,
        #    ties dropped
        actor.module.eval()
        batch = next_batch()
        t = time.time()
        scores, _, extra_logs = reward_fn(batch)  # [2N]
        scores = rollout.penalize_unfinished(scores, batch.stopped, args.non_stop_penalty)
        pairs, pair_scores, ties = rank_pairs(batch, scores)
        metrics = {"generate_s": batch.generate_s, "reward_s": time.time() - t}
        filler = (pairs + ties)[0]  # what an empty micro-batch runs, with weight 0 (ZeRO-3 runs every forward)
        layout = micro_batches(len(pairs), updates, cfg["gradient_accumulation_steps"])  # [updates][gas] indices
        # the pairs each optimizer step has on all ranks: its loss is their mean
        counts = common.all_reduce_sum([float(sum(map(len, update))) for update in layout])

        # 2. reference log-probs (no gradients), in the update's micro-batches
        t = time.time()
        ref_logps = reference_logps(reference, pairs, layout, filler, pad_id, args.packing_samples)  # [P, 2]
        metrics["ref_s"], t = time.time() - t, time.time()

        # 3. update: --max_epochs passes over the pairs, each `updates` optimizer steps (train_on_pairs)
        actor.module.train()
        stats = train_on_pairs(actor, pairs, ref_logps, layout, counts, filler, pad_id, args, args.max_epochs,
                               pair_scores)
        metrics["train_s"] = time.time() - t

        # 4. weight sync: the rollout engines sample with the updated policy from the next step on
        t = time.time()
        engine.sync(actor.module, version=step + 1)
        if args.vllm or args.ray:  # (HF generate samples from the trained weights themselves: nothing to time)
            metrics["sync_s"] = time.time() - t

        # 5. log (means over all ranks; open-instruct's names), save, eval
        metrics["step_s"] = time.time() - step_start
        stats.update({"objective/non_score_reward": [-args.beta * x for x in stats["objective/kl"]],
                      "objective/entropy": [-x for x in stats["logps/chosen"] + stats["logps/rejected"]]})
        logs = {"objective/scores": scores, "val/sequence_lengths": batch.lengths.tolist(),
                "val/stopped": batch.stopped.float(), **extra_logs, "objective/scores_margin": pair_scores[:, 0] -
                pair_scores[:, 1], "pairs_tied": [float(len(ties))], "pairs_trained": [float(len(pairs))]}
        out = common.all_reduce_means({**logs, **stats, **metrics})
        out["pairs_tied"], out["pairs_trained"] = out["pairs_tied"] * world, out["pairs_trained"] * world  # totals
        out["val/num_stop_token_ids"] = out.pop("val/stopped") * 2 * args.rollout_batch_size
        out["lr"] = actor.get_lr()[0]
        logger.log(step + 1, out)
        if common.due(args.save_steps, step + 1):
            common.save_checkpoint(actor, args, step + 1, extra={"prompt_cursor": batch.cursor})
        if eval_prompts and common.due(args.eval_steps, step + 1, total_steps):
            common.log_eval(logger, step + 1, evaluate())

    results.update(logger.run_times(start))
    common.finish(actor, tokenizer, args, results, logger, evaluate=evaluate if eval_prompts else None)


if __name__ == "__main__":
    main()
