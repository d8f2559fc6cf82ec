"""What --agent_server turns on: YOUR agent, written against the OpenAI chat API, drives the rollout. FILE defines

    async def rollout(client, record) -> float, or {"reward": float, other numbers: logged as means}

given an `openai.AsyncOpenAI` client whose base URL is an endpoint this process serves on 127.0.0.1 for that episode
(POST /v1/chat/completions, GET /v1/models; the model is named "policy") and the dataset record as it is in the file,
every field, with "prompt" (its --input_key value) and "label" (its --label_key value, or None) added.
It may call the model any number of times, with any messages, and run its own environment between calls.
toy_chat_agent.py is a template. The file is your code, run in the training process with its permissions.

What is trained is exactly what the policy sampled. Every completion is recorded with its prompt's ids (the
messages rendered by the policy's chat template), its ids and the engine's log-probs. A call whose rendered prompt
starts with an earlier completion's prompt + completion ids continues it: one sample, the tokens between them (the
environment's, the template's) with action mask 0. Otherwise it starts a sample of its own (a template that
re-renders an earlier assistant turn differently: Qwen3's thinking, a trimmed reply, a tokenization the policy
sampled that is not the canonical one); an episode's samples share its reward (grpo.py: its advantage).

Rounds: the calls waiting for the model go to the engine together once every live episode has one waiting (or the
oldest has waited ROUND_WAIT s), at the run's --temperature and --top_p (a request's own are ignored, with one warning;
`python agent_server.py CHECKPOINT` honours them). A request asks n <= 128 choices (OpenAI's bound); alone over a
checkpoint, a prompt or prompt + max_tokens past the model's positions is refused (400), as OpenAI refuses one past a
model's context. Each sample gets --generate_max_len tokens after its first prompt (a larger max_tokens is clipped to
them); a call with none left is answered empty with finish_reason "length", and one more is refused (409). --max_turns
bounds the calls per episode (the one past it is refused; an episode whose rollout raises on a refusal ends truncated
with reward 0), --agent_timeout an episode's seconds outside model calls. A rollout that raises, returns no finite
reward or never calls the model stops the run in one line (its traceback in <save_path>_agent_error.log).

    python agent_server.py CHECKPOINT [--port 8000] [--bf16]  # the endpoint alone over a saved model (GPU if any)
    python agent_server.py CHECKPOINT --agent FILE --dataset F [--max_samples 4]   # ...and run FILE's rollout on F
"""

import argparse
import asyncio
import copy
import functools
import inspect
import itertools
import json
import math
import os
import secrets
import socket
import ssl
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

import common
from common import console, fail

SERVED = "policy"  # the model name a request gives
ROUND_WAIT = 0.5  # seconds a waiting call holds its round open for episodes busy in their environment
MAX_N = 128  # choices a request may ask at most: OpenAI's bound on chat completions' n


@functools.cache
def load_rollout(path):
    """FILE's `async def rollout(client, record)`, or one line saying what is missing."""
    import agents
    fn = getattr(agents.user_module(path, f"--agent_server {path}: not an existing .py file"), "rollout", None)
    if not inspect.iscoroutinefunction(fn):
        fail(f"{path} defines no `async def rollout(client, record)`: the agent that --agent_server runs, given an "
             "openai.AsyncOpenAI client and the dataset record, returning its reward")
    return fn


def check_options(args):
    """The file read before any model loads; the messages are rendered with the chat template, so the stop token is
    its turn end (as with --apply_chat_template, which this sets); the flags that cannot go with it."""
    load_rollout(args.agent_server)
    if args.zero_stage == 3 and int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun's and deepspeed's
        fail("--agent_server with --zero_stage 3 over several processes is not supported yet: an episode may give "
             "several samples, and ZeRO-3's forwards need every rank to hold as many")
    args.apply_chat_template = True
    if getattr(args, "dynamic_filtering", False):
        fail("--dynamic_filtering with --agent_server is not supported: an episode may give several samples, "
             "and the filter picks groups of samples")


class Refused(Exception):
    """A request answered with an HTTP error: (status, one-line reason)."""


