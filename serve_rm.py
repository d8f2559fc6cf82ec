"""A reward-model server speaking OpenRLHF's /get_reward API, with batching across concurrent requests.

    python serve_rm.py --reward_pretrain runs/rm                       # 127.0.0.1:5000
    python serve_rm.py --reward_pretrain runs/prm --rm_type prm --prm_reduce min
    RM_API_KEY=secret python serve_rm.py --reward_pretrain ckpt/rm --host 0.0.0.0 --bf16 --max_len 4096

    curl -s 127.0.0.1:5000/get_reward -d '{"query": ["<s>07+45=52</s>"], "prompts": ["<s>07+45="]}'
    -> {"rewards": [1.23], "scores": [1.23], "extra_logs": {"dummy_scores": [1.23]}}
    (a query as an RL trainer sends it: prompt + completion decoded with their special tokens, the tokenizer's BOS
    first; the server adds none, so a text without it is not what the model was trained on)

API
  POST /get_reward  {"query": [str, ...], "prompts": [...]?, "labels": [...]?} (what OpenRLHF's trainer sends), or
                    {"messages": [[{"role": ..., "content": ...}, ...], ...]} (rendered with the model's chat
                    template). Reply: "rewards" and "scores" (the same floats, in request order; current OpenRLHF
                    clients read "scores", older ones "rewards"), "extra_logs" (OpenRLHF's "dummy_scores": the same
                    again, which its trainer logs); with --rm_type prm also "step_rewards" (per-step probabilities).
  GET /health       200 once the model is loaded, 503 before.
  GET /info         model, kind, max_len and batching limits.
Bad requests get a 4xx naming the field (invalid JSON 400, auth 401, too large 413, bad fields 422), never a
traceback. With --api_key (or $RM_API_KEY) every request needs "Authorization: Bearer <key>". Request contents are
never logged unless --log_requests.

Reward kinds (--rm_type):
  seq_cls          a sequence classifier (rm.py's output, any HF *ForSequenceClassification RM) read at the EOS
                   that ends each query, as rm.py trains; --normalize_reward uses the mean/std in its config
  causal_lm_token  a causal LM's logit of --reward_token_id at the position after the query
  prm              a prm.py model: P(first reward token) at every step placeholder, reduced per query with
                   --prm_reduce. An RL trainer's query (with its "prompts" entry) gets one after each step of its
                   completion, the steps the trainer counts (process_rewards.py's contract: prm_query); a query
                   without a prompt that holds placeholders is prm.py's data form, scored as sent

What is scored (seq_cls), so that rm.py's models score as trained and OpenRLHF's trainer gets what OpenRLHF's own
serve_rm (0.11) gives it: the query as sent, no special token added (a BOS only if its text has one: trainers send
sequences decoded with their special tokens), pads/eos at either end dropped and one EOS appended (tokenize); 'messages'
rendered with the chat template first, exactly as rm.py tokenizes a conversation. One difference from OpenRLHF: a
response cut at the length limit (no EOS) is read at an appended EOS, not at its last token, the only token a
reward model trained on EOS-terminated pairs has learnt to score. The other kinds score the text as sent.

How it is fast: requests are tokenized on arrival and queued; one worker thread (Batcher) runs everything queued,
sorted by length (less padding), in batches of at most --max_batch_tokens padded tokens (a huge request is split the
same way), while the event loop keeps accepting requests.
"""

import argparse
import asyncio
import hmac
import json
import os
import queue
import threading
import time
from contextlib import asynccontextmanager

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, StrictStr, ValidationError, model_validator
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

import common


# -------------------------------------------------------------------------------------------- requests
class Message(BaseModel):
    role: StrictStr
    content: StrictStr


