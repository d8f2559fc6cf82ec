"""PPO with a critic, the classic RLHF recipe: sample, score with a reward model, penalise drift from the
starting policy token by token, estimate advantages with GAE from a learned value function, and update
actor and critic with clipped losses.

    python ppo.py --pretrain runs/sft_short --reward_pretrain runs/rm        # toy world
    python ppo.py --pretrain runs/sft_short --reward_pretrain runs/rm --vllm # rollouts from in-process vLLM
    deepspeed --num_gpus 8 ppo.py --pretrain ckpt/sft --reward_pretrain ckpt/rm --dataset prompts.jsonl \\
        --input_key prompt --apply_chat_template --zero_stage 3 --bf16 --vllm --normalize_reward \\
        --actor_learning_rate 5e-7 --critic_learning_rate 9e-6 --init_kl_coef 0.01 --generate_max_len 1024

Plain `deepspeed`/`torchrun`/`python`: every process holds actor, critic, reference and reward model
(colocated) and generates its own share of the rollout, with HF generate or an in-process vLLM engine
(--vllm). With --ray, generation moves to --vllm_num_engines vLLM engines running as Ray actors (other
GPUs or nodes); trainer rank 0 broadcasts the new weights to them after every update. Rewards:
--reward_pretrain (a sequence-classification RM, e.g. rm.py's output, read at EOS) or --remote_rm_url (an
http(s) /get_reward URL or a reward_func.py file: your own code; the contract is rollout.reward_client's).
--eval_reward_func scores the eval completions with a second, rule-based function (the toy task's
correctness) beside the training reward. With --process_rewards each reasoning step's score (a prm.py model's, or
step_rewards from the reward file or server; process_rewards.py) is a reward on the token that ends the step, as in
Math-Shepherd's step-by-step PPO.

The implementation details of open-instruct / "The N+ Implementation Details of RLHF", each where it
happens: dropout off (common.disable_dropout), prompts left-padded for generation (rollout.generate_hf), the
response ends at its EOS (rollout.generate_hf, engines.vllm_sampling), a fixed reward for completions without
EOS (score, --non_stop_penalty), the critic's value head initialised small when it starts from a causal LM
(init_value_head), the reward read at EOS and the KL penalty on every response token (kl_penalized_rewards),
advantages whitened.
"""

import argparse
import math
import time

import torch
import torch.distributed as dist
from torch.nn.utils.rnn import pad_sequence
from transformers import AutoConfig, AutoModelForSequenceClassification, get_scheduler

import common
import deepspeed  # after common, which names DeepSpeed's accelerator first (else it guesses, with a warning)
import rollout

# ------------------------------------------------------------------------------------------------ math
def kl_penalized_rewards(scores, kl, action_mask, kl_coef):
    """Per-token rewards [B, T]: -kl_coef * kl on every response token (0 on padding), plus each row's
    scalar score [B] at its last response token. Rows may be padded on either side."""
    mask = action_mask.to(kl.dtype)
    rewards = -kl_coef * kl * mask
    last = mask.size(1) - 1 - mask.flip(-1).argmax(-1)  # the last 1 of each row
    return rewards.scatter_add(1, last[:, None], scores[:, None].to(rewards.dtype))


def compute_gae(rewards, values, action_mask, gamma, lam, skip=None):
    """Generalised advantage estimation over the response tokens, right to left:
        delta_t = r_t + gamma * V_{t+1} - V_t,   A_t = delta_t + gamma * lam * A_{t+1}
    with V and A beyond a sequence's last token = 0; returns = A + V; 0 on padding. A position outside the
    mask ends a sequence, so a packed row (responses separated by masked prompt tokens) works too; except where
    `skip` [B, T] is set (an agent's environment tokens inside an episode): those are stepped over, so t + 1 above
    is the next action token, as if the feedback were not there (neither ending the episode nor decayed over)."""
    mask = action_mask.to(values.dtype)
    skip = torch.zeros_like(action_mask, dtype=torch.bool) if skip is None else skip.bool()
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.size(1))):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantages[:, t] = (delta + gamma * lam * next_advantage) * mask[:, t]
        next_advantage = torch.where(skip[:, t], next_advantage, advantages[:, t])
        next_value = torch.where(skip[:, t], next_value, values[:, t] * mask[:, t])
    return advantages, (advantages + values) * mask


