"""--partial_rollout (grpo.py, ppo.py with --ray --async_steps N): in-flight weight updates. Each Ray engine generates
continuously, batch after batch, and takes new weights between two decoding steps: no batch waits for another's
longest sample, and no weight sync waits for a batch. engines.start reaches this module under the flag.

Who waits for whom (one engine, N = 1; a batch ends when its longest sample does):
  --async_steps 1    engine   [batch t+1 ......... straggler][sync t][batch t+2 ......... straggler][sync t+1]
                     trainer  [update t][sync t: waits for batch t+1 ...][update t+1][sync t+1: waits ...]
  --partial_rollout  engine   [batch t+1 ....|sync t|..... straggler]
                                          [batch t+2 .....|sync t+1|.... straggler]    (side by side)
                     trainer  [update t][sync t][waits][update t+1][sync t+1][waits] ...

A sync while requests are generating (AReaL's interruptible rollout, SkyRL's abort-and-continue): the engine aborts
them, loads the weights and submits each again as its prompt plus the tokens it has, with the rest of its budget; the
new weights prefill that text again, so every token after the sync is sampled from exactly the new policy (PipelineRL
keeps the KV cache computed by the old weights instead: no prefill, but later tokens attend to stale keys and values).
Each token carries the version of the weights that sampled it and its engine log-prob, so the rollout correction
(--rollout_correction) weighs each by pi_trainer / pi_engine across the versions inside one sample.

Staleness is bounded at admission, as in AReaL: batch t's requests enter an engine only after the trainer's sync of
step t - N - 1 (engines.Producer's permits), so when trained on, a sample's oldest token is at most N versions old;
no sample is dropped or generated again. Logged (engines.ray_logs): staleness_max (the oldest token's age),
token_age, tokens_age_K, spanning_sync, engine_idle_s.
"""

import itertools
import queue
import threading
import time
from dataclasses import dataclass, field

import ray
import torch
import torch.distributed as dist

import engines


@dataclass
class Request:
    """One sample in an engine: where its batch wants it, what was asked, what it has so far."""
    batch: str
    index: int
    prompt: list
    budget: int  # new tokens in all, across syncs
    sampling: dict
    tokens: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # each token's log-prob under the weights that sampled it
    versions: list = field(default_factory=list)  # the trainer step of those weights
    turn: int = 0  # times submitted again after a sync (part of its vLLM request id)


