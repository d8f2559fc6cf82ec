"""The toy world's tool task, as an OpenRLHF agent file (a template for your own environment): the prompt "07+x="
hides its second operand, which only this environment knows (the dataset's label). The action "?" asks for it,
and the environment answers with the plain sum to solve ("\\n07+45="); any other action is an answer, which
ends the episode with reward 1 if it is the sum, else 0. A policy cannot do better than guess without asking.

    python grpo.py --pretrain runs/sft_tool --agent_func_path toy_agent.py \\
        --dataset toy_world/tool_train.jsonl --eval_dataset toy_world/tool_test.jsonl --label_key label

The format is OpenRLHF's (0.11): AgentInstance(AgentInstanceBase) with async reset(states) and step(states), and
AgentExecutor(MultiTurnAgentExecutor) passing it; grpo.py and ppo.py run it with or without OpenRLHF installed.
One AgentInstance per episode. What step() gets: states["observation_text"] (the prompt and every turn so far, as
text), states["action_text"] (the policy's last action, its stop token left out), states["label"]. What it
returns: "rewards" (this step's; an episode's reward is their sum), "environment_feedback" (text appended after
the action, tokenized alone and not trained on), "done", and optionally "scores" (for --dynamic_filtering) and
"extra_logs" (numbers, logged as means: here the tool-call rate and the accuracy).
"""
import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.asked = False

    async def reset(self, states, **kwargs):
        self.a = states["observation"].split("+")[0][-2:]  # "07" of "07+x=" (a chat template may wrap it)
        return {"observation": states["observation"]}  # unchanged: the prompt's own tokens are kept

    async def step(self, states, **kwargs):
        action, b = states["action_text"].strip(), states["label"]
        if action == "?" and not self.asked:  # the tool call: reveal the operand
            self.asked = True
            return {"rewards": torch.tensor(0.0), "scores": torch.tensor(0.0), "environment_feedback":
                    f"\n{self.a}+{b}=", "done": False, "extra_logs": {"asked": 1.0, "accuracy": 0.0}}
        correct = float(action == str(int(self.a) + int(b)))
        return {"rewards": torch.tensor(correct), "scores": torch.tensor(correct), "environment_feedback": "",
                "done": True, "extra_logs": {"asked": float(self.asked), "accuracy": correct}}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
