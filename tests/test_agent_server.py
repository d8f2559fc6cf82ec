"""--agent_server (agent_server.py): an agent written against the OpenAI chat API (the real `openai` client) drives the
rollout through an endpoint the trainer serves. What is trained is what was sampled, on the five families' chat
templates: one sample where a call's rendered prompt continues the last, two where a template re-renders a reply
otherwise; the endpoint's replies and refusals; broken agents stopped in one line; an episode's samples sharing its
advantage; the endpoint alone over a checkpoint (python agent_server.py); GRPO on HF generate and vLLM and PPO over
two ZeRO-3 ranks, end to end."""
import argparse
import asyncio
import json
import math
import os
import socket
import subprocess
import sys
import threading

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import ROOT, last_logged, results, run_main, run_script

import agent_server  # noqa: E402
import common  # noqa: E402
import families  # noqa: E402
import grpo  # noqa: E402
import ppo  # noqa: E402
import toy  # noqa: E402

# Two calls: the user's question, then a follow-up after the first reply. The messages the second call sends go to
# the file named by the record's label, so the test renders them itself.
TWO_CALLS = '''
import json


async def rollout(client, record):
    messages = [{"role": "user", "content": record["prompt"]}]
    first = await client.chat.completions.create(model="policy", messages=messages)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And twice that?"}]
    second = await client.chat.completions.create(model="policy", messages=messages)
    json.dump(messages, open(record["label"], "w"))
    return {"reward": float(len(second.choices[0].message.content)), "calls": 2}
'''


def agent_file(tmp_path, body, name="chat_agent.py"):
    path = tmp_path / name
    path.write_text(body)
    return path


def server_args(path, tmp_path, **kw):
    return argparse.Namespace(**{"agent_server": str(path), "generate_max_len": 40, "max_turns": None,
                                 "agent_timeout": 20.0, "temperature": 1.0, "top_p": 1.0,
                                 "micro_rollout_batch_size": 8, "prompt_max_len": 1024,
                                 "save_path": str(tmp_path / "run"), **kw})


def records(*rows):
    return [{"ids": torch.tensor([0]), "text": "", "input": prompt, "label": label} for prompt, label in rows]


class Scripted:
    """An engine answering its k-th sample() call with replies[k] (text: its tokens, then the EOS; or a list of ids),
    cut at each budget; log-probs -0.25 a token; it records every call's prompts and budgets."""

    def __init__(self, tok, replies):
        self.tok, self.replies, self.calls = tok, replies, []

    def ids(self, reply):
        return reply if isinstance(reply, list) else \
            self.tok(reply, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]

    def sample(self, records, temperature, max_new_tokens=None):
        self.calls.append(([list(map(int, r["ids"])) for r in records], list(max_new_tokens)))
        ids = self.ids(self.replies[min(len(self.calls), len(self.replies)) - 1])
        out = [torch.tensor(ids[:n]) for n in max_new_tokens]
        return {"responses": out, "logprobs": [torch.full((len(o),), -0.25, dtype=torch.float64) for o in out],
                "version": 3}


def chat_tokenizer(family):
    """A family's stand-in tokenizer as load_tokenizer leaves it with a chat template: the template's turn end is the
    EOS. GPT-2 has no template; it gets the toy world's plain one (as --tokenizer_chat_template would)."""
    tok = families.build_tokenizer(family)
    tok.chat_template = tok.chat_template or toy.PLAIN_CHAT_TEMPLATE
    common.use_turn_end_as_eos(tok, family)
    return tok


@pytest.fixture
def plain(toy_world):
    """The toy tokenizer with the plain chat template (toy_world/plain_chat.jinja)."""
    tok = AutoTokenizer.from_pretrained(toy_world / "model")
    tok.chat_template = toy.PLAIN_CHAT_TEMPLATE
    return tok


def render(tok, messages):
    """The prompt's ids as a chat model sees them: the template's text, tokenized with no special tokens added."""
    return tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
               add_special_tokens=False)["input_ids"]


# ----------------------------------------------------------------------------------------- token exactness
# Whether the second call's rendered prompt continues the first call's prompt + completion, per family: ChatML (Qwen),
# Llama 3 and the plain template write a reply back as it was sampled; the Mistral stand-in's (SentencePiece) reply
# starts with "▁", a space that decoding drops and the re-rendered "[/INST]Sure" does not have: other ids.
CONTINUES = {"qwen25_instruct": True, "qwen25_base": True, "llama3_instruct": True, "mistral": False, "gpt2": True}