def policy_loss(logprobs, old_logprobs, advantages, action_mask, eps_clip=0.2, dual_clip=None, *,
                rollout_logprobs=None, rollout_correction=None, rollout_correction_bounds=(0.0, 2.0)):
    """Clipped surrogate, mean over response tokens: -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A),
    ratio = exp(logprobs - old_logprobs), capped at -dual_clip * A where A < 0 (dual clip); with
    rollout_correction each token's loss times rollout_correction_weights (the engine sampled, not pi_old)."""
    ratio = torch.exp(logprobs - old_logprobs)
    loss = -torch.min(ratio * advantages, ratio.clamp(1 - eps_clip, 1 + eps_clip) * advantages)
    if dual_clip is not None:
        loss = torch.where(advantages < 0, torch.min(loss, -dual_clip * advantages), loss)
    if rollout_correction is not None:
        if rollout_logprobs is None:
            raise ValueError("rollout_correction needs rollout_logprobs")
        weights, _ = rollout.rollout_correction_weights(old_logprobs, rollout_logprobs, action_mask,
                                                        rollout_correction, rollout_correction_bounds)
        loss = loss * weights
    return common.masked_mean(torch.where(action_mask.bool(), loss, 0.0), action_mask)


def value_loss(values, old_values, returns, action_mask, value_clip=0.2):
    """0.5 * mean over response tokens of max((v_clipped - R)^2, (v - R)^2), where v_clipped moves at
    most value_clip from the rollout's value (value_clip None: plain squared error)."""
    loss = (values - returns) ** 2
    if value_clip is not None:
        clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
        loss = torch.max(loss, (clipped - returns) ** 2)
    return 0.5 * common.masked_mean(torch.where(action_mask.bool(), loss, 0.0), action_mask)


def adaptive_kl_coef(kl_coef, kl, target, horizon, n_samples):
    """Ziegler et al.'s controller: nudge the coefficient so the measured KL drifts toward the target."""
    error = min(max(kl / target - 1, -0.2), 0.2)
    return kl_coef * (1 + error * n_samples / horizon)


# ------------------------------------------------------------------------------------------- rollout
def score(batch, reward_fn, args):
    """Each completion's score [N] (--non_stop_penalty for one cut at --generate_max_len, then clipped to
    --reward_clip_range) and the reward's extra logs."""
    scores, _, extra_logs = reward_fn(batch)
    scores = rollout.penalize_unfinished(scores, batch.stopped, args.non_stop_penalty)
    return scores.clamp(*args.reward_clip_range), extra_logs


# --------------------------------------------------------------------------------------------- critic
def critic_values(critic, batch, pad_id, packing):
    """The value head, visible: the classifier's `score` layer applied at every position (not just the
    last, as a reward model reads it), taken where the state before each response token ends. batch:
    (prompt, response) pairs. -> [B, R]."""
    inputs, where = common.response_inputs(critic, batch, pad_id, packing)  # padded or packed
    hidden = getattr(critic, critic.base_model_prefix)(**inputs).last_hidden_state
    values = critic.score(hidden).squeeze(-1).float()[where]  # [sum R]
    return pad_sequence(values.split([len(r) for _, r in batch]), batch_first=True)


def rollout_values(critic, batch, pad_id, packing, chunk_size):
    """critic_values of a whole rollout (no gradients), in chunks of `chunk_size`: [N, R] on the CPU."""
    return rollout.per_token(lambda chunk: critic_values(critic, chunk, pad_id, packing), batch, chunk_size)


def critic_step(critic, pairs, old_values, returns, action_mask, pad_id, packing, value_clip):
    """One value-loss step of the critic on a micro-batch (pairs, and its rows of the rollout's values, returns and
    action mask [b, R]) -> (the loss, the fraction of values clipped)."""
    new_values = critic_values(critic, pairs, pad_id, packing)  # [b, T]
    T, device = new_values.size(1), new_values.device
    mask, old = action_mask[:, :T].to(device), old_values[:, :T].to(device)
    loss = value_loss(new_values, old, returns[:, :T].to(device), mask, value_clip)
    critic.backward(loss)
    critic.step()
    return loss.item(), common.masked_mean(((new_values.detach() - old).abs() > value_clip).float(), mask).item()


def init_value_head(critic, path, args):
    """A critic started from a causal LM has a fresh `score` layer: small init, std 1/sqrt(H+1), so
    the first values are near 0. One started from a reward model keeps its trained head."""
    config = AutoConfig.from_pretrained(path, trust_remote_code=args.trust_remote_code)
    if not any(a.endswith("ForSequenceClassification") for a in config.architectures or []):
        with deepspeed.zero.GatheredParameters([critic.score.weight], modifier_rank=0, enabled=args.zero_stage == 3):
            torch.nn.init.normal_(critic.score.weight, std=1 / math.sqrt(critic.config.hidden_size + 1))


