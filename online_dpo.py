"""Online DPO: each step samples two completions of every prompt from the current policy, ranks them by a reward
model or function, and takes a DPO step on (higher, lower) against a frozen reference (open-instruct's online DPO,
TRL's OnlineDPOTrainer). dpo.py's loss, dpo.py's update; this file is the rollout around them.

    python online_dpo.py --pretrain runs/sft_short --reward_pretrain runs/rm      # toy world, judged by an RM
    deepspeed --num_gpus 8 online_dpo.py --pretrain ckpt/sft --dataset prompts.jsonl --input_key prompt \\
        --apply_chat_template --reward_pretrain ckpt/rm --vllm --zero_stage 3 --bf16 --learning_rate 5e-7

Samples come from HF generate, or vLLM with --vllm / --ray (as in grpo.py and ppo.py); scores from --reward_pretrain
or --remote_rm_url (a /get_reward server or a reward_func file: your own code, run in this process). A tie (equal
scores, or the same completion twice) says nothing and is dropped (counted). The reference is --ref_pretrain, by
default the starting policy; with --lora_rank it is the policy itself with its adapters switched off.

The implementation details, each where it happens: dropout off (common.disable_dropout), a prompt's two samples
prefilled once (rollout.generate_hf), log-probs of the policy itself (temperature 1, not the sampling temperature:
dpo.pair_logps), ties dropped (rank_pairs), a step's loss the mean over the pairs it has, every rank running the
same forwards whatever its number of ties (dpo.micro_batches, dpo.train_on_pairs).
"""

import argparse
import time

import torch

import common
import dpo
import rollout


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
    parser = common.add_common_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    rollout.add_rollout_args(parser, policy_gradient=False)
    dpo.add_dpo_args(parser)
    parser.add_argument("--eval_reward_func", help="a reward_func .py file scoring eval completions (logged)")
    args = common.parse_args(parser, DEFAULTS)
    dpo.check_dpo_args(args)
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
    cfg = common.ds_config(args)
    model = common.load_model(args.pretrain, args, tokenizer, cfg)
    common.enable_router_loss(model, args.aux_loss_coef)
    common.disable_dropout(model)  # the policy and the reference compared as the same function
    actor = common.setup_deepspeed(model, args, cfg, total_steps * updates * args.max_epochs)
    reference = dpo.load_reference(actor, args, tokenizer, cfg)
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
        layout = dpo.micro_batches(len(pairs), updates, cfg["gradient_accumulation_steps"])  # [updates][gas] indices
        # the pairs each optimizer step has on all ranks: its loss is their mean
        counts = common.all_reduce_sum([float(sum(map(len, update))) for update in layout])

        # 2. reference log-probs (no gradients), in the update's micro-batches
        t = time.time()
        ref_logps = dpo.reference_logps(reference, pairs, layout, filler, pad_id, args.packing_samples)  # [P, 2]
        metrics["ref_s"], t = time.time() - t, time.time()

        # 3. update: --max_epochs passes over the pairs, each `updates` optimizer steps (dpo.train_on_pairs)
        actor.module.train()
        stats = dpo.train_on_pairs(actor, pairs, ref_logps, layout, counts, filler, pad_id, args, args.max_epochs,
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