class RewardRequest(BaseModel):
    """What a client may send: OpenRLHF's fields, or chat messages. Unknown fields are ignored."""
    model_config = ConfigDict(extra="ignore")
    query: list[StrictStr] | None = None
    prompts: list[StrictStr] | None = None
    labels: list | None = None
    messages: list[list[Message]] | None = None

    @model_validator(mode="after")
    def one_batch(self):
        if (self.query is None) == (self.messages is None):
            raise ValueError("send exactly one of 'query' (strings) and 'messages' (chat conversations)")
        n = len(self.query if self.query is not None else self.messages)
        if n == 0:
            raise ValueError("'query'/'messages' is empty")
        for name in ("prompts", "labels"):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(f"'{name}' has {len(value)} items for {n} queries")
        return self


def error(status, message):
    return JSONResponse({"error": message}, status_code=status)


async def read_body(request: Request, limit):
    """The raw body, or None when it is larger than `limit` bytes (checked while it streams in)."""
    if int(request.headers.get("content-length") or 0) > limit:
        return None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


# ------------------------------------------------------ prm: steps, by copies of prm.py's rules (tests compare them)
REDUCE = {"min": min, "last": lambda s: s[-1], "mean": lambda s: sum(s) / len(s)}  # --prm_reduce: steps -> one reward


def steps_of(text, separator):
    """The steps of a solution's text: its pieces between separators, blank pieces not counted, at least one (the
    whole text). -> (the indices of the step pieces, the pieces)."""
    pieces = text.split(separator)
    steps = [i for i, p in enumerate(pieces) if p.strip()]
    return steps or [len(pieces) - 1], pieces


def completion_text(text, tokenizer):
    """What the step contract reads of a completion decoded with its special tokens (as a /get_reward query carries
    it): every special token's text removed, so a BOS or EOS inside it, its stop token and pads are no step. The
    trainer (process_rewards.step_ends), a local PRM judge and this server all read this text: the same steps."""
    specials = set(tokenizer.all_special_tokens) | {t.content for t in tokenizer.added_tokens_decoder.values()
                                                    if t.special}
    for token in sorted(specials, key=len, reverse=True):  # "<|im_end|>" before a shorter token inside it
        text = text.replace(token, "")
    return text


def with_placeholders(text, separator, placeholder):
    """A solution as prm.py's data has it: the placeholder after every step ("07+45=52 ки\n..."). One the text holds
    already (a policy may write it) is dropped (it would read as one more step end); the steps stay the text's own."""
    steps, pieces = steps_of(text, separator)
    pieces = [p.replace(placeholder, "") for p in pieces]
    for i in steps:
        pieces[i] = pieces[i].rstrip() + " " + placeholder
    return separator.join(pieces)


def check_saved(config, tokenizer, path):
    """A saved PRM as a judge: its config names the placeholder and two reward tokens (text from the tokenizer where
    it has only their ids), each still one token of its tokenizer; else one line saying what is wrong."""
    if getattr(config, "placeholder_token_id", None) is None:
        common.fail(f"{path} has no placeholder_token_id in its config: not a prm.py model")
    if len(config.reward_token_ids) != 2 or len(set(config.reward_token_ids)) != 2:
        common.fail(f"{path}: reward_token_ids {config.reward_token_ids} must be two distinct tokens (good, bad)")
    if getattr(config, "placeholder_token", None) is None:  # a config with the ids alone: the tokens' own text
        config.placeholder_token = tokenizer.decode([config.placeholder_token_id])
    if getattr(config, "reward_tokens", None) is None:
        config.reward_tokens = [tokenizer.decode([i]) for i in config.reward_token_ids]
    for token, want in [(config.placeholder_token, config.placeholder_token_id),
                        *zip(config.reward_tokens, config.reward_token_ids)]:
        ids = tokenizer(token, add_special_tokens=False)["input_ids"]
        if ids != [want] and tokenizer.convert_tokens_to_ids(token) != want:  # (sentencepiece: a lone "▁+")
            common.fail(f"{path}: {token!r} encodes to {ids} in its tokenizer, not to the one token {want} its config "
                        "names (a PRM reads its judgement at one token)")