def load_critic(path, args, tokenizer, cfg, num_training_steps):
    """The critic: a sequence classifier (one output) from `path` with dropout off and init_value_head, wrapped by
    DeepSpeed with its own optimizer at --critic_learning_rate."""
    model = common.load_model(path, args, tokenizer, cfg, model_class=AutoModelForSequenceClassification,
                              num_labels=1)
    common.disable_dropout(model)
    init_value_head(model, path, args)
    return setup_deepspeed(model, args, cfg, num_training_steps, learning_rate=args.critic_learning_rate,
                           name="critic")


# ----------------------------------------------------------------------------------- model and DeepSpeed
def enable_router_loss(model, coef):
    """--aux_loss_coef: a mixture-of-experts model then returns its router load-balancing loss (aux_loss)."""
    if not coef:
        return
    if not hasattr(model.config, "output_router_logits"):
        common.fail(f"--aux_loss_coef: {model.config.model_type} is not a mixture-of-experts model (no router loss)")
    model.config.output_router_logits = True


def ds_config(args):
    """DeepSpeed's config from the flags: batch sizes and accumulation, clipping, ZeRO, bf16. A copy in each training
    script (tests compare them)."""
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


def setup_deepspeed(model, args, config, num_training_steps, learning_rate=None, name=None):
    """AdamW (torch's fused kernel, CPU or GPU: no op to compile, and one pass over the states instead of one
    per operation) at `learning_rate` (default --learning_rate) + warm-up/decay schedule, wrapped by a DeepSpeed
    engine. `name` labels the line that says what it trains (the actor, the critic)."""
    params = [p for p in model.parameters() if p.requires_grad]
    lr = args.learning_rate if learning_rate is None else learning_rate
    if args.adam_offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        optimizer = DeepSpeedCPUAdam(params, lr=lr, betas=args.adam_betas, weight_decay=args.l2)
    else:
        optimizer = torch.optim.AdamW(params, lr=lr, betas=args.adam_betas, weight_decay=args.l2, fused=True)
    scheduler = get_scheduler(
        args.lr_scheduler, optimizer, num_warmup_steps=int(args.lr_warmup_ratio * num_training_steps),
        num_training_steps=num_training_steps,
        scheduler_specific_kwargs={"min_lr_rate": 0.1} if args.lr_scheduler == "cosine_with_min_lr" else None,
    )
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    if dist.get_world_size() == 1 and args.zero_stage == 0 and not args.bf16:
        engine.enable_backward_allreduce = False  # one process: nothing to average; skips flattening every gradient
    if common.is_rank0():  # what --lora_rank leaves to train (a ZeRO-3 partition reports its full size as ds_numel)
        sizes = [(getattr(p, "ds_numel", p.numel()), p.requires_grad) for p in model.parameters()]
        trained, total = sum(size for size, grad in sizes if grad), sum(size for size, _ in sizes)
        common.console.print(f"{name + ': ' if name else ''}training {trained:,} of {total:,} parameters "
                             f"({100 * trained / total:.2f}%)")
    return engine


# ------------------------------------------------------------------------------------------------- flags
# The defaults, {flag: (a real run's, the toy world's)}: the toy world's apply when no --dataset is given
# (common.parse_args; "{toy}" is its directory), calibrated on 2 CPU cores from runs/sft_short and
# runs/rm with --normalize_reward (README).
DEFAULTS = {
    "save_path":                  ("runs/ppo",   "runs/ppo"),
    "dataset":                    (None,         "{toy}/prompts_train.jsonl"),
    "eval_dataset":               (None,         "{toy}/prompts_test.jsonl"),
    "label_key":                  (None,         "label"),
    "eval_reward_func":           (None,         rollout.TOY_REWARD),
    "prompt_max_len":             (1024,         16),
    "generate_max_len":           (1024,         8),
    "micro_rollout_batch_size":   (8,            64),
    "micro_train_batch_size":     (16,           64),
    "learning_rate":              (1e-6,         1e-5),
    "critic_learning_rate":       (9e-6,         1e-4),
    "lr_warmup_ratio":            (0.03,         0.05),
    "eval_steps":                 (-1,           25),
}


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


