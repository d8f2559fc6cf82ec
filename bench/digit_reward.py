"""The GRPO bench reward (ours; bench/trl_runner.py has TRL's twin): the share of digits in a completion,
which varies even for a random-init model, so the advantages are not all zero. Queries carry the toy
tokenizer's special tokens (the EOS that ended a completion): read without them, as TRL's completions are."""
import re

from toy import SPECIALS  # the bench's tokenizer is the toy's; grpo.py's directory is on the path


def reward_func(queries, prompts, labels):
    completions = [re.sub("|".join(map(re.escape, SPECIALS)), "", q[len(p):]) for q, p in zip(queries, prompts)]
    return [sum(c.isdigit() for c in x) / max(len(x), 1) for x in completions]