# ---------------------------------------------------------------------------------------------- model
def pad_batch(seqs, pad_value):
    """1-D LongTensors -> (ids [B, T] right-padded, mask [B, T] 1 on real tokens): the scripts' padded
    batch_sequences without positions (a classifier's forward makes them from the mask; tests compare the copies)."""
    ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=pad_value)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(s) for s in seqs], batch_first=True)
    return ids, mask


def strip_ends(text, tokenizer):
    """Drop pad/eos tokens at either end of the text (OpenRLHF's trainer may send left/right padded
    decodes), and whitespace after the last of them (a chat template's "\n" after its end-of-turn token)."""
    ends = [t for t in (tokenizer.pad_token, tokenizer.eos_token) if t]
    while (head := next((t for t in ends if text.startswith(t)), None)) is not None:
        text = text[len(head):]
    while (tail := next((t for t in ends if text.rstrip().endswith(t)), None)) is not None:
        text = text.rstrip()[:-len(tail)]
    return text


def prm_query(query, prompt, tokenizer, placeholder, separator):
    """prm: an RL trainer's query (prompt + completion, its entry in "prompts") gets the placeholder after each step
    of its completion, by the trainer's own rule (completion_text, with_placeholders). A query without a prompt
    (none, or "") that holds placeholders is prm.py's data form, scored as sent; one without either is all
    completion but its leading BOS."""
    if not prompt and placeholder in query:
        return query
    head = prompt if prompt and query.startswith(prompt) else ""
    if not head and tokenizer.bos_token and query.startswith(tokenizer.bos_token):
        head = tokenizer.bos_token
    return head + with_placeholders(completion_text(query[len(head):], tokenizer), separator, placeholder)


def tokenize(text, tokenizer, args):
    """Token ids as scored, no special token added (a BOS only where the text has one, as OpenRLHF's serve_rm).
    seq_cls: the text without its end pads/eos (strip_ends), then the one EOS the reward is read at (kept when
    truncating to --max_len). The other kinds: the text as is, truncated from the left, keeping its end."""
    text = strip_ends(text, tokenizer) if args.rm_type == "seq_cls" else text
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if args.rm_type != "seq_cls":
        return ids[-args.max_len:]
    ids = ids if ids and ids[-1] == tokenizer.eos_token_id else ids + [tokenizer.eos_token_id]
    return ids[:args.max_len - 1] + [tokenizer.eos_token_id] if len(ids) > args.max_len else ids


@torch.no_grad()
def step_probabilities(model, seqs, pad_id):
    """A saved PRM's judgement of token sequences (1-D tensors, one padded forward): for each, the probability of
    the first reward token (good) at every placeholder, as prm.py's prm_loss trained it (a copy of prm.py's)."""
    cfg, device = model.config, next(model.parameters()).device
    ids, mask = pad_batch(list(seqs), pad_id)
    ids, mask = ids.to(device), mask.to(device)
    hidden, _ = common.forward_hidden(model, dict(input_ids=ids, attention_mask=mask))
    at = (ids == cfg.placeholder_token_id) & mask.bool()  # the judged positions: logits there only, not [B, T, V]
    probs = torch.softmax(common.output_layer(model)(hidden[at])[:, cfg.reward_token_ids].float(), -1)[:, 0]
    return [p.tolist() for p in probs.split(at.sum(-1).tolist())]