@pytest.mark.parametrize("family, reply", [(f, "Sure: 5.") for f in families.FAMILIES] + [
    ("llama3_instruct", "  Sure: 5.  "),  # its template trims a reply: the re-rendered turn differs
    ("qwen25_instruct", "split"),  # the policy sampled "Sure" a character at a time: not the canonical tokens
], ids=[*families.FAMILIES, "llama3-trimmed", "qwen-noncanonical"])
def test_what_is_trained_is_what_was_sampled(family, reply, tmp_path):
    """Two calls of one episode (TWO_CALLS) on each family's chat template. The engine gets each call's messages
    rendered by the template; when the second prompt starts with the first prompt + its completion's ids, the episode
    is one sample: the first prompt, then completion 1 (mask 1, the engine's log-probs), the template's tokens between
    (mask 0, log-prob 0), completion 2 (mask 1). Otherwise two samples, each its own prompt and completion, both of
    episode 0 with its reward. Every trained token with mask 1 is one the engine sampled, in order."""
    tok = chat_tokenizer(family)
    first = [t for c in "Sure" for t in tok(c, add_special_tokens=False)["input_ids"]] + \
        tok(": 5.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id] if reply == "split" else reply
    engine = Scripted(tok, [first, "It is 10."])
    sent = tmp_path / "messages.json"
    out = agent_server.ChatAgentEngine(engine, server_args(agent_file(tmp_path, TWO_CALLS), tmp_path), tok).sample(
        records(("What is 2+3?", str(sent))), 1.0)
    messages = json.loads(sent.read_text())
    p1, p2 = render(tok, messages[:1]), render(tok, messages)
    c1, c2 = engine.ids(first), engine.ids("It is 10.")
    continues = p2[:len(p1) + len(c1)] == p1 + c1
    assert continues == (CONTINUES[family] and reply == "Sure: 5.")
    between = p2[len(p1) + len(c1):]
    assert engine.calls[0] == ([p1], [40])
    assert engine.calls[1] == ([p2], [40 - len(c1) - len(between)] if continues else [40])
    if continues:
        expected = [(p1, c1 + between + c2, [1] * len(c1) + [0] * len(between) + [1] * len(c2))]
    else:
        expected = [(p1, c1, [1] * len(c1)), (p2, c2, [1] * len(c2))]
    got = [(r["ids"].tolist(), x.tolist(), m.int().tolist())
           for r, x, m in zip(out["records"], out["responses"], out["action_mask"])]
    assert got == expected
    assert [lp.tolist() for lp in out["logprobs"]] == [[-0.25 * m for m in mask] for _, _, mask in expected]
    assert out["episode"].tolist() == [0] * len(expected) and out["stopped"] == [True] * len(expected)
    rewards = out["agent_rewards"]["rewards"].tolist()
    assert rewards == [float(len("It is 10."))] * len(expected) and out["version"] == 3
    logs = out["agent_rewards"]["logs"]
    assert logs["turns"].tolist() == [2.0] * len(expected)
    assert logs["samples"].tolist() == [len(expected)] * len(expected)
    assert logs["calls"].tolist() == [2.0] * len(expected)  # the rollout's own numbers, logged


ASKS_AGAIN = '''
async def rollout(client, record):
    messages = [{"role": "user", "content": record["prompt"]}]
    while True:  # until a reply ends for a reason other than its length
        reply = (await client.chat.completions.create(model="policy", messages=messages)).choices[0]
        if reply.finish_reason != "length":
            return 1.0
        messages += [{"role": "assistant", "content": reply.message.content}, {"role": "user", "content": "Go on."}]
'''

JUDGE_BUSY = "import httpx\nimport openai\n" + ASKS_AGAIN.replace("def rollout", "def asks_again") + '''

async def rollout(client, record):
    try:
        return await asks_again(client, record)
    except openai.ConflictError:  # the endpoint's 409, then one from a service of its own
        response = httpx.Response(409, request=httpx.Request("POST", "http://judge.invalid/score"))
        raise openai.ConflictError("the judge is busy", response=response, body=None)
'''


# The reward is made of fields the dataset has beyond the prompt and the label; the rollout changes its record.
WHOLE_RECORD = '''
async def rollout(client, record):
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": record["prompt"]}])
    assert (record["prompt"], record["label"]) == (record["question"], record["answer"])
    record["tags"].append("seen")
    return record["meta"]["weight"] + len(record["tags"])
'''


@pytest.mark.parametrize("script", [grpo, ppo])
def test_rollout_gets_the_whole_record(plain, tmp_path, script):
    """rollout(client, record) gets the record as the file has it, every field (nested ones too), with "prompt" (the
    --input_key value) and "label" (the --label_key value) added, through the script's own load_prompts; a copy of
    its own, so what a rollout changes in it reaches no other episode, nor the next step's."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a}+45=", "answer": str(a + 45), "meta": {"weight": w},
                                        "tags": ["x"] * t}) + "\n" for a, w, t in [(10, 2.5, 2), (20, -1.0, 0)]))
    args = argparse.Namespace(input_key="question", label_key="answer", apply_chat_template=True,
                              input_template=None, prompt_max_len=64, seed=0)
    prompts = script.load_prompts(str(data), "train", plain, args)
    engine = agent_server.ChatAgentEngine(Scripted(plain, ["55"]), server_args(agent_file(tmp_path, WHOLE_RECORD),
                                                                                tmp_path), plain)
    for _ in range(2):
        assert engine.sample(prompts + prompts, 1.0)["agent_rewards"]["rewards"].tolist() == [5.5, 0.0] * 2


def test_calls_of_many_episodes_share_rounds_and_budgets(plain, tmp_path):
    """Three episodes: their first calls go to the engine in one round, their second in another; a sample gets
    --generate_max_len tokens after its first prompt, so a call continuing it gets what is left, and one with none
    left is answered empty with finish_reason "length" (the episode truncated, not stopped). A call after that
    empty reply is refused (409): an agent that asks again ends truncated with reward 0, not at --agent_timeout; a 409
    from elsewhere (the agent's own service) stops the run as any error does."""
    tok, engine = plain, Scripted(plain, ["?", "52"])
    path = agent_file(tmp_path, TWO_CALLS)
    rows = [("07+x=", str(tmp_path / f"m{i}.json")) for i in range(3)]
    out = agent_server.ChatAgentEngine(engine, server_args(path, tmp_path, generate_max_len=24), tok).sample(
        records(*rows), 1.0)
    assert [len(prompts) for prompts, _ in engine.calls] == [3, 3]
    messages = json.loads((tmp_path / "m0.json").read_text())
    asked = len(render(tok, messages)) - len(render(tok, messages[:1]))  # "?", EOS and the environment's tokens
    assert engine.calls[1][1] == [24 - asked] * 3
    out = agent_server.ChatAgentEngine(Scripted(tok, ["?", "52"]), server_args(path, tmp_path, generate_max_len=2),
                                       tok).sample(records(*rows[:1]), 1.0)
    assert out["stopped"] == [False] and out["agent_rewards"]["logs"]["truncated"].tolist() == [1.0]
    assert out["agent_rewards"]["rewards"].tolist() == [0.0]  # the second reply was empty
    engine = Scripted(tok, ["?"])  # an agent that asks until it is answered: one empty reply, then a 409
    out = agent_server.ChatAgentEngine(engine, server_args(agent_file(tmp_path, ASKS_AGAIN, "again.py"), tmp_path,
                                                           generate_max_len=1), tok).sample(records(*rows[:1]), 1.0)
    logs = out["agent_rewards"]["logs"]
    assert len(engine.calls) == 1 and logs["turns"].tolist() == [2.0] and logs["truncated"].tolist() == [1.0]
    assert out["agent_rewards"]["rewards"].tolist() == [0.0]
    with pytest.raises(SystemExit, match="raised ConflictError: the judge is busy"):  # a 409 of its own: a bug
        agent_server.ChatAgentEngine(Scripted(tok, ["?"]), server_args(agent_file(tmp_path, JUDGE_BUSY, "busy.py"),
                                                                       tmp_path, generate_max_len=1),
                                     tok).sample(records(*rows[:1]), 1.0)


# --------------------------------------------------------------------------------------------- the endpoint
@pytest.fixture(scope="module")
def endpoint(policy):
    """python agent_server.py's endpoint over the toy policy (plain template, 512 positions), served from a thread."""
    tok = common.load_tokenizer(policy, argparse.Namespace(trust_remote_code=False, apply_chat_template=True,
                                                           tokenizer_chat_template=toy.PLAIN_CHAT_TEMPLATE))
    model = AutoModelForCausalLM.from_pretrained(policy).eval()
    point = agent_server.Endpoint(tok, 8, context=agent_server.positions(model, tok))
    threading.Thread(target=agent_server.serve, args=(point, agent_server.Generate(model, tok)), daemon=True).start()
    return point, model, tok


def test_an_ipv6_host_gets_a_url_with_brackets(endpoint):
    """--host ::1: the URL an agent is given is http://[::1]:port, and /v1/models answers there."""
    _, _, tok = endpoint
    try:
        socket.socket(socket.AF_INET6).bind(("::1", 0))
    except OSError:
        pytest.skip("this machine has no IPv6 loopback")
    point = agent_server.Endpoint(tok, 8, host="::1")  # listening once made (uvicorn takes the backlog when it starts)
    assert point.url.startswith("http://[::1]:")
    r = httpx.get(f"{point.url}/v1/models", timeout=30)
    assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == ["policy"]


def post(url, body):
    r = httpx.post(f"{url}/v1/chat/completions", content=body if isinstance(body, bytes) else json.dumps(body),
                   timeout=60)
    return r.status_code, r.json()


def test_the_endpoint_answers_as_openai_does(endpoint):
    """The openai client's calls: /v1/models lists "policy"; n choices with their log-probs, which are the policy's
    own (a forward pass, float64 reference by the model's logits); a stop string ends the reply before it; usage
    counts tokens. It listens on 127.0.0.1."""
    point, model, tok = endpoint
    assert point.url.startswith("http://127.0.0.1:")

    async def calls():
        client = openai.AsyncOpenAI(base_url=f"{point.url}/v1", api_key="none")
        models = await client.models.list()
        reply = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "12+34="}],
                                                     n=2, logprobs=True, max_tokens=4, temperature=0.7)
        stopped = await client.chat.completions.create(model="policy", messages=[
            {"role": "user", "content": "12+34="}], temperature=0, stop=["6"])
        return models, reply, stopped
    models, reply, stopped = asyncio.run(calls())
    assert [m.id for m in models.data] == ["policy"]
    assert len(reply.choices) == 2 and reply.usage.prompt_tokens == len(render(tok, [{"role": "user",
                                                                                      "content": "12+34="}]))
    prompt = render(tok, [{"role": "user", "content": "12+34="}])
    for choice in reply.choices:
        ids = [tok.convert_tokens_to_ids(t.token) for t in choice.logprobs.content]
        assert tok.decode(ids) == choice.message.content and len(ids) <= 4
        with torch.no_grad():  # the reference: the model's own logits in float64, at the temperature asked
            logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].double() / 0.7
        want = logits.log_softmax(-1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)
        got = torch.tensor([t.logprob for t in choice.logprobs.content], dtype=torch.float64)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    # greedy "12+34=" -> "46" from the SFT policy's habits, or whatever it writes: the stop string is cut off
    text = stopped.choices[0].message.content
    assert "6" not in text and stopped.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("body, status, reason", [
    (b"{not json", 400, "the body is not JSON"),
    ([1, 2], 400, "the body is not a JSON object"),
    ({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, 404, "model 'gpt-4o' is not served here"),
    ({"model": "policy", "messages": "hi"}, 400, "'messages' must be a non-empty list"),
    ({"model": "policy", "messages": [{"content": "hi"}]}, 400, "messages[0] is not a message with a 'role'"),
    ({"model": "policy", "messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content must be a string"),
    ({"model": "policy", "messages": [{"role": "user", "content": "hi"}], "n": 0}, 400, "'n' is not valid: 0"),
    ({"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, 400,
     "'max_tokens' is not valid: -1"),
    ({"model": "policy", "messages": [{"role": "user", "content": "hi"}], "stream": True}, 400,
     "stream is not supported"),
    # OpenAI's bounds: n <= 128; prompt + max_tokens within the model's context (the toy policy's 512 positions)
    ({"model": "policy", "messages": [{"role": "user", "content": "hi"}], "n": 100000}, 400,
     "'n' is 100000: over 128, the most one request may ask"),
    ({"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}, 400,
     "'max_tokens' is 100000: over 509, what this model's context of 512 tokens leaves after the prompt's 3"),
    ({"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 510}, 400,
     "'max_completion_tokens' is 510: over 509"),
    ({"model": "policy", "messages": [{"role": "user", "content": "1" * 600}]}, 400,
     "the prompt is 601 tokens: this model's context is 512 tokens"),
], ids=["not-json", "not-object", "model", "messages", "role", "content", "n", "max_tokens", "stream", "n-bound",
        "max_tokens-bound", "max_completion_tokens-bound", "prompt-bound"])
def test_bad_requests_get_a_4xx_with_one_line(endpoint, body, status, reason):
    code, reply = post(endpoint[0].url, body)
    assert code == status and reply["error"]["message"].startswith(reason), reply
    assert "\n" not in reply["error"]["message"]


def test_a_huge_request_is_refused_and_the_largest_allowed_starves_no_one(endpoint):
    """n=100000 (which once grew the server by gigabytes) is refused at once; then the largest request allowed (n=128,
    all its tokens) and a small one sent beside it are both answered: calls are served in the order they came, each
    bounded, so one waits for those before it, never forever."""
    point, _, tok = endpoint
    ask = {"model": "policy", "messages": [{"role": "user", "content": "12+34="}]}
    code, reply = post(point.url, {**ask, "n": 100000})
    assert code == 400 and reply["error"]["message"].startswith("'n' is 100000: over 128")

    async def calls():
        client = openai.AsyncOpenAI(base_url=f"{point.url}/v1", api_key="none", max_retries=0, timeout=120)
        return await asyncio.gather(client.chat.completions.create(**ask, n=128, max_tokens=8),
                                    client.chat.completions.create(**ask))
    big, small = asyncio.run(calls())
    assert len(big.choices) == 128 and len(small.choices) == 1 and small.choices[0].finish_reason in ("stop", "length")


def test_positions_is_the_models_context(tokenizer):
    """The bound the endpoint alone sets: the config's positions by their usual names (Llama's, GPT-2's), else the
    tokenizer's model_max_length where it was set, else none."""
    from types import SimpleNamespace

    from transformers import GPT2Config, LlamaConfig, PretrainedConfig
    model = lambda config: SimpleNamespace(config=config)  # noqa: E731
    unset = SimpleNamespace(model_max_length=int(1e30))  # transformers' VERY_LARGE_INTEGER: not set
    assert agent_server.positions(model(LlamaConfig(max_position_embeddings=300)), unset) == 300
    assert agent_server.positions(model(GPT2Config(n_positions=64)), unset) == 64
    assert agent_server.positions(model(PretrainedConfig()), tokenizer) == tokenizer.model_max_length == 512
    assert agent_server.positions(model(PretrainedConfig()), unset) is None


def test_unknown_fields_are_ignored_and_a_template_error_is_a_400(endpoint, tokenizer):
    point = endpoint[0]
    code, reply = post(point.url, {"model": "policy", "messages": [{"role": "user", "content": "1+1="}],
                                   "max_completion_tokens": 2, "frequency_penalty": 0.5, "user": "me", "seed": 1})
    assert code == 200 and reply["usage"]["completion_tokens"] <= 2
    tok = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tok.chat_template = "{{ raise_exception('Only user and assistant roles are supported!') }}"
    with pytest.raises(agent_server.Refused, match="the chat template cannot render these messages: Only user"):
        agent_server.request_fields({"model": "policy", "messages": [{"role": "system", "content": "x"}]}, tok)


# ---------------------------------------------------------------------------------------- episodes' limits
LEAKY = '''
from pathlib import Path


async def rollout(client, record):
    Path(record["label"]).write_text(str(client.base_url))
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": record["prompt"]}])
    return 1.0
'''


def test_an_ended_episode_and_calls_past_max_turns_are_refused(plain, tmp_path):
    """A client kept past its episode's end gets a 409; with --max_turns 1 the second call of TWO_CALLS is refused
    (409): its rollout raises, and the episode ends truncated with reward 0 instead of stopping the run."""
    tokenizer, leaked = plain, tmp_path / "leaked_url"
    path = agent_file(tmp_path, LEAKY, "leaky.py")
    engine = agent_server.ChatAgentEngine(Scripted(tokenizer, ["1"]), server_args(path, tmp_path), tokenizer)
    engine.sample(records(("1+1=", str(leaked))), 1.0)
    client = openai.AsyncOpenAI(base_url=leaked.read_text(), api_key="none", max_retries=0)
    with pytest.raises(openai.ConflictError, match="this episode has ended"):
        asyncio.run(client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}]))
    engine = agent_server.ChatAgentEngine(Scripted(tokenizer, ["1", "2"]), server_args(
        agent_file(tmp_path, TWO_CALLS), tmp_path, max_turns=1), tokenizer)
    out = engine.sample(records(("1+1=", str(tmp_path / "m.json")), ("2+2=", str(tmp_path / "n.json"))), 1.0)
    assert out["agent_rewards"]["rewards"].tolist() == [0.0, 0.0] and out["stopped"] == [False, False]
    assert out["agent_rewards"]["logs"]["truncated"].tolist() == [1.0, 1.0]
    assert len(out["responses"]) == 2  # each episode's one completion is trained on


@pytest.mark.parametrize("body, message", [
    ("def rollout(client, record):\n    return 1.0\n", "defines no `async def rollout(client, record)`"),
    ("async def rollout(client, record):\n    return 1.0\n", "rollout returned without calling the model"),
    ("CALL\n    return float('nan')\n", "rollout returned nan; expected a finite number"),
    ("CALL\n    return {'score': 1.0}\n", "rollout returned {'score': 1.0}; expected a finite number"),
    ("CALL\n    return 'good'\n", "rollout returned 'good'; expected a finite number"),
    ("CALL\n    raise ValueError('the tool broke')\n", "rollout raised ValueError: the tool broke (traceback in"),
    ("import time\nCALL\n    time.sleep(4)\n    return 1.0\n", "rollout spent over --agent_timeout 1 s outside"),
    ("CALL\n    await client.chat.completions.create(model='policy', messages=[{'role': 'user', 'content': 'x' * 40}])"
     "\n    return 1.0\n", "a prompt of 41 tokens starts a sample: over --prompt_max_len 16"),
], ids=["sync", "no-call", "nan", "no-reward", "text", "raises", "timeout", "long-prompt"])
def test_a_broken_agent_stops_the_run_in_one_line(plain, tmp_path, body, message):
    tokenizer = plain
    call = "async def rollout(client, record):\n    await client.chat.completions.create(model='policy', " \
           "messages=[{'role': 'user', 'content': '1+1='}])"
    path = agent_file(tmp_path, body.replace("CALL", call), f"broken_{abs(hash(body))}.py")
    with pytest.raises(SystemExit) as e:
        agent_server.ChatAgentEngine(Scripted(tokenizer, ["2"]), server_args(
            path, tmp_path, agent_timeout=1.0 if "sleep" in body else 20.0, prompt_max_len=16), tokenizer).sample(
            records(("1+1=", None)), 1.0)
    assert message in str(e.value) and "\n" not in str(e.value)
    if "traceback" in message:
        assert "the tool broke" in (tmp_path / "run_agent_error.log").read_text()


def test_flags_that_do_not_go_together(tmp_path, toy_world):
    path = agent_file(tmp_path, TWO_CALLS)
    proc = run_main("grpo.py", "--agent_server", path, "--agent_func_path", ROOT / "toy_agent.py", check=False)
    assert proc.returncode == 1 and "give exactly one reward" in proc.stderr.strip().splitlines()[-1]
    proc = run_main("grpo.py", "--agent_server", path, "--dynamic_filtering", check=False)
    assert "--dynamic_filtering with --agent_server is not supported" in proc.stderr.strip().splitlines()[-1]
    proc = run_main("ppo.py", "--agent_server", tmp_path / "missing.py", check=False)
    assert proc.stderr.strip().splitlines()[-1].endswith("missing.py: not an existing .py file")
    proc = run_main("agent_server.py", toy_world / "model", "--generate_max_len", 0, check=False)  # standalone
    assert proc.stderr.strip().splitlines()[-1].endswith("argument --generate_max_len: 0 is outside [1, inf)")
    proc = run_main("agent_server.py", toy_world / "model", "--port", 99999, check=False)  # one line, no usage block
    assert proc.returncode == 1 and proc.stderr.strip() == "error: argument --port: 99999 is outside [0, 65535]"


# ------------------------------------------------------------------------------- samples of episodes, in GRPO
def test_an_episodes_samples_share_its_group_advantage():
    """Rollout.per_episode (each episode's mean) and grpo.py's advantage for a rollout whose 4 episodes (2 prompts x 2)
    gave 1, 2, 1 and 3 samples: the group statistics are the episodes' (a naive loop), each sample gets its
    episode's; micro_batches makes as many slices as 4 episodes would, holding every sample once."""
    episode = torch.tensor([0, 1, 1, 2, 3, 3, 3])
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5], dtype=torch.float64)
    batch = grpo.Rollout.of([{"ids": torch.tensor([1])}] * 7, 2, [torch.tensor([5])] * 7, episode=episode)
    per_episode = batch.per_episode(rewards)
    assert per_episode.tolist() == [1.0, 0.0, 1.0, 0.5]
    advantages = grpo.group_advantages(per_episode, 2, "group_norm")[batch.episode]
    for i, e in enumerate(episode.tolist()):  # the naive reference: mean and std of the episode's group of two
        group = [[1.0, 0.0], [1.0, 0.5]][e // 2]
        mean, std = sum(group) / 2, math.sqrt(sum((x - sum(group) / 2) ** 2 for x in group) / (2 - 1))
        assert advantages[i].item() == pytest.approx((group[e % 2] - mean) / (std + 1e-6))
    for m in (grpo, ppo):  # both scripts' copies of Rollout
        batch = m.Rollout.of([{"ids": torch.tensor([1])}] * 7, 2, [torch.tensor([5])] * 7, episode=episode)
        assert batch.per_episode(rewards).tolist() == [1.0, 0.0, 1.0, 0.5]
        slices = batch.micro_batches(2)
        assert len(slices) == 2 and sorted(torch.cat(slices).tolist()) == list(range(7))
        assert len(m.Rollout.of([{"ids": torch.tensor([1])}] * 7, 2, [torch.tensor([5])] * 7).micro_batches(2)) == 4


# ---------------------------------------------------------------------- the endpoint alone, over a checkpoint
def test_the_template_agent_runs_unchanged_against_a_saved_policy(policy, toy_world, tmp_path, plain):
    """`python agent_server.py CHECKPOINT --bf16` serves the policy in bf16, with no progress bar while it loads;
    toy_chat_agent.py's rollout, imported as is, runs against it with a stock openai client and gets a 0/1 reward; a
    3,001-token prompt to the 512-position model is refused (400) naming the bound; --agent runs the rollout on
    dataset records and prints each episode with what the policy sampled in brackets."""
    port = common.free_port()
    server = subprocess.Popen([sys.executable, ROOT / "agent_server.py", policy, "--port", str(port), "--bf16",
                               "--tokenizer_chat_template", toy_world / "plain_chat.jinja", "--generate_max_len", "16"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        line, lines = "", []
        while "serving" not in line:
            line = server.stdout.readline()
            assert line or server.poll() is None, "the server exited"
            lines.append(line)
        assert not any("Loading weights" in x or "it/s]" in x for x in lines), lines
        device = "cuda:0" if torch.cuda.is_available() else "cpu"
        assert f"(torch.bfloat16, {device}) on http://127.0.0.1:{port}/v1" in line, line
        sys.path.insert(0, str(ROOT))
        import toy_chat_agent
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        out = asyncio.run(toy_chat_agent.rollout(client, {"prompt": "07+x=", "label": "45"}))
        assert out["reward"] in (0.0, 1.0) and set(out) == {"reward", "asked", "accuracy"}
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "1+"}],
                                               logprobs=True, max_tokens=4).choices[0]
        assert 1 <= len(reply.logprobs.content) <= 4 and all(-50 < t.logprob <= 0 for t in reply.logprobs.content)
        content = "1" * (3001 - len(render(plain, [{"role": "user", "content": ""}])))
        assert len(render(plain, [{"role": "user", "content": content}])) == 3001
        code, reply = post(f"http://127.0.0.1:{port}", {"model": "policy", "messages": [{"role": "user",
                                                                                        "content": content}]})
        assert code == 400 and reply["error"]["message"] == "the prompt is 3001 tokens: this model's context is " \
            "512 tokens, prompt and completion together"
    finally:
        server.terminate()
        server.wait(30)
    proc = subprocess.run([sys.executable, ROOT / "agent_server.py", policy, "--agent", ROOT / "toy_chat_agent.py",
                           "--tokenizer_chat_template", toy_world / "plain_chat.jinja", "--dataset",
                           toy_world / "tool_test.jsonl", "--label_key", "label", "--max_samples", "3",
                           "--generate_max_len", "16"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Loading weights" not in proc.stderr and "it/s]" not in proc.stderr
    lines = [x for x in proc.stdout.splitlines() if x.startswith("episode")]
    assert len(lines) >= 3 and all(", reward " in x and "+x=[" in x for x in lines)


# -------------------------------------------------------------------------------------------------- end to end
TOOL = ["--label_key", "label", "--prompt_max_len", 16, "--generate_max_len", 16, "--max_samples", 64,
        "--rollout_batch_size", 16, "--n_samples_per_prompt", 4, "--train_batch_size", 32,
        "--micro_train_batch_size", 16, "--logging_steps", 1, "--agent_server", ROOT / "toy_chat_agent.py"]


@pytest.fixture(scope="module")
def tool_data(toy_world, tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_tool")
    (root / "eval.jsonl").write_text("".join(open(toy_world / "tool_test.jsonl").readlines()[:32]))
    return ["--dataset", toy_world / "tool_train.jsonl", "--eval_dataset", root / "eval.jsonl",
            "--tokenizer_chat_template", toy_world / "plain_chat.jinja"]


def test_grpo_trains_the_template_agent_on_vllm(policy, tool_data, tmp_path):
    """grpo.py with toy_chat_agent.py on in-process vLLM (HF generate: the PPO test below): 4 steps, eval through the
    same agent (its accuracy and ask rate logged). The log-probs the engine reported for the trained tokens are the
    trainer's to float32 rounding (the gap other vLLM tests allow)."""
    proc = run_script("grpo.py", *TOOL, *tool_data, "--pretrain", policy, "--vllm", "--save_path", tmp_path / "g")
    log = proc.stdout + proc.stderr
    res = results(tmp_path / "g")
    assert res["steps"] == 4 and "eval_accuracy" in res and "eval_asked" in res and res["eval_turns"] >= 1
    assert 1 <= last_logged(log, "turns") <= last_logged(log, "turns_max") <= 2
    assert last_logged(log, "samples") >= 1
    lines = [x for x in log.splitlines() if x.startswith("train step")]
    assert len(lines) == 4 and all(abs(float(x.split(" engine_logprob_gap=")[1].split()[0])) < 1e-4 for x in lines)


SPLITS_ON_RANK_1 = '''
import os


async def rollout(client, record):
    ask = lambda text: client.chat.completions.create(model="policy", messages=[{"role": "user", "content": text}])
    first = await ask(record["prompt"])
    if os.environ["RANK"] == "1":  # a second conversation of its own: not a continuation, so a second sample
        await ask("11+x=")
    return float(len(first.choices[0].message.content) % 2)
'''


def test_ppo_over_two_ranks_whose_episodes_split_differently(policy, tool_data, tmp_path, monkeypatch):
    """ppo.py over two ZeRO-2 ranks: rank 0's episodes give one sample each, rank 1's two. Both step DeepSpeed
    equally often (as many micro-batches as their episodes make): the run finishes, logging 5/3 samples an episode
    on the mean over both ranks' samples. ZeRO-3 over several processes (every forward collective, so every rank
    would need as many samples) is refused in one line before any model loads."""
    path = agent_file(tmp_path, SPLITS_ON_RANK_1, "splits.py")
    flags = [*TOOL[:-1], path, *tool_data, "--eval_dataset", ""]
    proc = run_script("ppo.py", *flags, "--pretrain", policy, "--zero_stage", 2, "--save_path", tmp_path / "p",
                      nproc=2, timeout=900)
    log = proc.stdout + proc.stderr
    assert results(tmp_path / "p")["steps"] == 4 and last_logged(log, "turns_max") == 2
    # a mean over samples: rank 0's N of 1 sample an episode, rank 1's 2N of 2
    assert last_logged(log, "samples") == pytest.approx(5 / 3, abs=1e-3) and math.isfinite(last_logged(log, "kl"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    proc = run_main("ppo.py", *flags, "--pretrain", policy, "--zero_stage", 3, check=False)
    assert "--agent_server with --zero_stage 3 over several processes is not supported" in \
        proc.stderr.strip().splitlines()[-1]
