"""serve_rm.py as a real server on 127.0.0.1 in a subprocess: rewards equal offline scoring of the same
model with stock classes, in order, under concurrent load; OpenRLHF's payloads; chat messages; each reward
kind; malformed bodies get a 4xx and leave the server alive; auth; /health before and after loading."""
import asyncio
import json
import random
import subprocess
import sys
import time

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

import common
from conftest import ROOT


@pytest.fixture(scope="module")
def models(toy_world, tmp_path_factory):
    """Untrained toy reward models of each kind (the server must reproduce whatever they compute)."""
    root = tmp_path_factory.mktemp("serve")
    tok = AutoTokenizer.from_pretrained(toy_world / "model")
    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_pretrained(toy_world / "model", num_labels=1)
    rm.config.mean, rm.config.std = 0.5, 2.0
    rm.save_pretrained(root / "seq_cls")
    tok.save_pretrained(root / "seq_cls")
    lm = AutoModelForCausalLM.from_pretrained(toy_world / "model")
    lm.config.placeholder_token_id = tok.convert_tokens_to_ids("ки")
    lm.config.reward_token_ids = tok.convert_tokens_to_ids(["+", "-"])
    lm.save_pretrained(root / "lm")
    tok.save_pretrained(root / "lm")
    return root


class Server:
    def __init__(self, *flags, api_key=None):
        self.api_key = api_key
        self.port = common.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "serve_rm.py"), "--port", str(self.port),
                                      *map(str, flags), *(["--api_key", api_key] if api_key else [])], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.health = []  # every /health status seen until ready
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                code = httpx.get(self.url + "/health", timeout=2, headers=self.auth()).status_code
                self.health.append(code)
                if code == 200:
                    return
            except httpx.TransportError:
                pass
            assert self.proc.poll() is None, self.proc.stdout.read()
            time.sleep(0.02)
        raise AssertionError("server did not become ready")

    def auth(self):
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def post(self, body, **kw):
        return httpx.post(self.url + "/get_reward", json=body, timeout=60, **kw)

    def close(self):
        """Stop the server; -> what it printed."""
        self.proc.terminate()
        out = self.proc.communicate(timeout=30)[0]
        assert "Traceback" not in out, out
        return out


@torch.no_grad()
def offline_seq_cls(path, texts):
    """The stock classifier on exactly each text's tokens, EOS appended (the token rm.py reads rewards at), no special
    token added: a BOS only where the text has one, as OpenRLHF's serve_rm scores."""
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    return [model(**tok(t + tok.eos_token, add_special_tokens=False, return_tensors="pt")).logits[0, 0].item()
            for t in texts]


def random_text(rng):
    """A sum, right or not, and junk; with the toy's BOS in front or not (the server adds none)."""
    a, b = rng.randrange(100), rng.randrange(100)
    return rng.choice(["", "<s>"]) + f"{a:02d}+{b:02d}={a + b + rng.choice([0, 0, 1])}" + "".join(
        rng.choice("0123456789+=\n ") for _ in range(rng.randrange(0, 60)))


def test_seq_cls_concurrent_requests_match_offline_scoring(models):
    server = Server("--reward_pretrain", models / "seq_cls", "--max_batch_tokens", 512)
    try:
        assert server.health[0] == 503 and server.health[-1] == 200  # answering while the model loads
        rng = random.Random(0)
        bodies = [[random_text(rng) for _ in range(rng.randint(1, 8))] for _ in range(200)]

        async def send_all():
            async with httpx.AsyncClient(timeout=120) as client:
                return await asyncio.gather(*[client.post(server.url + "/get_reward", json={"query": q})
                                              for q in bodies])

        replies = asyncio.run(send_all())
        assert all(r.status_code == 200 for r in replies)
        texts = [t for q in bodies for t in q]
        want = offline_seq_cls(models / "seq_cls", texts)
        got = [x for r in replies for x in r.json()["rewards"]]
        assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5 and len(got) == len(want) == len(texts)
        assert all(r.json()["scores"] == r.json()["rewards"] == r.json()["extra_logs"]["dummy_scores"] for r in replies)
        # OpenRLHF's trainer payload: decoded sequences with pad/eos around them, prompts and labels
        tok = AutoTokenizer.from_pretrained(models / "seq_cls")
        noisy = [tok.pad_token * 3 + t + tok.eos_token + tok.pad_token * 2 for t in texts[:5]]
        r = server.post({"query": noisy, "prompts": [t[:6] for t in texts[:5]], "labels": ["x"] * 5})
        assert r.status_code == 200 and max(abs(a - b) for a, b in zip(r.json()["rewards"], want[:5])) <= 1e-5
        # chat messages, rendered with the model's template
        conv = [{"role": "user", "content": "07+45="}, {"role": "assistant", "content": "52"}]
        r = server.post({"messages": [conv]})
        assert r.status_code == 200
        # as rm.py renders a conversation: the template's text (it ends "...A:52</s>\n"), stripped, no
        # second BOS, one EOS at the end
        ids = tok(tok.apply_chat_template(conv, tokenize=False).rstrip(), add_special_tokens=False)["input_ids"]
        assert ids[-1] == tok.eos_token_id and ids.count(tok.bos_token_id) == 1
        with torch.no_grad():
            want = AutoModelForSequenceClassification.from_pretrained(models / "seq_cls")(torch.tensor([ids]))
        assert abs(r.json()["rewards"][0] - want.logits[0, 0].item()) <= 1e-5
        info = httpx.get(server.url + "/info").json()
        assert info["rm_type"] == "seq_cls" and info["ready"] is True
    finally:
        server.close()