@torch.no_grad()
def score_batch(model, batch, args, pad_id):
    """One padded forward over token-id lists -> a float per sequence (prm: a list of step probabilities)."""
    seqs = [torch.tensor(b) for b in batch]
    if args.rm_type == "prm":  # P(good) at each placeholder
        return step_probabilities(model, seqs, pad_id)
    device = next(model.parameters()).device
    ids, mask = (t.to(device) for t in pad_batch(seqs, pad_id))
    if args.rm_type == "seq_cls":
        rewards = model(input_ids=ids, attention_mask=mask).logits[:, 0].float()
        return ((rewards - args.mean) / args.std).tolist()
    # causal_lm_token: only each sequence's last real token (right padding) reaches the LM head, not all T of them
    keep, col = torch.unique(mask.sum(-1) - 1, return_inverse=True)  # a 1-D index: what every model's forward takes
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=keep).logits
    return logits[torch.arange(len(batch)), col, args.reward_token_id].float().tolist()


def head_hint(config):
    """What serves a model without a score head (the end of load_model's one line refusing it as seq_cls)."""
    if getattr(config, "placeholder_token_id", None) is not None:
        return "it is a prm.py model: --rm_type prm serves it"
    return ("a reward model (rm.py's) is a sequence classifier; a causal LM scored by one token's logit: --rm_type "
            "causal_lm_token --reward_token_id ID; a prm.py model: --rm_type prm")


def load(args):
    """Tokenizer and model (eval mode), with what the reward kind needs checked up front."""
    tokenizer = common.load_tokenizer(args.reward_pretrain, args)
    kwargs = {"model_class": AutoModelForSequenceClassification, "num_labels": 1, "head_hint": head_hint} \
        if args.rm_type == "seq_cls" else {"model_class": AutoModelForCausalLM}
    if torch.cuda.is_available() and not args.load_in_4bit:  # bitsandbytes places 4-bit weights itself
        kwargs["device_map"] = "cuda"  # loaded straight onto the GPU, not first into CPU memory
    model = common.load_model(args.reward_pretrain, args, tokenizer, trainable=False, **kwargs).eval()
    if args.rm_type == "prm":
        check_saved(model.config, tokenizer, args.reward_pretrain)
    if args.rm_type == "causal_lm_token" and args.reward_token_id is None:
        common.fail("--rm_type causal_lm_token needs --reward_token_id")
    if args.rm_type == "causal_lm_token" and args.reward_token_id >= model.config.vocab_size:
        common.fail(f"--reward_token_id {args.reward_token_id}: {args.reward_pretrain}'s vocabulary has "
                    f"{model.config.vocab_size} tokens")
    args.mean, args.std = 0.0, 1.0
    if args.normalize_reward:
        args.mean, args.std = getattr(model.config, "mean", 0.0), getattr(model.config, "std", 1.0)
    return tokenizer, model