class InflightEngine(engines.RayEngine):
    """The Ray actor: one loop thread owns the vLLM engine and steps it while any request is unfinished, taking
    commands (a batch's requests, new weights) between two steps. The actor is threaded (InflightEngines.options):
    submit, collect and receive_weights run beside the loop, which alone touches vLLM."""

    def start(self):
        super().start()
        self.commands, self.live, self.batches, self.error = queue.Queue(), {}, {}, None
        self.idle_s, self.idle_told, self.lock = 0.0, 0.0, threading.Lock()  # idle_s: the loop's alone
        self.idle_since = time.time()
        threading.Thread(target=self.loop, name="inflight-engine", daemon=True).start()

    def submit(self, batch, prompts, sampling):
        """Queue a batch's requests (sampling: engines.vllm_sampling's) and return; collect(batch) waits for them."""
        if self.error:
            raise RuntimeError(self.error)
        self.batches[batch] = {"done": threading.Event(), "left": len(prompts), "out": [None] * len(prompts)}
        if not prompts:  # a rank with nothing to sample this round
            self.batches[batch]["done"].set()
        self.commands.put(("add", batch, prompts, sampling))

    def collect(self, batch):
        """-> ([(tokens, logprobs, versions) per sample], seconds the engine was not generating since the last
        collect) once the batch's last request has ended."""
        state = self.batches[batch]
        while not state["done"].wait(1.0) and not self.error:
            pass
        del self.batches[batch]
        if self.error:
            raise RuntimeError(self.error)
        with self.lock:
            idle, self.idle_told = self.idle_s - self.idle_told, self.idle_s
        return state["out"], idle

    @ray.method(concurrency_group="weights")  # never queued behind the collect() calls waiting on batches
    def receive_weights(self, specs, version):
        """The broadcast is received in this thread while the loop generates; the loop loads it between two steps."""
        tensors = self.receive(specs)
        if torch.cuda.is_available():  # NCCL's wait() orders this thread's stream only: the loop runs on its own
            torch.cuda.current_stream().synchronize()
        self.commands.put(("load", tensors, version))

    def loop(self):
        engine = self.llm.llm_engine
        try:
            while True:
                if not engine.has_unfinished_requests():  # nothing to generate: wait for work
                    command = self.commands.get()
                    self.idle_s += time.time() - self.idle_since
                    self.run(command)
                while not self.commands.empty():  # between two decoding steps
                    self.run(self.commands.get())
                if engine.has_unfinished_requests():
                    for out in engine.step():
                        self.record(out)
                self.idle_since = time.time()
        except BaseException as e:  # every waiting collect() raises it, in one line
            self.error = " ".join(f"{type(e).__name__}: {e}".split())[:400]
            for state in self.batches.values():
                state["done"].set()

    def run(self, command):
        if command[0] == "add":
            _, batch, prompts, sampling = command
            limits = sampling.pop("max_tokens")
            for i, (prompt, limit) in enumerate(zip(prompts, limits if isinstance(limits, list) else
                                                    [limits] * len(prompts))):
                self.add(Request(batch, i, list(prompt), limit, sampling))
            return
        _, tensors, version = command  # new weights: the live requests go on under them, prefilled again
        t, going = time.time(), list(self.live.values())
        self.llm.llm_engine.abort_request(list(self.live))
        self.live = {}
        self.load_weights(tensors)
        self.version = version
        for request in going:
            request.turn += 1
            self.add(request)
        self.idle_s += time.time() - t  # loading weights is not generating

    def add(self, request):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        rid = f"{request.batch}/{request.index}/{request.turn}"
        self.live[rid] = request
        # LLM.generate's own way in, with every step's new tokens out (DELTA): a sync may come before the last one
        prompt = self.llm._preprocess_cmpl_one(TokensPrompt(prompt_token_ids=request.prompt + request.tokens))
        self.llm.llm_engine.add_request(
            rid, prompt, SamplingParams(detokenize=False, max_tokens=request.budget - len(request.tokens),
                                        output_kind=RequestOutputKind.DELTA, **request.sampling))

    def record(self, out):
        """A step's new tokens of one request, tagged with the version that sampled them; a finished request goes to
        its batch, and the batch to collect() when it was the last."""
        request, new = self.live[out.request_id], out.outputs[0]
        request.tokens += new.token_ids
        request.logprobs += [d[t].logprob for d, t in zip(new.logprobs, new.token_ids)]
        request.versions += [self.version] * len(new.token_ids)
        if not out.finished:
            return
        del self.live[out.request_id]
        state = self.batches[request.batch]
        state["out"][request.index] = (torch.tensor(request.tokens, dtype=torch.long),
                                       torch.tensor(request.logprobs, dtype=torch.float64),
                                       torch.tensor(request.versions, dtype=torch.long))
        state["left"] -= 1
        if not state["left"]:
            state["done"].set()


class InflightEngines(engines.RayEngines):
    """The trainer's side: sample() queues a batch on this rank's engine, tells the Producer (engines.submitted), and
    waits for it; the Producer's threads wait on several batches at once."""
    # the engine's calls run beside its loop: a collect() per batch in flight (each rank's N + 1, and an eval's)
    actor, options = InflightEngine, {"max_concurrency": 64, "concurrency_groups": {"weights": 1}}

    def __init__(self, args, model, tokenizer):
        super().__init__(args, model, tokenizer)
        self.batch_ids = itertools.count(1)  # next() is atomic: the Producer's threads each take their own

    def sample(self, records, temperature, max_new_tokens=None):
        """-> {"responses", "logprobs", "versions": each token's version, "version": the oldest, "idle_s"}."""
        engine = self.engines[dist.get_rank() % len(self.engines)]
        batch = f"{dist.get_rank()}.{next(self.batch_ids)}"
        limits = max_new_tokens or [self.args.generate_max_len] * len(records)
        self.answer(engine.submit.remote(batch, [torch.as_tensor(r["ids"]).tolist() for r in records],
                                         engines.vllm_sampling(self.eos, temperature, self.args.top_p, limits)))
        engines.submitted()
        out, idle = self.answer(engine.collect.remote(batch))
        tokens, logprobs, versions = map(list, zip(*out)) if out else ([], [], [])
        oldest = min((v.min().item() for v in versions if len(v)), default=None)
        return {"responses": tokens, "logprobs": logprobs, "versions": versions, "version": oldest, "idle_s": idle}
