"""What --agent_func_path turns on: multi-turn episodes with an OpenRLHF agent file (AgentInstance / AgentExecutor:
YOUR code, run in the training process), token in, token out, on whichever engine samples (HF generate, vLLM, Ray),
returning plain tensors as every engine does (AgentEngine.sample), plus an action mask (0 on the environment's tokens)
and the agent's rewards. grpo.py and ppo.py import it on the lines that handle the flag; importing it only defines
things."""

import asyncio
import contextlib
import functools
import inspect
import sys
import threading
import time
import traceback
import types
from dataclasses import dataclass, field
from pathlib import Path

import torch

import common
from common import console, fail


class AgentInstanceBase:
    """OpenRLHF's agent base classes (openrlhf.utils.agent, 0.11), which an agent file imports; installed under that
    name where OpenRLHF is not (openrlhf_agent_module). One instance per episode: reset(states) -> {"observation"},
    step(states) -> {"rewards", "environment_feedback", "done", ...}; async or plain methods."""

    def __init__(self, *args, **kwargs):
        pass

    async def reset(self, states, **kwargs):
        return states

    async def step(self, states, **kwargs):
        raise NotImplementedError("AgentInstance.step is not implemented")


class AgentExecutorBase:
    async def execute(self, *args, **kwargs):
        raise NotImplementedError("agents.AgentEngine runs the episodes, not a custom execute()")


class MultiTurnAgentExecutor(AgentExecutorBase):
    def __init__(self, agent_instance_cls):
        self.agent_instance_cls = agent_instance_cls


def openrlhf_agent_module():
    """Make `from openrlhf.utils.agent import ...` work: OpenRLHF's own module where it is installed, else the
    stand-ins above under its name."""
    import importlib.util
    import types

    if "openrlhf.utils.agent" in sys.modules or importlib.util.find_spec("openrlhf") is not None:
        return
    names = ("openrlhf", "openrlhf.utils", "openrlhf.utils.agent")
    modules = [sys.modules.setdefault(name, types.ModuleType(name)) for name in names]
    modules[0].utils, modules[1].agent = modules[1], modules[2]
    for cls in (AgentInstanceBase, AgentExecutorBase, MultiTurnAgentExecutor):
        setattr(modules[2], cls.__name__, cls)


