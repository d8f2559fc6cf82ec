"""The real-model GRPO bench's reward (bench/smollm2_grpo.py): 1 when the last integer in the completion is the sum,
else 0, so "17 + 21 = 38" counts as much as "38". Also logged as `accuracy` (the eval's figure)."""
import re


def reward_func(queries, prompts, labels):
    right = []
    for q, p, label in zip(queries, prompts, labels):
        numbers = re.findall(r"-?\d+", q[len(p):].replace("<|im_end|>", ""))
        right.append(float(bool(numbers) and numbers[-1] == str(label)))
    return {"rewards": right, "extra_logs": {"accuracy": right}}