def test_normalized_seq_cls_and_auth(models):
    server = Server("--reward_pretrain", models / "seq_cls", "--normalize_reward", api_key="s3cret")
    try:
        assert server.post({"query": ["1+1=2"]}).status_code == 401
        assert server.post({"query": ["1+1=2"]}, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(server.url + "/health").status_code == 401
        r = server.post({"query": ["1+1=2"]}, headers=server.auth())
        assert r.status_code == 200
        raw = offline_seq_cls(models / "seq_cls", ["1+1=2"])[0]
        assert abs(r.json()["rewards"][0] - (raw - 0.5) / 2.0) <= 1e-5  # mean 0.5, std 2 from the config
    finally:
        out = server.close()
    # one line at start-up says what is served where, and one when it is ready; the key itself never
    lines = out.splitlines()
    assert any(f"{models / 'seq_cls'} (seq_cls, fp32) on http://127.0.0.1:{server.port}, auth on" in x for x in lines)
    assert any("model loaded in" in x and "ready" in x for x in lines) and "s3cret" not in out


@torch.no_grad()
def test_causal_lm_token_and_prm(models):
    tok = AutoTokenizer.from_pretrained(models / "lm")
    lm = AutoModelForCausalLM.from_pretrained(models / "lm").eval()
    texts = ["07+45=52", "<s>1+2=3\n3+4=7", "99+1="]
    plus = tok.convert_tokens_to_ids("+")
    server = Server("--reward_pretrain", models / "lm", "--rm_type", "causal_lm_token", "--reward_token_id", plus)
    try:
        got = server.post({"query": texts}).json()["rewards"]
        want = [lm(**tok(t, add_special_tokens=False, return_tensors="pt")).logits[0, -1, plus].item() for t in texts]
        assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5
    finally:
        server.close()
    solutions = ["<s>05+15+07\n05+15=20 ки\n20+07=27 ки", "10+20\n10+20=30 ки", "1+1\nno steps here",
                 "<s>05+15+07\n05+15=20\n20+07=27</s>"]  # an RL trainer's query: its prompt is sent too
    prompts = ["", "", "", "<s>05+15+07\n"]
    server = Server("--reward_pretrain", models / "lm", "--rm_type", "prm", "--prm_reduce", "min")
    try:
        reply = server.post({"query": solutions, "prompts": prompts}).json()
    finally:
        server.close()
    placeholder, reward_ids = lm.config.placeholder_token_id, lm.config.reward_token_ids
    # sent without placeholders: one after each step of the completion (the text after the prompt), as prm.py's data
    scored = solutions[:2] + ["1+1 ки\nno steps here ки", "<s>05+15+07\n05+15=20 ки\n20+07=27 ки"]
    for text, steps, reward in zip(scored, reply["step_rewards"], reply["rewards"]):
        ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        logits = lm(ids).logits[0]
        want = torch.softmax(logits[ids[0] == placeholder][:, reward_ids], -1)[:, 0].tolist()
        assert len(steps) == len(want) and all(abs(a - b) <= 1e-5 for a, b in zip(steps, want))
        # the reward is the server's own steps reduced (exactly), and so within the steps' tolerance of the
        # offline minimum: a batched forward and a single one round differently in float32 (~1e-7 here)
        assert reward == (min(steps) if steps else 0.0) and abs(reward - (min(want) if want else 0.0)) <= 1e-5


def malformed_bodies(rng, n):
    """Bodies that must each get a 4xx: bad JSON, wrong types, empty or mismatched lists, non-strings..."""
    junk = [None, 1, -3.5, True, "text", [], {}, [1, 2], [None], {"a": 1}, [[["deep"]]], "x" * 50]
    cases = [b"", b"{", b"[1,2", b"\xff\xfe", b"null", b"123", b'"query"', b"[]", b'{"query": }', b"{'query': ['a']}",
             b'{"query": ["a"], "query": 5}', b"NaN"]
    while len(cases) < n:
        kind = rng.randrange(8)
        q = [rng.choice(["07+45=52", "1+1=2"]) for _ in range(rng.randint(1, 4))]
        if kind == 0:
            body = {"query": rng.choice(junk[:6] + junk[7:])}
        elif kind == 1:
            body = {"query": q[:-1] + [rng.choice([None, 1, 2.5, True, [], {}, ["a"]])]}
        elif kind == 2:
            body = {"query": q, "prompts": q + ["extra"] * rng.randint(1, 3)}
        elif kind == 3:
            body = {"query": q, "labels": q[:-1] or []} if len(q) > 1 else {"query": q, "labels": []}
        elif kind == 4:
            body = {"messages": rng.choice([[], [[{"role": "user"}]], [[{"content": 1, "role": "user"}]],
                                             [{"role": "user", "content": "x"}], "hi", [[["user", "x"]]]])}
        elif kind == 5:
            body = {"query": q, "messages": [[{"role": "user", "content": "x"}]]}
        elif kind == 6:
            body = rng.choice([{"prompts": q}, {}, {"labels": [1]}, {"query": []}, {"querry": q}])
        else:
            body = {"query": ["1+1=2"] * 60}  # more than --max_texts 50
        cases.append(json.dumps(body).encode())
    return cases


def test_fuzz_malformed_bodies_get_4xx_and_the_server_lives(models):
    server = Server("--reward_pretrain", models / "seq_cls", "--max_texts", 50, "--max_body_mb", 0.01)
    try:
        bodies = malformed_bodies(random.Random(0), 320) + [json.dumps({"query": ["x" * 20000]}).encode()]
        codes = {}
        with httpx.Client(timeout=30) as client:
            for body in bodies:
                r = client.post(server.url + "/get_reward", content=body, headers={"Content-Type": "application/json"})
                codes[r.status_code] = codes.get(r.status_code, 0) + 1
                assert 400 <= r.status_code < 500, (body[:200], r.status_code, r.text)
                assert "Traceback" not in r.text and r.json()["error"]
        assert len(bodies) >= 300 and set(codes) <= {400, 413, 422} and codes.get(413) and codes.get(400)
        assert httpx.get(server.url + "/health").status_code == 200
        assert server.post({"query": ["07+45=52"]}).status_code == 200
    finally:
        server.close()


def test_big_requests_are_split_and_shutdown_drains_in_flight_requests(models):
    """--max_batch_tokens 64: a request of 40 texts runs as many small forwards (never one big one) and
    still matches offline scoring; SIGTERM while requests are in flight lets them finish first."""
    server = Server("--reward_pretrain", models / "seq_cls", "--max_batch_tokens", 64)
    rng = random.Random(1)
    bodies = [[random_text(rng) for _ in range(40)] for _ in range(6)]

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            async def one(q):
                r = await client.post(server.url + "/get_reward", json={"query": q})
                return r, time.time()
            tasks = [asyncio.create_task(one(q)) for q in bodies]
            await asyncio.sleep(0.3)
            signalled = time.time()
            server.proc.terminate()  # SIGTERM
            return await asyncio.gather(*tasks), signalled

    try:
        replies, signalled = asyncio.run(run())
        # uvicorn drains, then re-raises the signal so the exit status still says SIGTERM
        assert server.proc.wait(timeout=60) in (0, -15)
        assert "Traceback" not in server.proc.stdout.read()
        assert all(r.status_code == 200 for r, _ in replies)
        assert any(done > signalled for _, done in replies)  # some were still in flight at the signal
        want = offline_seq_cls(models / "seq_cls", [t for q in bodies for t in q])
        got = [x for r, _ in replies for x in r.json()["rewards"]]
        assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5
    finally:
        if server.proc.poll() is None:
            server.close()