def user_module(path, refusal):
    """A Python file of YOUR code (an agent), imported: it runs in this process, with this process's permissions,
    exactly like a script you start with python (errors in it show its own traceback). The scripts load a
    reward_func file the same way (their user_module)."""
    import importlib.util

    path = Path(path)
    if path.suffix != ".py" or not path.is_file():
        fail(refusal)
    spec = importlib.util.spec_from_file_location(f"user_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def load_agent(path):
    """--agent_func_path: the AgentInstance class of an OpenRLHF agent file (user_module), as OpenRLHF takes it:
    AgentExecutor().agent_instance_cls."""
    openrlhf_agent_module()
    module, path = user_module(path, f"--agent_func_path {path}: not an existing .py file"), Path(path)
    if not hasattr(module, "AgentExecutor"):
        fail(f"{path} defines no AgentExecutor: an OpenRLHF agent file defines AgentInstance(AgentInstanceBase) "
             "and AgentExecutor(MultiTurnAgentExecutor), whose __init__ passes AgentInstance")
    try:
        cls = getattr(module.AgentExecutor(), "agent_instance_cls", None)
    except Exception as e:
        fail(f"{path}: AgentExecutor() raised {type(e).__name__}: {e}")
    if not isinstance(cls, type):
        fail(f"{path}: its AgentExecutor has no agent_instance_cls (a custom execute() is not run here): subclass "
             "MultiTurnAgentExecutor and pass AgentInstance to its __init__")
    return cls


@dataclass
class Episode:
    """One sample's episode: its agent, the prompt's tokens, every token after them (actions as sampled, the
    environment's feedback tokenized alone) with 1 on action tokens and the engine's log-probs (0 on feedback), the
    text so far (observation_text), and what the steps returned."""
    agent: object
    prompt: list
    text: str
    label: object
    tokens: list = field(default_factory=list)
    mask: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    action_text: str = ""
    reward: float = 0.0
    score: float = 0.0
    logs: dict = field(default_factory=dict)
    turns: int = 0
    env_s: float = 0.0
    done: bool = False
    truncated: bool = False


class AgentEngine:
    """--agent_func_path: each sample is a multi-turn episode with its own instance of the file's AgentInstance
    (OpenRLHF's contract), on `engine`. Every turn the live episodes generate in one sample() call, each with what
    is left of --generate_max_len after the prompt, then their step() calls run concurrently (--agent_timeout
    each). A turn's input is the previous one + the action's tokens + the feedback's, never a re-rendered chat
    template. An episode ends when the agent says done; at --max_turns or when the budget is spent it is
    truncated, as is one whose feedback had to be cut. Its reward is the sum of its steps' rewards; scores and
    extra_logs are the last step's. A broken agent (an exception, a timeout, a malformed result) stops the run
    with one line; its traceback goes to <save_path>_agent_error.log. `in_step`: every rank must make the same
    sample() calls (ZeRO-3 generate over several processes, a tensor-parallel vLLM engine)."""

    def __init__(self, engine, args, tokenizer, in_step=False):
        self.engine, self.args, self.tokenizer, self.in_step = engine, args, tokenizer, in_step
        self.cls, self.warned = load_agent(args.agent_func_path), False

    def sync(self, model, version):
        self.engine.sync(model, version)

    def sample(self, records, temperature):
        return asyncio.run(self.episodes(records, temperature))  # one event loop: an episode's calls share it

    async def episodes(self, records, temperature):
        episodes = []
        for r in records:
            agent = self.guarded("__init__", self.cls)
            episodes.append(Episode(agent, torch.as_tensor(r["ids"]).tolist(), r["text"], r["label"]))
        await self.turn("reset", episodes, temperature)
        versions, with_logprobs = [], False
        while True:
            live = [e for e in episodes if not e.done]
            count = len(live)
            if self.in_step:  # every rank runs as many turns as the one with the most live episodes
                (most,) = common.all_reduce_max([float(count)])
                count = int(most)
            if count == 0:
                break
            prompts = [{"ids": e.prompt + e.tokens} for e in live]
            budgets = [self.args.generate_max_len - len(e.tokens) for e in live]
            pad = count - len(live)  # in step: every rank generates as many (ZeRO-3), fillers of one token
            samples = self.engine.sample(prompts + [{"ids": episodes[0].prompt}] * pad, temperature,
                                         budgets + [1] * pad)
            versions.append(samples["version"])
            with_logprobs = samples["logprobs"] is not None
            for i, e in enumerate(live):
                action = samples["responses"][i].tolist()
                e.tokens += action
                e.mask += [1] * len(action)
                e.logprobs += samples["logprobs"][i].tolist() if with_logprobs else [0.0] * len(action)
                # as vLLM reports it: special tokens kept, the stop token's own text not
                stopped = action[-1:] == [self.tokenizer.eos_token_id]
                e.action_text = self.tokenizer.decode(action[:-1] if stopped else action)
                e.truncated = not stopped  # cut at its budget: the episode ends truncated, whatever step() says
            await self.turn("step", live, temperature)
        logs = {"turns": [float(e.turns) for e in episodes], "truncated": [float(e.truncated) for e in episodes],
                "env_s": [e.env_s for e in episodes]}
        for name in sorted({k for e in episodes for k in e.logs}):
            logs[name] = [e.logs.get(name, 0.0) for e in episodes]
        versions = [v for v in versions if v is not None]
        if any(e.prompt != torch.as_tensor(r["ids"]).tolist() for e, r in zip(episodes, records)):
            # an agent's reset() rewrote them: the episodes continue those tokens, and so do the log-prob passes
            records = [{**r, "ids": torch.tensor(e.prompt, dtype=torch.long)} for r, e in zip(records, episodes)]
        return {"records": records, "responses": [torch.tensor(e.tokens, dtype=torch.long) for e in episodes],
                "logprobs": [torch.tensor(e.logprobs, dtype=torch.float64) for e in episodes] if with_logprobs
                else None,
                "version": min(versions) if versions else None,  # the oldest weights a turn used
                "action_mask": [torch.tensor(e.mask, dtype=torch.bool) for e in episodes],
                "stopped": [not e.truncated for e in episodes],
                "agent_rewards": {"rewards": torch.tensor([e.reward for e in episodes]),
                                  "scores": torch.tensor([e.score for e in episodes]),
                                  "logs": {k: torch.tensor(v, dtype=torch.float32) for k, v in logs.items()}}}

    async def turn(self, method, episodes, temperature):
        """reset() or step() of every episode at once, each bounded by --agent_timeout; the results applied."""
        states = [{"observation": e.text, "label": e.label} if method == "reset" else
                  {"observation_text": e.text, "action_text": e.action_text, "label": e.label,
                   "sampling_params": types.SimpleNamespace(temperature=temperature, top_p=self.args.top_p,
                                                            max_tokens=self.args.generate_max_len - len(e.tokens))}
                  for e in episodes]
        sent = [dict(vars(s["sampling_params"])) if method == "step" else None for s in states]
        results = await asyncio.gather(*[self.call(e, method, s) for e, s in zip(episodes, states)])
        for e, (result, failure), before in zip(episodes, results, sent):
            if failure:
                self.broken(method, *failure)
            self.reset(e, result) if method == "reset" else self.step(e, result, before, temperature)

    async def call(self, episode, method, states):
        """The agent's method on states (async, or plain in a thread of its own), timed -> (result, None), or
        (None, (what went wrong, the exception))."""
        fn = getattr(episode.agent, method, None)
        if fn is None:  # an agent without reset(): the prompt is the observation
            return states, None
        t = time.time()
        try:
            result = await asyncio.wait_for(fn(states) if inspect.iscoroutinefunction(fn) else in_thread(fn, states),
                                            self.args.agent_timeout)
        except (TimeoutError, asyncio.TimeoutError):
            return None, (f"gave no answer within --agent_timeout {self.args.agent_timeout:g} s", None)
        except Exception as e:
            return None, (f"raised {type(e).__name__}: {e}", e)
        episode.env_s += time.time() - t
        return result, None

    def reset(self, e, result):
        observation = result.get("observation") if isinstance(result, dict) else None
        if not isinstance(observation, str):
            self.broken("reset", f"returned {str(result)[:80]!r}; expected a dict with an 'observation' string")
        if observation != e.text:  # a rewritten prompt is tokenized on its own, as OpenRLHF does
            e.prompt, e.text = self.tokenizer(observation, add_special_tokens=False)["input_ids"], observation

    def step(self, e, result, sent, temperature):
        missing = [k for k in ("rewards", "environment_feedback", "done") if not isinstance(result, dict) or
                   k not in result]
        if missing:
            self.broken("step", f"returned a result without {', '.join(map(repr, missing))}")
        feedback = result["environment_feedback"]
        if not isinstance(feedback, str):
            self.broken("step", f"environment_feedback must be a string, got {type(feedback).__name__}")
        e.reward += self.number(result["rewards"], "rewards")
        e.score = self.number(result["scores"], "scores") if result.get("scores") is not None else e.reward
        e.logs = {k: float(v) for k, v in (result.get("extra_logs") or {}).items()
                  if isinstance(v, (int, float)) or torch.is_tensor(v) and v.numel() == 1}
        self.check_sampling(result.get("sampling_params"), sent, temperature)
        ids = self.tokenizer(feedback, add_special_tokens=False)["input_ids"]
        room = self.args.generate_max_len - len(e.tokens)
        e.truncated |= len(ids) > room  # feedback that does not fit is cut, and the episode ends there
        ids = ids[:room]
        e.tokens += ids
        e.mask += [0] * len(ids)
        e.logprobs += [0.0] * len(ids)
        e.text += e.action_text + feedback
        e.turns += 1
        out_of_room = len(e.tokens) >= self.args.generate_max_len or e.turns == self.args.max_turns
        e.truncated |= out_of_room and not result["done"]
        e.done = bool(result["done"]) or e.truncated or out_of_room

    def number(self, value, key):
        """A step's reward or score: one finite number (a float, or a tensor of one element)."""
        try:
            x = torch.as_tensor(value, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError):
            x = None
        if x is None or x.numel() != 1 or not torch.isfinite(x).all():
            self.broken("step", f"{key} must be one finite number, got {str(value)[:80]!r}")
        return x.item()

    def check_sampling(self, params, sent, temperature):
        """A step may return sampling_params: a new temperature is refused (the log-probs assume one), any other
        change is ignored, with one warning."""
        if params is None:
            return
        got = params if isinstance(params, dict) else {k: getattr(params, k) for k in sent if hasattr(params, k)}
        if got.get("temperature", temperature) != temperature:
            self.broken("step", f"returned sampling_params with temperature {got['temperature']}; the run samples "
                                f"at {temperature} (its log-probs assume that one)")
        if any(got.get(k, v) != v for k, v in sent.items()) and not self.warned:
            self.warned = True
            console.print(f"warning: {self.args.agent_func_path}: sampling_params returned by step() are ignored "
                          "(the run's sampling flags hold)", markup=False)

    def guarded(self, method, fn):
        """fn(), or one line naming `method` if it raises."""
        try:
            return fn()
        except Exception as e:
            self.broken(method, f"raised {type(e).__name__}: {e}", e)

    def broken(self, method, problem, error=None):
        """Stop with one line naming the file, the method and the problem; the traceback goes to a file."""
        where = ""
        if error is not None:
            log = Path(f"{self.args.save_path.rstrip('/')}_agent_error.log")
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text("".join(traceback.format_exception(error)))
            where = f" (traceback in {log})"
        fail(f"{self.args.agent_func_path}: AgentInstance.{method} {problem}{where}")


def in_thread(fn, states):
    """fn(states) in a daemon thread, as an awaitable: a plain step() that never returns times out, and cannot hold up
    the exit as a thread pool's worker would."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(method, value):
        if not future.done():
            getattr(future, method)(value)

    def run():
        try:
            outcome = ("set_result", fn(states))
        except Exception as e:
            outcome = ("set_exception", e)
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=run, daemon=True).start()
    return future


def turns_max(turns):
    """--agent_func_path: the longest episode of the step over ranks (turns: each episode's count; their mean is in the
    rewards' logs)."""
    return {"turns_max": max(common.all_reduce_max([float(turns.max())]))}
