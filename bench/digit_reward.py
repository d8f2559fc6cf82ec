"""The GRPO bench reward (ours; bench/trl_runner.py has TRL's twin): the share of digits in a completion,
which varies even for a random-init model, so the advantages are not all zero."""


def reward_func(queries, prompts, labels):
    return [sum(c.isdigit() for c in q[len(p):]) / max(len(q) - len(p), 1) for q, p in zip(queries, prompts)]