def request_fields(body, tokenizer, context=None):
    """An OpenAI chat-completions body -> (prompt ids, the sampling fields agents use); Refused where it is not one,
    or past OpenAI's bounds: n, and with `context` (the model's positions) the prompt and prompt + max_tokens. Fields
    it does not use are ignored, as OpenAI's own server ignores what it does not support."""
    if not isinstance(body, dict):
        raise Refused(400, "the body is not a JSON object")
    if body.get("model") != SERVED:
        raise Refused(404, f"model {body.get('model')!r} is not served here; this endpoint serves {SERVED!r}")
    if body.get("stream"):
        raise Refused(400, "stream is not supported: ask without it")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise Refused(400, "'messages' must be a non-empty list")
    rendered = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise Refused(400, f"messages[{i}] is not a message with a 'role'")
        content = m.get("content")
        if isinstance(content, list):  # content parts: their text, joined
            parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            content = "".join(parts) if all(isinstance(t, str) for t in parts) else 0
        if not isinstance(content, (str, type(None))):
            raise Refused(400, f"messages[{i}].content must be a string or a list of text parts")
        rendered.append({**m, "content": content or ""})
    tools = body.get("tools") if isinstance(body.get("tools"), list) else None
    try:
        text = tokenizer.apply_chat_template(rendered, tools=tools, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # a template's raise_exception (roles that do not alternate), a Jinja error
        reason = (str(e).splitlines() or [type(e).__name__])[0]
        raise Refused(400, f"the chat template cannot render these messages: {reason}") from None
    stop = body.get("stop")
    given = lambda key, default=None: default if body.get(key) is None else body[key]  # noqa: E731  (null: absent)
    fields = {"n": given("n", 1), "max_tokens": given("max_completion_tokens", body.get("max_tokens")),
              "temperature": body.get("temperature"), "top_p": body.get("top_p"),
              "stop": [stop] if isinstance(stop, str) else stop or [], "logprobs": given("logprobs", False)}
    checks = {"n": lambda v: type(v) is int and v >= 1, "max_tokens": lambda v: v is None or type(v) is int and v >= 1,
              "temperature": lambda v: v is None or isinstance(v, (int, float)) and v >= 0,
              "top_p": lambda v: v is None or isinstance(v, (int, float)) and 0 < v <= 1,
              "stop": lambda v: isinstance(v, list) and all(isinstance(s, str) and s for s in v),
              "logprobs": lambda v: isinstance(v, bool)}
    asked = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    for name, ok in checks.items():
        if not ok(fields[name]):
            raise Refused(400, f"'{asked if name == 'max_tokens' else name}' is not valid: {fields[name]!r}")
    if fields["n"] > MAX_N:
        raise Refused(400, f"'n' is {fields['n']}: over {MAX_N}, the most one request may ask")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if context and len(ids) >= context:  # (none left for a completion)
        raise Refused(400, f"the prompt is {len(ids)} tokens: this model's context is {context} tokens, prompt and "
                           "completion together")
    if context and (fields["max_tokens"] or 0) > context - len(ids):
        raise Refused(400, f"'{asked}' is {fields['max_tokens']}: over {context - len(ids)}, what this model's "
                           f"context of {context} tokens leaves after the prompt's {len(ids)}")
    return ids, fields


def positions(model, tokenizer):
    """The tokens the model can take, prompt and completion (its config's positions, by their usual names; else the
    tokenizer's model_max_length where set); None where neither says (some rotary models): no bound then."""
    config = model.config.get_text_config()
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx"):
        if isinstance(getattr(config, name, None), int):
            return getattr(config, name)
    n = getattr(tokenizer, "model_max_length", None)
    return n if isinstance(n, int) and n < 10 ** 9 else None  # (unset: transformers' VERY_LARGE_INTEGER)


@dataclass
class Trajectory:
    """One sample: a first prompt, then its completions (action mask 1, engine log-probs) and the tokens between (0)."""
    prompt: list
    tokens: list = field(default_factory=list)
    mask: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    stopped: bool = False  # its last completion ended at EOS
    busy: bool = False  # a call continuing it waits for the model
    spent: bool = False  # a call found no tokens left and was answered empty

    def extend(self, between, completion, logprobs, stopped):
        self.tokens += between + completion
        self.mask += [0] * len(between) + [1] * len(completion)
        self.logprobs += [0.0] * len(between) + logprobs
        self.stopped, self.busy, self.spent = stopped, False, False  # (a shorter call found room again)


@dataclass
class Episode:
    key: str
    record: dict
    trajectories: list = field(default_factory=list)
    calls: int = 0
    waiting: int = 0  # its calls waiting for the model
    env: float = 0.0  # seconds spent outside model calls (--agent_timeout), up to `mark`
    mark: float = field(default_factory=time.time)  # when it last stopped waiting for the model
    ended: bool = False
    refused: bool = False  # a call was refused with a 409 (past --max_turns, or past its sample's tokens)
    truncated: bool = False
    result: object = None
    error: BaseException = None

    def continued(self, prompt):
        """The trajectory whose ids the prompt starts with (the longest), claimed; or None."""
        fits = [t for t in self.trajectories if not t.busy and prompt[:len(t.prompt) + len(t.tokens)] ==
                t.prompt + t.tokens]
        best = max(fits, key=lambda t: len(t.tokens), default=None)
        if best is not None:
            best.busy = True
        return best

    def env_s(self, now):
        return self.env + (now - self.mark if not self.waiting else 0.0)


@dataclass
class Call:
    episode: Episode  # None: the endpoint alone (python agent_server.py CHECKPOINT)
    prompt: list
    fields: dict
    budget: int
    trajectory: Trajectory  # the one it continues, or None
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    start: float = field(default_factory=time.time)


class Endpoint:
    """The OpenAI-compatible HTTP endpoint (FastAPI under uvicorn, in a thread of its own, on 127.0.0.1 unless told
    otherwise), with the calls waiting for the model (`pending`, under `cond`). Episodes are told apart by their
    base URL, /episodes/<key>/v1; without episodes (`episodes` None) it serves /v1 to anyone."""

    def __init__(self, tokenizer, max_len, max_turns=None, host="127.0.0.1", port=0, episodes=None,
                 prompt_max_len=None, context=None):
        self.tokenizer, self.max_len, self.max_turns, self.episodes = tokenizer, max_len, max_turns, episodes
        self.prompt_max_len, self.context, self.pending, self.cond = prompt_max_len, context, [], threading.Condition()
        ipv6 = ":" in host
        sock = socket.socket(socket.AF_INET6 if ipv6 else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)  # connections made before uvicorn starts wait in the backlog
        address = f"[{host}]" if ipv6 else host  # an IPv6 address goes in brackets in a URL
        self.url = f"http://{address}:{sock.getsockname()[1]}"
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_until_complete, args=(self.serve(sock),), daemon=True).start()

    async def serve(self, sock):
        import uvicorn
        # idle connections kept an hour: an agent's environment step must not race the server closing its connection
        config = uvicorn.Config(self.app(), log_level="warning", lifespan="off", access_log=False,
                                timeout_keep_alive=3600)
        await uvicorn.Server(config).serve(sockets=[sock])

    def app(self):
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse
        app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

        def error(status, reason):
            return JSONResponse({"error": {"message": reason, "type": "invalid_request_error", "code": status}},
                                status_code=status)

        @app.get("/v1/models")
        @app.get("/episodes/{key}/v1/models")
        async def models(key: str = None):
            return {"object": "list", "data": [{"id": SERVED, "object": "model", "created": 0, "owned_by": "policy"}]}

        @app.post("/v1/chat/completions")
        @app.post("/episodes/{key}/v1/chat/completions")
        async def completions(request: Request, key: str = None):
            try:
                body = json.loads(await request.body())
            except ValueError:
                return error(400, "the body is not JSON")
            try:
                return await self.complete(key, body)
            except Refused as e:
                return error(*e.args)
        return app

    async def complete(self, key, body):
        prompt, fields = request_fields(body, self.tokenizer, self.context)
        loop = asyncio.get_running_loop()
        with self.cond:
            e = self.episode(key)
            trajectory = e.continued(prompt) if e else None
            if trajectory is None and self.prompt_max_len and len(prompt) > self.prompt_max_len:
                raise Refused(400, f"a prompt of {len(prompt)} tokens starts a sample: over --prompt_max_len "
                                   f"{self.prompt_max_len}")
            used = len(prompt) - len(trajectory.prompt) if trajectory else 0
            room = (self.context or math.inf) - len(prompt)  # the model's positions left (the endpoint alone)
            budget = min(fields["max_tokens"] or math.inf, self.max_len - used, room)
            if budget <= 0:  # its sample has no room left: answered empty, the episode truncated; then refused
                trajectory.busy, e.truncated = False, True
                if trajectory.spent:  # (an agent that asks again would get empty replies until --agent_timeout)
                    e.refused, e.calls = True, e.calls - 1  # refused: not a turn, as past --max_turns
                    raise Refused(409, f"this episode's sample has used its --generate_max_len {self.max_len} tokens")
                trajectory.spent = True
                return self.response([([], [], "length")] * fields["n"], prompt, fields)
            call = Call(e, prompt, fields, int(budget), trajectory, loop.create_future(), loop)
            self.pending.append(call)
            if e:
                e.env += 0.0 if e.waiting else time.time() - e.mark
                e.waiting += 1
            self.cond.notify_all()
        choices = await call.future
        if isinstance(choices, Refused):
            raise choices
        return self.response(choices, prompt, fields)

    def episode(self, key):
        """The live episode a request belongs to (None without episodes), its call counted; else Refused."""
        if self.episodes is None:
            if key is not None:
                raise Refused(404, "no episodes here: this endpoint serves /v1")
            return None
        e = self.episodes.get(key)
        if e is None:
            raise Refused(404, "no such episode (use the client rollout() was given)")
        if e.ended:
            raise Refused(409, "this episode has ended")
        if self.max_turns and e.calls >= self.max_turns:
            e.refused = e.truncated = True
            raise Refused(409, f"this episode has made its --max_turns {self.max_turns} calls")
        e.calls += 1
        return e

    def response(self, choices, prompt, fields):
        """The OpenAI body of a call's choices [(ids, log-probs, finish_reason)], each cut at a stop string."""
        out = []
        for i, (ids, logprobs, finish) in enumerate(choices):
            ids = ids[:-1] if finish == "stop" and ids[-1:] == [self.tokenizer.eos_token_id] else ids
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            text = text[:min([text.find(x) for x in fields["stop"] if x in text] or [len(text)])]  # its stop string out
            lp = None
            if fields["logprobs"]:
                lp = {"content": [{"token": self.tokenizer.decode([t]), "logprob": x, "top_logprobs": [],
                                   "bytes": list(self.tokenizer.decode([t]).encode())} for t, x in zip(ids, logprobs)]}
            out.append({"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                        "logprobs": lp})
        tokens = sum(len(ids) for ids, _, _ in choices)
        return {"id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion", "created": int(time.time()),
                "model": SERVED, "choices": out, "usage": {"prompt_tokens": len(prompt), "completion_tokens": tokens,
                                                           "total_tokens": len(prompt) + tokens}}

    def next_round(self, live, timeout):
        """Block until a round is due -> the calls waiting (none once no episode of `live` is running). An episode
        past `timeout` seconds outside model calls stops the run."""
        with self.cond:
            while True:
                running = [e for e in live if not e.ended]
                oldest = self.pending[0].start if self.pending else None
                if oldest and (all(e.waiting for e in running) or time.time() - oldest > ROUND_WAIT) or \
                        not running and live and not self.pending:
                    calls, self.pending = self.pending, []
                    return calls
                now = time.time()
                late = next((e for e in running if timeout and e.env_s(now) > timeout), None)
                if late is not None:
                    return late
                self.cond.wait(0.05)

    def refuse(self, call, reason):
        """Answer a call with a 400 (the endpoint alone: a request its model cannot take)."""
        call.loop.call_soon_threadsafe(lambda: call.future.done() or call.future.set_result(Refused(400, reason)))

    def answer(self, call, choices):
        """Hand a call its choices [(ids, log-probs, finish_reason)]; record them in its episode's samples."""
        e = call.episode
        with self.cond:
            if e is not None:
                e.waiting -= 1
                e.mark = time.time()
                for j, (ids, logprobs, finish) in enumerate(choices):
                    t = call.trajectory if j == 0 and call.trajectory is not None else None
                    if t is None:
                        t = Trajectory(call.prompt)
                        e.trajectories.append(t)
                    t.extend(call.prompt[len(t.prompt) + len(t.tokens):], ids, logprobs, finish == "stop")
            self.cond.notify_all()
        call.loop.call_soon_threadsafe(lambda: call.future.done() or call.future.set_result(choices))


def finished(ids, eos, tokenizer, stop):
    """A completion cut at its first stop string (the tokens through the one that completes it: what the policy
    sampled up to there) -> (ids, finish_reason)."""
    if stop and any(s in tokenizer.decode(ids, skip_special_tokens=True) for s in stop):
        for k in range(1, len(ids) + 1):
            if any(s in tokenizer.decode(ids[:k], skip_special_tokens=True) for s in stop):
                return ids[:k], "stop"
    return ids, "stop" if ids[-1:] == [eos] else "length"


class ChatAgentEngine:
    """--agent_server on `engine` (HF generate, vLLM, Ray): sample(records, temperature) runs one rollout() per record
    and answers their calls in rounds -> what every engine returns, per sample, plus action_mask, stopped, agent_rewards
    and `episode` (index into records). `in_step`: all ranks make the same sample() calls (tensor-parallel vLLM)."""

    def __init__(self, engine, args, tokenizer, in_step=False):
        self.engine, self.args, self.tokenizer, self.in_step = engine, args, tokenizer, in_step
        self.rollout, self.warned, self.with_logprobs = load_rollout(args.agent_server), False, False
        self.episodes, self.tls, self.lock = {}, ssl.create_default_context(), threading.Lock()
        self.endpoint = Endpoint(tokenizer, args.generate_max_len, args.max_turns, episodes=self.episodes,
                                 prompt_max_len=args.prompt_max_len)
        self.agents = asyncio.new_event_loop()  # the agents' own loop: a blocking agent does not block the endpoint
        threading.Thread(target=self.agents.run_forever, daemon=True).start()

    def sync(self, model, version):
        self.engine.sync(model, version)

    def sample(self, records, temperature):
        with self.lock:  # --async_steps: eval's episodes wait for those the producer thread runs
            return self.sample_episodes(records, temperature)

    def sample_episodes(self, records, temperature):
        episodes = [Episode(secrets.token_hex(8), {**r.get("record", {}), "prompt": r.get("input", r["text"]),
                                                   "label": r["label"]}) for r in records]
        self.episodes.clear()  # the last call's: ended, their calls refused (404) from here on
        self.episodes.update({e.key: e for e in episodes})
        for e in episodes:
            asyncio.run_coroutine_threadsafe(self.run(e), self.agents)
        versions = []
        while True:
            calls = self.endpoint.next_round(episodes, self.args.agent_timeout)
            if isinstance(calls, Episode):
                self.broken(f"spent over --agent_timeout {self.args.agent_timeout:g} s outside model calls")
            count = sum(c.fields["n"] for c in calls)
            most = int(common.all_reduce_max([float(count)])[0]) if self.in_step else count
            if not most:
                break
            versions.append(self.round(calls, temperature, most - count))
        return self.samples(records, episodes, [v for v in versions if v is not None])

    async def run(self, e):
        import openai
        http = None
        try:
            # own pool (a shared one scans all its connections per request: quadratic); one TLS context (~30 ms to make)
            http = openai.DefaultAsyncHttpxClient(verify=self.tls)
            client = openai.AsyncOpenAI(base_url=f"{self.endpoint.url}/episodes/{e.key}/v1", api_key="episode",
                                        max_retries=0, timeout=None, http_client=http)
            e.result = await self.rollout(client, copy.deepcopy(e.record))  # its own: a rollout may change it
        except BaseException as err:  # a cancelled rollout too
            e.error = err
        finally:
            if http is not None:
                await http.aclose()
            with self.endpoint.cond:
                e.ended = True
                self.endpoint.cond.notify_all()

    def round(self, calls, temperature, pad):
        """One engine call for the calls' completions (n each), `pad` fillers of one token beside them (in step);
        log-probs from the policy where the engine has none and a call asks. -> the weights' version."""
        prompts = [{"ids": c.prompt} for c in calls for _ in range(c.fields["n"])]
        prompts += [prompts[0] if prompts else {"ids": [self.tokenizer.eos_token_id]}] * pad
        budgets = [c.budget for c in calls for _ in range(c.fields["n"])] + [1] * pad
        if any(c.fields["temperature"] not in (None, temperature) or c.fields["top_p"] not in (None, self.args.top_p)
               for c in calls):
            self.warn_sampling(temperature)
        out = self.engine.sample(prompts, temperature, budgets)
        responses = [r.tolist() for r in out["responses"]]
        logprobs = [lp.tolist() for lp in out["logprobs"]] if out["logprobs"] is not None else None
        want = any(c.fields["logprobs"] for c in calls)
        want = bool(common.all_reduce_max([float(want)])[0]) if self.in_step else want
        if logprobs is None and want:
            logprobs = self.policy_logprobs(prompts, out["responses"], temperature)
        self.with_logprobs = out["logprobs"] is not None
        k = 0
        for c in calls:
            choices = []
            for _ in range(c.fields["n"]):
                ids, why = finished(responses[k], self.tokenizer.eos_token_id, self.tokenizer, c.fields["stop"])
                choices.append((ids, logprobs[k][:len(ids)] if logprobs else [0.0] * len(ids), why))
                k += 1
            self.endpoint.answer(c, choices)
        return out["version"]

    @torch.no_grad()
    def policy_logprobs(self, prompts, responses, temperature):
        """HF generate reports none: the policy's own, from a forward pass (at temperature 1 for greedy calls)."""
        model = self.engine.model
        pairs = [(torch.as_tensor(p["ids"]), r) for p, r in zip(prompts, responses)]
        out = []
        for i in range(0, len(pairs), self.args.micro_rollout_batch_size):
            chunk = pairs[i:i + self.args.micro_rollout_batch_size]
            lp, _, _ = common.response_logprobs(model, chunk, self.tokenizer.pad_token_id, False, temperature or 1.0)
            out += [row[:len(r)].tolist() for row, (_, r) in zip(lp.cpu(), chunk)]
        return out

    def warn_sampling(self, temperature):
        if not self.warned:
            self.warned = True
            console.print(f"warning: {self.args.agent_server}: a request's temperature and top_p are ignored in "
                          f"training (the run samples at {temperature:g}, top_p {self.args.top_p:g})", markup=False)

    def samples(self, records, episodes, versions):
        """The episodes' samples as the engines return them, with their rewards and logs."""
        rows = []
        for i, e in enumerate(episodes):
            reward, extra = self.reward(e)
            if not e.trajectories:
                self.broken("returned without calling the model: an episode trains on what the policy sampled", e)
            rows += [(i, t, reward, extra, e) for t in e.trajectories]
        names = sorted({k for _, _, _, extra, _ in rows for k in extra})
        tensor = lambda xs, dtype: [torch.tensor(x, dtype=dtype) for x in xs]  # noqa: E731
        out = {"records": [{**records[i], "ids": torch.tensor(t.prompt), "text": self.tokenizer.decode(t.prompt)}
                           for i, t, *_ in rows],
               "responses": tensor([t.tokens for _, t, *_ in rows], torch.long),
               "logprobs": tensor([t.logprobs for _, t, *_ in rows], torch.float64) if self.with_logprobs else None,
               "version": min(versions) if versions else None,
               "action_mask": tensor([t.mask for _, t, *_ in rows], torch.bool),
               "stopped": [t.stopped and not e.truncated for _, t, _, _, e in rows],
               "episode": torch.tensor([i for i, *_ in rows])}
        logs = {**{k: [extra.get(k, 0.0) for *_, extra, _ in rows] for k in names},  # ours below win a clash
                "turns": [float(e.calls) for *_, e in rows], "truncated": [float(e.truncated) for *_, e in rows],
                "samples": [float(len(e.trajectories)) for *_, e in rows]}
        rewards = torch.tensor([r for _, _, r, _, _ in rows])
        out["agent_rewards"] = {"rewards": rewards, "scores": rewards.clone(),
                                "logs": {k: torch.tensor(v, dtype=torch.float32) for k, v in logs.items()}}
        return out

    def reward(self, e):
        """An ended episode's (reward, extra logs); one whose rollout raised on this endpoint's 409: truncated, 0."""
        if e.error is not None:
            url = str(getattr(getattr(e.error, "request", None), "url", ""))  # (not another service's 409)
            ours = url.startswith(f"{self.endpoint.url}/episodes/{e.key}/")
            if e.refused and type(e.error).__name__ == "ConflictError" and ours:
                e.truncated = True
                return 0.0, {}
            self.broken(f"raised {type(e.error).__name__}: {e.error}", e)
        result = e.result
        value, extra = (result.get("reward"), result) if isinstance(result, dict) else (result, {})
        try:
            x = float(value) if not isinstance(value, bool) else None
        except (TypeError, ValueError):
            x = None
        if x is None or not math.isfinite(x):
            self.broken(f"returned {repr(result)[:80]}; expected a finite number or a dict with a 'reward' number")
        return x, {k: float(v) for k, v in extra.items() if k != "reward" and isinstance(v, (int, float))}

    def broken(self, problem, e=None):
        """Stop with one line naming the file and the problem; a traceback goes to a file."""
        where = ""
        if e is not None and e.error is not None:
            log = Path(f"{self.args.save_path.rstrip('/')}_agent_error.log")
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text("".join(traceback.format_exception(e.error)))
            where = f" (traceback in {log})"
        fail(f"{self.args.agent_server}: rollout {problem}{where}")


# ------------------------------------------------------------------------------ the endpoint alone, over a checkpoint
class Generate:
    """HF generate for the endpoint alone: the policy of a saved checkpoint, at the temperature and top_p asked."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer

    @torch.no_grad()
    def sample(self, records, temperature, max_new_tokens, top_p=1.0):
        tok, eos = self.tokenizer, self.tokenizer.eos_token_id
        batch = tok.pad({"input_ids": [list(r["ids"]) for r in records]}, padding_side="left",
                        return_tensors="pt").to(self.model.device)
        sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if temperature > 0 else \
            dict(do_sample=False)
        with common.sampling_as_asked(self.model):  # nothing from the checkpoint's generation_config.json
            seqs = self.model.generate(**batch, max_new_tokens=max(max_new_tokens), pad_token_id=tok.pad_token_id,
                                       eos_token_id=eos, **sampling)
        out = []
        for row, budget in zip(seqs[:, batch["input_ids"].size(1):], max_new_tokens):
            row = row[:budget]
            stop = (row == eos).nonzero()
            out.append((row[:stop[0, 0] + 1] if len(stop) else row).cpu())
        return {"responses": out, "logprobs": None, "version": None}


@torch.no_grad()
def serve(endpoint, generate):
    """Answer calls one at a time, each at its own sampling fields, until interrupted."""
    while True:
        for call in endpoint.next_round([], None):
            f = call.fields
            t = 1.0 if f["temperature"] is None else f["temperature"]
            try:
                out = generate.sample([{"ids": call.prompt}] * f["n"], t, [call.budget] * f["n"], f["top_p"] or 1.0)
                pairs = [(torch.tensor(call.prompt), r) for r in out["responses"]]
                logprobs = common.response_logprobs(generate.model, pairs, generate.tokenizer.pad_token_id, False,
                                                    t or 1.0)[0].tolist() if f["logprobs"] else None
            except Exception as e:  # a prompt past the model's positions, a temperature that overflows, ...
                endpoint.refuse(call, f"the model cannot answer this request: {type(e).__name__}: "
                                      f"{(str(e).splitlines() or [''])[0]}")
                continue
            choices = []
            for k, r in enumerate(out["responses"]):
                ids, why = finished(r.tolist(), generate.tokenizer.eos_token_id, generate.tokenizer, f["stop"])
                choices.append((ids, logprobs[k][:len(ids)] if logprobs else [0.0] * len(ids), why))
            endpoint.answer(call, choices)


def main():
    p = argparse.ArgumentParser(description="An OpenAI-compatible endpoint over a saved policy, to debug an agent "
                                            "(--agent FILE: run its rollout on --dataset's records)")
    p.add_argument("checkpoint")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=common.ranged(int, 0, 65535), default=8000)
    p.add_argument("--generate_max_len", type=common.ranged(int, 1), default=1024,
                   help="completion tokens of a call at most")
    p.add_argument("--tokenizer_chat_template", default=None, help="a Jinja chat template (text or file)")
    p.add_argument("--trust_remote_code", action="store_true")
    p.add_argument("--agent", default=None, help="a file with async def rollout(client, record) to run")
    p.add_argument("--dataset", default=None, help="with --agent: a .jsonl file of records")
    p.add_argument("--input_key", default="input")
    p.add_argument("--label_key", default=None)
    p.add_argument("--max_samples", type=common.ranged(int, 1), default=4)
    p.add_argument("--temperature", type=common.ranged(float, 0), default=1.0,
                   help="with --agent: the sampling temperature (0: greedy)")
    p.add_argument("--bf16", action="store_true", help="the policy's weights in bf16 (on the GPU where there is one)")
    p.error = fail  # a bad command line stops with one line, as the training scripts' do
    args = p.parse_args()
    common.quiet_libraries()  # no "Loading weights" bar
    args.apply_chat_template, args.top_p, args.flash_attn, args.load_in_4bit = True, 1.0, False, False
    if args.bf16:
        import speedups  # --bf16 on a CPU: what emulated bf16 costs here
        speedups.warn_if_slow_bf16()
    tokenizer = common.load_tokenizer(args.checkpoint, args)
    model = common.load_model(args.checkpoint, args, tokenizer, trainable=False,  # the training scripts' rules
                              device_map="cuda" if torch.cuda.is_available() else None).eval()
    generate = Generate(model, tokenizer)
    if args.agent is None:
        endpoint = Endpoint(tokenizer, args.generate_max_len, host=args.host, port=args.port,
                            context=positions(model, tokenizer))
        console.print(f"serving {args.checkpoint} as {SERVED!r} ({model.dtype}, {model.device}) on {endpoint.url}/v1",
                      markup=False)
        serve(endpoint, generate)
    if args.dataset is None:
        fail("--agent needs --dataset: the records its rollout is run on")
    records = common.load_records(args.dataset, "train", [args.input_key] + [args.label_key] * bool(args.label_key),
                                  args.max_samples, text_keys=[args.input_key])
    args.agent_server, args.max_turns, args.agent_timeout, args.micro_rollout_batch_size = args.agent, None, 600.0, 8
    args.prompt_max_len = None
    args.save_path = "agent_server"
    engine = ChatAgentEngine(generate, args, tokenizer)
    engine.endpoint.context = positions(model, tokenizer)  # (the training endpoint's has none: it clips to budgets)
    out = engine.sample([{"input": r[args.input_key], "text": "", "label": r.get(args.label_key), "record": r}
                         for r in records], args.temperature)
    for i, record in enumerate(out["records"]):  # what the policy sampled in [brackets]
        pairs = zip(out["responses"][i].tolist(), out["action_mask"][i].tolist())
        text = "".join(("[{}]" if sampled else "{}").format(tokenizer.decode([t for t, _ in run]))
                       for sampled, run in itertools.groupby(pairs, key=lambda pair: pair[1]))
        print(f"episode {int(out['episode'][i])}, reward {float(out['agent_rewards']['rewards'][i]):g}: "
              f"{tokenizer.decode(record['ids'])}{text}")


if __name__ == "__main__":
    main()