def parse_args():
    parser = add_training_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    rollout.add_rollout_args(parser)
    a = parser.add_argument
    # models and rewards
    a("--critic_pretrain", default=None, help="critic start (default: the reward model, else the actor)")
    a("--eval_reward_func", help="a reward_func .py file scoring eval completions only (logged)")
    a("--normalize_reward", action="store_true", help="(r - mean) / std with the RM config's mean and std")
    a("--reward_clip_range", type=common.ranged(float), nargs=2, default=(-10.0, 10.0), metavar=("LO", "HI"))
    a("--ref_reward_offload", action="store_true", help="keep the frozen models on the CPU between uses")
    # objective
    a("--init_kl_coef", type=common.ranged(float, 0), default=0.01,
      help="KL penalty per token in the reward (0: no reference)")
    a("--kl_estimator", default="k1", choices=("k1", "k2", "k3"))
    a("--kl_target", type=common.ranged(float, 0, lo_open=True), default=None,
      help="adaptive KL: the KL per sequence to steer toward")
    a("--kl_horizon", type=common.ranged(int, 1), default=10000,
      help="adaptive KL: samples over which the coefficient adapts")
    a("--gamma", type=common.ranged(float, 0, 1), default=1.0)
    a("--lambd", type=common.ranged(float, 0, 1), default=0.95, help="GAE lambda")
    a("--no_advantage_std_norm", action="store_true", help="center advantages without dividing by their std")
    a("--eps_clip", type=common.ranged(float, 0), default=0.2)
    a("--dual_clip", type=common.ranged(float, 1, lo_open=True), default=None,
      help="cap the loss of negative advantages at dual_clip * |A| (> 1)")
    a("--value_clip", type=common.ranged(float, 0), default=0.2)
    a("--entropy_loss_coef", type=common.ranged(float, 0), default=0.0, help="entropy bonus (0: off)")
    a("--aux_loss_coef", type=common.ranged(float, 0), default=0.0,
      help="MoE router load-balancing loss weight (actor)")
    a("--actor_learning_rate", dest="learning_rate", type=common.ranged(float, 0), help="same as --learning_rate")
    a("--critic_learning_rate", type=common.ranged(float, 0))
    a("--freezing_actor_steps", type=common.ranged(int, 0, also=[-1]), default=0,
      help="train only the critic for the first N steps (0, or OpenRLHF's -1: none)")
    a("--save_value_network", action="store_true", help="also save the critic, to <save_path>_critic")
    args = common.parse_args(parser, DEFAULTS)
    if args.agent_func_path and args.eval_reward_func == rollout.TOY_REWARD:
        args.eval_reward_func = None  # the agent scores its eval episodes
    rollout.check_one_reward(args)
    if args.normalize_reward and not args.reward_pretrain:
        common.fail("--normalize_reward reads mean/std from the reward model's config: it needs --reward_pretrain")
    rollout.check_rl_options(args)
    return args