class Batcher:
    """One worker thread owns the model. Jobs (a request's token-id lists and a future) are merged with whatever else
    arrives within --max_wait_ms, run longest first in batches of at most --max_batch_tokens padded tokens; each
    future gets its results in its own order."""

    def __init__(self, model, args, pad_id):
        self.model, self.args, self.pad_id = model, args, pad_id
        self.jobs = queue.Queue()
        self.in_flight = 0  # requests the server is handling; no waiting for company when alone
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    async def score(self, seqs):
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.jobs.put((seqs, future, loop))
        return await future

    def run(self):
        while True:
            jobs = [self.jobs.get()]
            deadline = time.monotonic() + self.args.max_wait_ms / 1000
            tokens = sum(len(s) for s in jobs[0][0])
            while (tokens < self.args.max_batch_tokens and self.in_flight > len(jobs)
                   and (wait := deadline - time.monotonic()) > 0):
                try:
                    jobs.append(self.jobs.get(timeout=wait))
                    tokens += sum(len(s) for s in jobs[-1][0])
                except queue.Empty:
                    break
            items = sorted(((len(s), j, i) for j, (seqs, _, _) in enumerate(jobs) for i, s in enumerate(seqs)),
                           reverse=True)
            results = [[None] * len(seqs) for seqs, _, _ in jobs]
            try:
                start = 0
                while start < len(items):  # longest first: the batch width is its first sequence's length
                    n = max(1, self.args.max_batch_tokens // items[start][0])
                    chunk = items[start:start + n]
                    for (_, j, i), r in zip(chunk, score_batch(self.model, [jobs[j][0][i] for _, j, i in chunk],
                                                               self.args, self.pad_id)):
                        results[j][i] = r
                    start += n
                for (_, future, loop), r in zip(jobs, results):
                    loop.call_soon_threadsafe(future.set_result, r)
            except Exception as e:  # e.g. out of memory: these requests fail, the server lives on
                for _, future, loop in jobs:
                    loop.call_soon_threadsafe(future.set_exception, e)


# ---------------------------------------------------------------------------------------------- app
async def request_texts(request: Request, args, state):
    """The texts a /get_reward body asks to score, or the error response for it. The body is checked before
    readiness, so a bad request gets its 4xx even while the model loads (`state` has no batcher yet)."""
    body = await read_body(request, int(args.max_body_mb * 2**20))
    if body is None:
        return error(413, f"body larger than --max_body_mb {args.max_body_mb}")
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return error(400, f"invalid JSON: {e}")
    if not isinstance(data, dict):
        return error(422, f"body: expected a JSON object, got {type(data).__name__}")
    try:
        req = RewardRequest.model_validate(data)
    except ValidationError as e:  # one line naming each field, e.g. "query.2: Input should be a valid string"
        return error(422, "; ".join(f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']}" for err in e.errors()))
    n = len(req.query if req.query is not None else req.messages)
    if n > args.max_texts:
        return error(413, f"{n} texts, more than --max_texts {args.max_texts}")
    if "batcher" not in state:
        return error(503, "loading the model")
    if req.messages is None:
        return req.query if args.rm_type != "prm" else [
            prm_query(q, p, state["tokenizer"], state["placeholder"], args.step_separator)
            for q, p in zip(req.query, req.prompts or [None] * n)]
    tokenizer = state["tokenizer"]
    if not tokenizer.chat_template:
        return error(422, "messages: this model's tokenizer has no chat template; send 'query'")
    try:
        return [tokenizer.apply_chat_template([m.model_dump() for m in conv], tokenize=False) for conv in req.messages]
    except Exception as e:  # a template may reject a role order, say
        return error(422, f"messages: the chat template refused them ({type(e).__name__}: {e})")


def create_app(args):
    state = {}

    def load_in_background():
        try:
            start = time.time()
            tokenizer, model = load(args)
            state.update(tokenizer=tokenizer, batcher=Batcher(model, args, tokenizer.pad_token_id),
                         placeholder=getattr(model.config, "placeholder_token", None))
            common.console.print(f"serve_rm: model loaded in {time.time() - start:.1f} s; ready", markup=False)
        except SystemExit as e:  # a clear load error: say it and stop the server
            common.console.print(str(e), markup=False)
            os._exit(1)
        except Exception as e:  # anything else would leave /health at 503 for ever
            common.console.print(f"serve_rm: loading {args.reward_pretrain} failed: {type(e).__name__}: {e}",
                                 markup=False)
            os._exit(1)

    @asynccontextmanager
    async def lifespan(app):
        common.console.print(
            f"serve_rm: {args.reward_pretrain} ({args.rm_type}, {'bf16' if args.bf16 else 'fp32'}) on "
            f"http://{args.host}:{args.port}, auth {'on' if args.api_key else 'off'}; loading the model "
            "(/health answers 503 until it is ready)", markup=False)
        threading.Thread(target=load_in_background, daemon=True).start()  # /health answers meanwhile
        yield

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if args.api_key:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {args.api_key}".encode()):
                return error(401, "missing or wrong 'Authorization: Bearer <key>' header")
        try:
            return await call_next(request)
        except Exception as e:  # never a traceback to the client; the type goes to our log
            common.console.print(f"internal error on {request.url.path}: {type(e).__name__}", markup=False)
            return error(500, "internal error")

    @app.get("/health")
    async def health():
        return {"status": "ok"} if "batcher" in state else error(503, "loading the model")

    @app.get("/info")
    async def info():
        return {"model": args.reward_pretrain, "rm_type": args.rm_type, "max_len": args.max_len,
                "max_batch_tokens": args.max_batch_tokens, "max_wait_ms": args.max_wait_ms,
                "max_texts": args.max_texts, "max_body_mb": args.max_body_mb, "ready": "batcher" in state}

    @app.post("/get_reward")
    async def get_reward(request: Request):
        texts = await request_texts(request, args, state)
        if isinstance(texts, JSONResponse):
            return texts
        if args.log_requests:
            common.console.print(f"get_reward {json.dumps(texts)[:2000]}", markup=False)
        batcher = state["batcher"]
        batcher.in_flight += 1
        try:
            results = await batcher.score([tokenize(t, state["tokenizer"], args) for t in texts])
        finally:
            batcher.in_flight -= 1
        if args.rm_type != "prm":
            return {"rewards": results, "scores": results, "extra_logs": {"dummy_scores": results}}
        reduce = REDUCE[args.prm_reduce]
        rewards = [reduce(steps) if steps else 0.0 for steps in results]
        return {"rewards": rewards, "scores": rewards, "step_rewards": results, "extra_logs": {"dummy_scores": rewards}}

    return app


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.error = common.fail  # one line, not the usage block
    a = p.add_argument
    a("--reward_pretrain", required=True, help="the reward model: a local directory or a hub name")
    a("--rm_type", default="seq_cls", choices=("seq_cls", "causal_lm_token", "prm"))
    a("--reward_token_id", type=common.ranged(int, 0), default=None,
      help="causal_lm_token: the token whose logit is the reward")
    a("--prm_reduce", default="min", choices=("min", "last", "mean"), help="prm: one reward from the steps")
    a("--step_separator", default="\n", help="prm: what ends a step of a query sent without placeholders")
    a("--normalize_reward", action="store_true", help="seq_cls: (r - mean) / std with the config's mean/std")
    a("--max_len", type=common.ranged(int, 1), default=2048, help="longest sequence scored (longer ones are truncated)")
    a("--bf16", action="store_true")
    a("--flash_attn", action="store_true")
    a("--load_in_4bit", action="store_true", help="bitsandbytes 4-bit weights (GPU)")
    a("--trust_remote_code", action="store_true")
    a("--host", default="127.0.0.1", help="0.0.0.0 to accept other machines (set --api_key then)")
    a("--port", type=common.ranged(int, 0, 65535), default=5000)
    a("--api_key", default=os.environ.get("RM_API_KEY"), help="require 'Authorization: Bearer KEY' (or $RM_API_KEY)")
    a("--max_batch_tokens", type=common.ranged(int, 1), default=None,
      help="padded tokens per forward (default 16384 on GPU; 2048 on CPU, where big batches ran slower)")
    a("--max_wait_ms", type=common.ranged(float, 0, 1e6), default=5.0,
      help="how long the worker waits for more requests to batch")
    a("--max_body_mb", type=common.ranged(float, 0, 1e6, lo_open=True), default=16.0)
    a("--max_texts", type=common.ranged(int, 1), default=4096, help="texts per request")
    a("--log_requests", action="store_true", help="log request texts and the access log (off: nothing of them)")
    common.quiet_libraries()
    args = p.parse_args()
    args.max_batch_tokens = args.max_batch_tokens or (16384 if torch.cuda.is_available() else 2048)
    if args.bf16:
        import speedups  # --bf16 on a CPU: what emulated bf16 costs here
        speedups.warn_if_slow_bf16()
    uvicorn.run(create_app(args), host=args.host, port=args.port, log_level="warning",
                access_log=args.log_requests, timeout_graceful_shutdown=30)


if __name__ == "__main__":
    main()
