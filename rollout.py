"""Deprecated, and gone in the next release: rollout.py's pieces now live where they are used (issue 51, the card's
trade of reuse for transparency). Each RL script holds its own rollout (prompts, its Rollout, HF generate, the reward
call, evaluation; grpo.py's copies are named here); the rollout correction lives in engines.py. An old name still
works for this release, with a DeprecationWarning naming its new place. What changed at the new places: a reward
call returns a named result {"rewards", "scores", "logs"} (not a tuple; reward_client takes no `parse`); Rollout.of
takes the EOS id second; HFEngine.sample returns plain tensors {"responses", "logprobs", "version"}; evaluate takes
the tokenizer fourth; rollout_logprobs has no `share_prompts`."""
import importlib
import warnings

MOVED = {name: "engines" for name in ("rollout_correction_weights", "engine_gap", "ROLLOUT_CORRECTIONS",
                                      "check_rollout_correction")}
MOVED.update({name: "grpo" for name in ("Rollout", "HFEngine", "generate_hf", "shared_prompt_cache", "load_prompts",
                                        "prompt_batches", "reward_client", "remote_rewards", "check_rewards",
                                        "load_reward_func", "user_module", "rm_scores", "penalize_unfinished",
                                        "rollout_logprobs", "eval_samples", "evaluate", "TOY_REWARD")})


def __getattr__(name):
    if name not in MOVED:
        raise AttributeError(f"module 'rollout' has no attribute {name!r} (rollout.py is a deprecation shim)")
    warnings.warn(f"rollout.{name} is deprecated: use {MOVED[name]}.{name} (rollout.py goes in the next release)",
                  DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(MOVED[name]), name)