def main():
    args = parse_args()
    client = rollout.args_client(args)  # before any model loads: a bad reward file stops the run at once
    eval_fn = args.eval_reward_func and rollout.reward_client(args.eval_reward_func)
    common.init_distributed(args)
    start = time.time()
    tokenizer = common.load_tokenizer(args.pretrain, args)
    pad_id, n = tokenizer.pad_token_id, args.n_samples_per_prompt
    prompts, eval_prompts, total_steps = rollout.load_prompt_sets(args, tokenizer, n)
    samples_per_step = args.rollout_batch_size * n
    updates = samples_per_step // args.train_batch_size * args.max_epochs * total_steps
    cfg = ds_config(args)
    model = common.load_model(args.pretrain, args, tokenizer, cfg)
    enable_router_loss(model, args.aux_loss_coef)
    common.disable_dropout(model)
    actor = setup_deepspeed(model, args, cfg, updates, name="actor")
    critic = load_critic(args.critic_pretrain or args.reward_pretrain or args.pretrain, args, tokenizer, cfg, updates)
    offload = args.ref_reward_offload  # whole frozen models on the CPU (partitions under ZeRO-3), moved for each use
    ref = common.load_frozen(args.pretrain, args, tokenizer, cfg, offload) if args.init_kl_coef > 0 else None
    reward_fn = rollout.reward_fn(args, tokenizer, cfg, client, offload, args.normalize_reward)
    start_step, state = common.load_checkpoint(actor, args, others={"critic": critic})
    kl_coef = state.get("kl_coef", args.init_kl_coef)
    # HF generate on the actor; --vllm / --ray: vLLM engines fed the actor's weights (and again after every update).
    # A version counts the actor updates in the weights (none while --freezing_actor_steps train the critic).
    critic_only_steps = max(args.freezing_actor_steps, 0)  # (OpenRLHF's -1: none)
    actor_version = lambda step: max(step - critic_only_steps, 0)  # noqa: E731  (at the step's start)
    engine = rollout.start_engine(args, actor.module, tokenizer, actor_version(start_step))
    # --async_steps N: the next batches are sampled on the Ray engines while this process trains, on weights at most
    # N updates old (the rollout correction covers that too)
    next_batch, release = rollout.batches(prompts, engine, n, args, state.get("prompt_cursor", 0),
                                          total_steps - start_step)

    def evaluate():  # the training reward's mean, --eval_reward_func's mean and extra logs (toy: accuracy), pass@n
        actor.module.eval()
        return rollout.evaluate(eval_prompts, engine, rollout.eval_rewards(reward_fn, eval_fn, tokenizer),
                                args.eval_n_samples_per_prompt, args.eval_temperature,
                                pass_key="rule_reward" if eval_fn else "reward", tokenizer=tokenizer,
                                log_samples=args.log_samples)

    timed = ("generate_s", "wait_s", "forward_s", "train_s", *(("sync_s",) if args.vllm or args.ray else ()),
             "step_s")  # summed for eval_results.json
    logger, results = common.Logger(args, total_steps, start_step, timed), {}
    if eval_prompts:
        common.log_eval(logger, start_step, evaluate(), results, "_before")
    for step in range(start_step, total_steps):
        step_start = time.time()
        # 1. rollout: sample, score, and what the update starts from: log-probs, values, the reference's KL
        actor.module.eval()
        critic.module.eval()
        t = time.time()
        batch = next_batch()
        metrics = {"generate_s": batch.generate_s, "wait_s": time.time() - t}  # generating, waiting for it
        t = time.time()
        scores, extra_logs = score(batch, reward_fn, args)  # [N]
        action_mask = batch.action_mask  # [N, R]: 0 on padding and on an agent's environment tokens
        old_logprobs = rollout.rollout_logprobs(actor.module, batch, pad_id, args.packing_samples, args.temperature,
                                                args.micro_rollout_batch_size, share_prompts=False)  # [N, R]
        values = rollout_values(critic.module, batch, pad_id, args.packing_samples, args.micro_rollout_batch_size)
        kl = torch.zeros(action_mask.shape)  # [N, R]
        if ref is not None:
            with common.on_accelerator(ref, offload and args.zero_stage != 3) as model:
                ref_logprobs = rollout.rollout_logprobs(model, batch, pad_id, args.packing_samples, args.temperature,
                                                        args.micro_rollout_batch_size, share_prompts=False)
            kl = common.approx_kl(old_logprobs, ref_logprobs, args.kl_estimator) * action_mask

        # 2. per-token rewards (score at EOS, KL penalty on every token; --process_rewards: each step's score on the
        #    token that ends it, and the outcome score only when a rule or server gives it beside the PRM), GAE,
        #    whitened advantages
        outcome = not args.process_rewards or args.remote_rm_url and args.reward_pretrain
        rewards = kl_penalized_rewards(scores if outcome else torch.zeros_like(scores), kl, action_mask, kl_coef)
        if args.process_rewards:
            rewards = rewards + batch.step_rewards[0]  # [N, R]
        environment = batch.response_mask & ~action_mask  # an agent's feedback tokens: GAE steps over them
        advantages, returns = compute_gae(rewards, values, action_mask, args.gamma, args.lambd, skip=environment)
        advantages = common.masked_whiten(advantages, action_mask, across_ranks=True,
                                          std_norm=not args.no_advantage_std_norm)
        engine_stats = {} if batch.logprobs is None else rollout.engine_gap(  # per response token
            batch.logprobs, old_logprobs, action_mask, args.rollout_correction, args.rollout_correction_bounds)
        metrics["forward_s"] = time.time() - t

        # 3. update: --max_epochs passes over shuffled micro-batches (index slices, each cut to its own longest
        #    response); each engine steps its optimizer every train_batch_size samples (accumulation over
        #    micro-batches and ranks)
        t = time.time()
        train_actor = step >= critic_only_steps
        actor.module.train()
        critic.module.train()
        stats = {k: [] for k in ("policy_loss", "clip_frac", "entropy", "value_loss", "value_clip_frac")}
        for _ in range(args.max_epochs):
            for mb in torch.randperm(len(batch.records)).split(args.micro_train_batch_size):
                pairs = batch.pairs(mb)
                if train_actor:
                    # the entropy is logged; its graph is kept only when it is in the loss
                    logprobs, entropy, aux_loss = common.response_logprobs(
                        actor, pairs, pad_id, args.packing_samples, args.temperature, with_entropy=True,
                        entropy_grad=bool(args.entropy_loss_coef), share_prompts=False)  # [b, T]
                    T, device = logprobs.size(1), logprobs.device
                    mask, old = action_mask[mb, :T].to(device), old_logprobs[mb, :T].to(device)
                    engine_lp = batch.logprobs[mb, :T].to(device) if batch.logprobs is not None else None
                    loss = policy_loss(logprobs, old, advantages[mb, :T].to(device), mask, args.eps_clip,
                                       args.dual_clip, rollout_logprobs=engine_lp,
                                       rollout_correction=args.rollout_correction,
                                       rollout_correction_bounds=args.rollout_correction_bounds)
                    if args.entropy_loss_coef:
                        loss = loss - args.entropy_loss_coef * common.masked_mean(entropy, mask)
                    if args.aux_loss_coef:  # a mixture of experts' router load-balancing loss
                        loss = loss + args.aux_loss_coef * aux_loss
                    actor.backward(loss)
                    actor.step()
                    ratio = torch.exp(logprobs.detach() - old)
                    stats["policy_loss"].append(loss.item())
                    stats["clip_frac"].append(common.masked_mean(((ratio - 1).abs() > args.eps_clip).float(),
                                                                 mask).item())
                    stats["entropy"].append(common.masked_mean(entropy.detach(), mask).item())
                loss, clip_frac = critic_step(critic, pairs, values[mb], returns[mb], action_mask[mb], pad_id,
                                              args.packing_samples, args.value_clip)
                stats["value_loss"].append(loss)
                stats["value_clip_frac"].append(clip_frac)
        metrics["train_s"] = time.time() - t

        # 4. weight sync: the rollout engines generate with the updated actor from the next step on
        t = time.time()
        if train_actor:
            engine.sync(actor.module, version=actor_version(step + 1))
        release()  # --async_steps: the batch sampled from here on may use these weights
        if args.vllm or args.ray:  # (HF generate samples from the trained weights themselves: nothing to time)
            metrics["sync_s"] = time.time() - t

        # 5. log (means over all ranks), adaptive KL, save, eval
        metrics["step_s"] = time.time() - step_start  # rollout (or waiting for it), update, sync
        lengths = action_mask.sum(-1).tolist()
        out = common.all_reduce_means(
            {"reward": scores, **extra_logs, "kl": [kl[i, :length].sum().item() for i, length in enumerate(lengths)],
             "response_len": lengths, "stopped": batch.stopped.float(), **stats, **engine_stats, **metrics},
            stds={"reward": scores, "returns": returns[action_mask], "return_error": (returns - values)[action_mask]})
        error_var, returns_var = out.pop("return_error_std") ** 2, out.pop("returns_std") ** 2
        out.update(explained_var=1 - error_var / max(returns_var, 1e-8), kl_coef=kl_coef,
                   actor_lr=actor.get_lr()[0], critic_lr=critic.get_lr()[0])
        out.update(rollout.lag_and_turns(batch, actor_version(step), extra_logs, args.async_steps,
                                         args.agent_func_path))
        logger.log(step + 1, out)
        if not eval_prompts and (step == start_step or common.due(args.logging_steps, step + 1)):  # nothing else shows
            logger.log_samples(step + 1, rollout.eval_samples(batch, {"reward": scores}, tokenizer, args.log_samples),
                               prefix="train")  # what the policy writes
        if args.kl_target is not None:
            kl_coef = adaptive_kl_coef(kl_coef, out["kl"], args.kl_target, args.kl_horizon, samples_per_step)
        if common.due(args.save_steps, step + 1):
            # the stream's position after the batch trained on, not after those --async_steps sampled ahead
            common.save_checkpoint(actor, args, step + 1, others={"critic": critic},
                                   extra={"prompt_cursor": batch.cursor, "kl_coef": kl_coef})
        if eval_prompts and common.due(args.eval_steps, step + 1, total_steps):
            common.log_eval(logger, step + 1, evaluate())

    results.update(logger.run_times(start))
    if args.save_value_network:
        common.save_hf_model(critic, tokenizer, args.save_path.rstrip("/") + "_critic", args)
    common.finish(actor, tokenizer, args, results, logger, evaluate=evaluate if eval_prompts else None)


if __name__ == "__main__":
    main()
