"""What every script needs and what would be wrong if the copies drifted: args (a script's DEFAULTS table), distributed
helpers, the real-checkpoint tokenizer and loading rules, reading records, the log-probs of response tokens, atomic
saving / resume, logging. Each script holds the rest of its default path (its flags, batches, DeepSpeed set-up, loss);
tests/test_copies.py compares the copies. What a flag adds is a module imported where the flag is handled: packing.py,
lora.py, engines.py, agents.py, process_rewards.py, speedups.py, checkpoints.py, trackers.py. Importing this module sets
one thing: DeepSpeed's accelerator on a machine without CUDA, which must precede DeepSpeed's import."""

import argparse
import atexit
import contextlib
import ctypes
import functools
import gc
import io
import json
import math
import os
import random
import resource
import shutil
import signal
import time
import socket
import sys
import threading
import warnings
from pathlib import Path

import numpy as np
import torch

if not torch.cuda.is_available():  # what DeepSpeed picks on a CPU anyway, minus a warning (and never MPS)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
# a venv we may write to keeps DeepSpeed's CPU op, built once for it: torch's cache is one per user, and the build
# flags hold the venv's paths, so two checkouts' venvs would rebuild it (a minute) at every switch
if sys.prefix != sys.base_prefix and os.access(sys.prefix, os.W_OK):
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))

import deepspeed  # noqa: E402
import torch.distributed as dist
import transformers
from rich.console import Console
from torch.nn.utils.rnn import pad_sequence
from torch.utils.checkpoint import checkpoint
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

console = Console(stderr=True, soft_wrap=True)  # log lines stay whole in files and CI
if not console.is_terminal:  # a file or a pipe has no width to fit: rich's 80 columns would cut the last progress
    console.width = 10_000   # line's figures and fold the sample tables' rows
# at exit, no last garbage-collection sweep over the millions of objects torch (and vLLM) made: 0.5-1.5 s a process.
# What a run writes is closed explicitly; only cyclic garbage goes unfinalised, which Python never promised anyway.
atexit.register(gc.freeze)


def fail(message):
    """Stop with a one-line error for the user (bad input), never a traceback from deep inside."""
    raise SystemExit(f"error: {message}")


# ----------------------------------------------------------------------------------------------- args
def ranged(kind, lo=-math.inf, hi=math.inf, lo_open=False, hi_open=False, also=()):
    """An argparse `type=` parsing `kind` that refuses a value outside [lo, hi] (lo_open / hi_open exclude an end, as an
    infinite one always is) unless one of `also` (sentinels): "0 is outside [1, inf)". NaN is outside every range."""
    lo_open, hi_open = lo_open or lo == -math.inf, hi_open or hi == math.inf
    end = lambda x: str(x) if isinstance(x, int) else f"{x:g}"  # noqa: E731  (2**32 - 1 whole, 1e-06 short)
    allowed = " or ".join([f"{'(['[not lo_open]}{end(lo)}, {end(hi)}{')]'[not hi_open]}", *map(str, also)])

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'} in "
                                             f"{allowed}") from None
        big = kind is int and abs(value) > 2**63 - 1  # (torch's largest integer)
        if big or not ((value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)
                       or value in also):
            raise argparse.ArgumentTypeError(f"{text} is outside {allowed}" + " (integers end at 2**63 - 1)" * big)
        return value
    return parse


def parse_args(parser, defaults):
    """Parse the command line once. `defaults`: the script's table {flag: (a real run's default, the toy world's)};
    the toy world's apply when no --dataset is given ("{toy}" in a value is its directory, built if missing); a flag
    on the command line wins either way. Without --pretrain the model is the toy one."""
    quiet_libraries()
    parser.error = fail  # a bad command line stops with one line, not argparse's usage block
    unset = object()  # what a table's flag not on the command line holds until it is filled in below
    parser.set_defaults(**dict.fromkeys(defaults, unset))
    args = parser.parse_args()
    toy_run = args.dataset in (None, unset)
    if toy_run or args.pretrain is None:
        import toy
        root = str(toy.ensure_toy_world())
        args.pretrain = args.pretrain or f"{root}/model"
    taken = []
    for flag, (real, toy_value) in defaults.items():
        if getattr(args, flag) is unset:
            value = toy_value if toy_run else real
            value = value.replace("{toy}", root) if toy_run and isinstance(value, str) else value
            setattr(args, flag, value)
            taken += [] if value is None else [f"--{flag} {value}"]
    if os.environ.get("RANK", "0") == "0":  # (before init_distributed: the launcher's RANK says who prints)
        why = "no --dataset given" if toy_run else "--dataset given; the toy world's apply only without one"
        console.print(f"defaults: {'the toy world' if toy_run else 'a real run'}'s ({why}; a flag you give wins): "
                      f"{' '.join(taken) or 'none left to fill'}", markup=False)
    if args.bf16:
        import speedups  # --bf16 on a CPU: what emulated bf16 costs here
        speedups.warn_if_slow_bf16()
    if args.load_in_4bit:
        import lora
        lora.check_options(args)
    if args.adam_offload and args.zero_stage == 0:  # DeepSpeedCPUAdam asserts on GPU parameters at the first step
        fail("--adam_offload moves the optimizer state to the CPU through ZeRO: add --zero_stage 1, 2 or 3")
    if args.dataset_probs is not None:
        try:
            args.dataset_probs = [float(p) for p in args.dataset_probs.split(",")]
        except ValueError:
            fail(f"--dataset_probs {args.dataset_probs!r}: expected comma-separated numbers, e.g. 0.7,0.3")
    args.ckpt_path = args.ckpt_path or args.save_path.rstrip("/") + "_checkpoints"
    if Path(args.save_path).resolve() in Path(args.ckpt_path).resolve().parents:
        fail("--ckpt_path must be outside --save_path, which is replaced whole when the model is saved")
    if args.load_checkpoint:
        import checkpoints  # before anything loads: the checkpoint is this run's
        checkpoints.check(args)
    if threading.current_thread() is threading.main_thread():  # (signals are the main thread's)
        signal.signal(signal.SIGINT, functools.partial(interrupted, args))
    return args


def quiet_libraries():
    """A run's (and a Ray engine's), not on import: no download bars, transformers' errors only, no notes that
    torch.distributed names are deprecated (DeepSpeed's, vLLM's scan of every module)."""
    import huggingface_hub
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # for child processes (Ray workers)
    huggingface_hub.utils.disable_progress_bars()
    warnings.filterwarnings("ignore", message=r".*is deprecated. Please use `torch.distributed")
    warnings.filterwarnings("ignore", message=r"`torch.distributed.reduce_op` is deprecated", category=FutureWarning)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


# ---------------------------------------------------------------------------------------- distributed
def free_port(host="127.0.0.1"):
    """A TCP port free on `host` now ("": on every interface)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def local_world_size(world):
    """Processes on this node: torchrun's LOCAL_WORLD_SIZE, the deepspeed launcher's LOCAL_SIZE, else `world`."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", world)))


def init_distributed(args):
    """Works under `deepspeed`, `torchrun` and plain `python` (then as a world of one)."""
    if "RANK" not in os.environ:  # plain python: be rank 0 of 1 instead of falling back to MPI
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    with announce_shm_build():
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo", verbose=False)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        keep_freed_memory()
        if "OMP_NUM_THREADS" not in os.environ:  # the deepspeed launcher leaves every rank all cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size(dist.get_world_size())))
    set_seed(args.seed)
    return dist.get_rank(), dist.get_world_size()


@contextlib.contextmanager
def announce_shm_build():
    """On a CPU, DeepSpeed's init_distributed compiles its shared-memory all-reduce the first time (25-90 s, then
    cached) and print()s "... built successfully" on every start, out of any logger's reach: say what is built before
    a first build (the node's first rank; the others wait on torch's lock), and drop that line."""
    if torch.cuda.is_available() or not deepspeed.ops.__compatible_ops__.get("deepspeed_shm_comm", False):
        yield  # nothing to build
        return
    from torch.utils.cpp_extension import _get_build_directory  # where torch's load() builds (TORCH_EXTENSIONS_DIR)
    cache = Path(_get_build_directory("deepspeed_shm_comm", verbose=False))
    if not (cache / "deepspeed_shm_comm.so").exists() and os.environ.get("LOCAL_RANK", "0") == "0":
        console.print(f"compiling DeepSpeed's shared-memory communication op for this CPU: once, about a minute "
                      f"(cached in {cache})", markup=False)
    try:
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            yield
    finally:
        sys.stdout.write("".join(line for line in printed.getvalue().splitlines(keepends=True)
                                 if "deepspeed_shm_comm_op built successfully" not in line))


def keep_freed_memory():
    """CPU training allocates the same sizes every step; glibc gives freed blocks over 128 KB back to the kernel and the
    next step page-faults them in (3% of the bench's SFT step): keep them; every step reaches the peak RSS anyway."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (macOS, musl): nothing to tune
        return
    libc.mallopt(-1, -1)  # M_TRIM_THRESHOLD: never hand the heap's free top back
    libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: blocks up to 32 MB (glibc's most) come from the reusable heap


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def is_rank0():
    return not dist.is_initialized() or dist.get_rank() == 0


def all_reduce_sum(values, op=dist.ReduceOp.SUM):
    """Sum (or `op`) a list of floats over ranks (metrics: counts, loss sums)."""
    t = torch.tensor(values, dtype=torch.float64, device="cuda" if torch.cuda.is_available() else "cpu")
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=op)
    return t.tolist()


def all_reduce_max(values):
    """The largest of each float over ranks."""
    return all_reduce_sum(values, op=dist.ReduceOp.MAX)


def all_reduce_means(metrics, stds=None):
    """{name: this rank's values (floats or a tensor)} -> {name: the mean of all ranks' values}, and for each of `stds`
    ({name: values}) name_std, their population std (one all-reduce in all). Names with no values are left out."""
    values = [v.flatten() if torch.is_tensor(v) else torch.tensor(v, dtype=torch.float64) for v in metrics.values()]
    spread = [torch.as_tensor(v, dtype=torch.float64).flatten() for v in (stds or {}).values()]
    totals = iter(all_reduce_sum([x for v in values for x in (v.sum().item(), v.numel())] +
                                 [x for v in spread for x in (v.sum().item(), (v ** 2).sum().item(), v.numel())]))
    out = {}
    for name in metrics:
        total, count = next(totals), next(totals)
        if count:
            out[name] = total / count
    for name in stds or {}:
        total, squares, count = next(totals), next(totals), next(totals)
        if count:
            out[f"{name}_std"] = math.sqrt(max(squares / count - (total / count) ** 2, 0.0))
    return out


def checkpoints_node_local(args):
    """Whether --ckpt_path is storage of each node's own (a local disk), not one every rank shares, in a run of several
    processes that saves or loads checkpoints (checkpoints.node_local). Collective: every rank calls it (ds_config)."""
    if dist.get_world_size() == 1 or not (args.save_steps > 0 or args.load_checkpoint):
        return False
    import checkpoints
    return checkpoints.node_local(args)


# ------------------------------------------------------------------------------------- model loading
_hf_ds_config = None  # must outlive from_pretrained so ZeRO-3 loads partitioned weights


def load_tokenizer(path, args):
    check_model_path(path)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError) as e:
        fail(f"cannot load tokenizer {path!r}: {load_error(path, e)}")
    template = getattr(args, "tokenizer_chat_template", None)
    if template:
        tokenizer.chat_template = Path(template).read_text() if len(template) < 4096 and os.path.isfile(template) \
            else template
    if getattr(args, "apply_chat_template", False):
        use_turn_end_as_eos(tokenizer, path)
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        # HF sequence classifiers find the scored token by pad id: pad must differ from the appended eos.
        if tokenizer.unk_token_id is not None and tokenizer.unk_token_id != tokenizer.eos_token_id:
            tokenizer.pad_token = tokenizer.unk_token
        else:
            tokenizer.add_special_tokens({"pad_token": "<pad>"})
    return tokenizer


def chat_turn_end(tokenizer):
    """The special token the template writes right after an assistant reply (<|im_end|>, <|eot_id|>, </s>), or None."""
    reply = "Sure: 42."
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"},
                                              {"role": "assistant", "content": reply}], tokenize=False)
    except Exception as e:  # a template's own raise_exception, or a Jinja error
        fail(f"--apply_chat_template: the chat template cannot render a user turn and a reply ({e})")
    if reply not in text:
        return None
    tail = tokenizer(text[text.rindex(reply) + len(reply):], add_special_tokens=False)["input_ids"]
    specials = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special} | set(tokenizer.all_special_ids)
    return next((tokenizer.convert_ids_to_tokens(i) for i in tail if i in specials), None)


def use_turn_end_as_eos(tokenizer, path):
    """With --apply_chat_template the stop token is the one the template ends an assistant turn with, as in chat
    models. A base checkpoint's eos often differs (Qwen2.5 base: eos <|endoftext|>, turns end with <|im_end|>): SFT
    would then train one token and generation wait for another, so rollouts ran to --generate_max_len. The tokenizer's
    eos becomes the template's turn end (saved with the model: rm.py, the RL scripts and serve_rm score there)."""
    if not tokenizer.chat_template:
        fail(f"--apply_chat_template: the tokenizer of {path} has no chat template; pass one with "
             "--tokenizer_chat_template or drop --apply_chat_template")
    end = chat_turn_end(tokenizer)
    if end is None:
        fail(f"--apply_chat_template: the chat template of {path} writes no special token right after an "
             "assistant reply (or rewrites the reply), so a policy would not learn where to stop; use a "
             "template that ends turns with one (--tokenizer_chat_template)")
    if end != tokenizer.eos_token:
        if is_rank0():
            console.print(f"the chat template ends assistant turns with {end!r}, not eos {tokenizer.eos_token!r}: "
                          f"{end!r} is the stop token (eos) for training, generation and rewards", markup=False)
        tokenizer.eos_token = end


@contextlib.contextmanager
def sampling_as_asked(model):
    """generate() fills every field a call leaves unset from the checkpoint's generation_config.json, even given a
    GenerationConfig: Qwen2.5-Instruct's repetition penalty and top_k would reshape every sampling step, away from
    the distribution the loss (and vLLM) assumes. Inside, the config is blank but for caching (restored for saving)."""
    saved = model.generation_config
    model.generation_config = transformers.GenerationConfig(cache_implementation=saved.cache_implementation)
    try:
        yield
    finally:
        model.generation_config = saved


def load_model(path, args, tokenizer, ds_cfg=None, model_class=transformers.AutoModelForCausalLM, trainable=True,
               new_head=False, head_hint="give a reward model (one rm.py saved)", **kwargs):
    """from_pretrained with our flags (under ZeRO-3 the weights load partitioned); a `trainable` model gets LoRA
    adapters with --lora_rank (a classifier's `score` head stays fully trainable); a classifier's head: check_head."""
    global _hf_ds_config
    check_model_path(path)
    zero3 = ds_cfg is not None and ds_cfg["zero_optimization"]["stage"] == 3
    attention, packing_samples = "sdpa", getattr(args, "packing_samples", False)
    if packing_samples:
        import packing
        attention = packing.register_packed_sdpa()
    kernel_flags = args.flash_attn or getattr(args, "use_liger_kernel", False) or getattr(args, "torch_compile", False)
    if kernel_flags:
        import speedups  # --flash_attn, --use_liger_kernel, --torch_compile (before HfDeepSpeedConfig: a refusal
        attention = speedups.before_load(args, zero3, attention)  # leaves no ZeRO-3 state behind)
    if zero3:
        _hf_ds_config = transformers.integrations.HfDeepSpeedConfig(ds_cfg)
    if args.load_in_4bit:
        import lora
        kwargs["quantization_config"] = lora.four_bit_config()
    try:
        model, loaded = model_class.from_pretrained(path, dtype=torch.bfloat16 if args.bf16 else torch.float32,
                                                    attn_implementation=attention, output_loading_info=True,
                                                    trust_remote_code=args.trust_remote_code, **kwargs)
    except (OSError, ValueError, ImportError) as e:
        fail(f"cannot load model {path!r}: {load_error(path, e)}")
    if model_class is transformers.AutoModelForSequenceClassification:
        check_head(path, model, loaded["missing_keys"], new_head, head_hint)
    if len(tokenizer) > model.config.vocab_size:  # tokens were added (a pad, a PRM step placeholder)
        add_embeddings(model, len(tokenizer), zero3)
    model.config.pad_token_id = tokenizer.pad_token_id
    generation = getattr(model, "generation_config", None)  # None on a classifier
    stops = [] if generation is None or generation.eos_token_id is None else generation.eos_token_id
    stops = [stops] if isinstance(stops, int) else list(stops)
    if generation is not None and tokenizer.eos_token_id not in stops:
        # the template's turn end (use_turn_end_as_eos), saved with the model: a stock generate() stops there too
        generation.eos_token_id = [tokenizer.eos_token_id] + stops
        model.config.eos_token_id = tokenizer.eos_token_id
    if kernel_flags:
        speedups.after_load(model, args, trainable)
    if trainable and args.lora_rank:
        import lora
        model = lora.add_adapters(model, args)
    if trainable and args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def check_head(path, model, missing, new_head, hint):
    """A classifier's head is in its checkpoint (an adapter's in modules_to_save), or one line ending in `hint` (text,
    or a function of the config): a causal LM loaded as one scores plausibly with a random head. Only `new_head` starts
    one, on a causal LM (rm.py, a critic, merge_lora's base under its adapter)."""
    saved_as = model.config.architectures or []  # the checkpoint's classes
    adapter = Path(path) / "adapter_config.json"
    if adapter.is_file() and not new_head and "score" not in (json.loads(adapter.read_text()).get("modules_to_save")
                                                              or []):
        missing = ["score (an adapter trained without it: a causal LM's)"]
    if missing and (not new_head or any(a.endswith("ForSequenceClassification") for a in saved_as)):
        listed = ", ".join(sorted(missing)[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        saved_as = ", ".join(saved_as) or "no class"
        fail(f"{path} has no trained score head: its weights lack {listed} (saved as {saved_as}), so it would score "
             f"with a random head; {hint(model.config) if callable(hint) else hint}")


def add_embeddings(model, size, zero3):
    """Embedding rows for the added tokens, up to `size`. They start at the mean of the others, identical on every load:
    LoRA leaves embeddings frozen, so an adapter still merges onto a fresh load of the base model exactly."""
    vocab = model.config.vocab_size
    model.resize_token_embeddings(size, mean_resizing=False)
    for emb in {model.get_input_embeddings(), model.get_output_embeddings()} - {None}:
        with deepspeed.zero.GatheredParameters([emb.weight], modifier_rank=0, enabled=zero3), torch.no_grad():
            emb.weight[vocab:] = emb.weight[:vocab].mean(0)


def disable_dropout(model):
    """RL: old and new log-probs (and values) must come from the same function: no dropout anywhere."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if hasattr(m, "attention_dropout"):
            m.attention_dropout = 0.0


def load_frozen(path, args, tokenizer, cfg, offload=False, **kwargs):
    """A frozen model (reference policy, reward model). Under ZeRO-3 it is partitioned like the policy and
    wrapped in an optimizer-less DeepSpeed engine that gathers its weights per forward. With `offload` its
    partitions (ZeRO-3) or the whole model (else; see on_accelerator) wait on the CPU between uses."""
    if args.zero_stage == 3 and offload:  # before loading: from_pretrained partitions onto where cfg says
        cfg = dict(cfg, zero_optimization=dict(cfg["zero_optimization"], offload_param={
            "device": "cpu", "pin_memory": torch.cuda.is_available()}))
    model = load_model(path, args, tokenizer, cfg, trainable=False, **kwargs).eval().requires_grad_(False)
    disable_dropout(model)
    if args.zero_stage == 3:
        return deepspeed.initialize(model=model, config=cfg)[0].module
    return model if offload else model.to("cuda" if torch.cuda.is_available() else "cpu")


@contextlib.contextmanager
def on_accelerator(model, offloaded):
    """A model load_frozen(offload=True) left on the CPU (no ZeRO-3) moves to the GPU for one use, then back."""
    move = offloaded and torch.cuda.is_available()
    yield model.to("cuda") if move else model
    if move:
        model.to("cpu")


def load_error(path, e):
    """What from_pretrained's error means, in one line: a name that is not a directory here was tried on the hub, and
    the hub's error alone ("couldn't connect to huggingface.co") hides the likelier mistake, a missing local one."""
    here = Path(str(path)).expanduser().exists()
    return ("" if here else f"no such local directory {Path.cwd() / path}; as a hub name: ") + (
        str(e).splitlines()[0] if str(e) else type(e).__name__)


def check_model_path(path):
    """A missing local path fails before any hub request: one starting with ".", "/" or "~", with more than one "/", or
    whose first part is a directory here ("runs/sft_stepz" beside runs/); others ("org/name", "gpt2") go to the hub."""
    p = Path(str(path)).expanduser()
    if p.exists():
        return
    if str(path).startswith((".", "/", "~")) or str(path).count("/") > 1:
        fail(f"model path not found: no such directory {path}")
    if len(p.parts) > 1 and Path(p.parts[0]).is_dir():
        fail(f"model path not found: no such directory {path} (taken as local: {p.parts[0]}/ is a directory here; "
             "for the hub's org/name, run from another directory)")


# ---------------------------------------------------------------------------------------------- data
def load_records(source, split="train", required_keys=(), max_samples=None, with_locations=False, probs=None,
                 seed=42, hint=None, text_keys=()):
    """A list of dict records from .jsonl/.json/.parquet/.csv files, saved dataset dirs or hub names, comma-separated
    (concatenated, or mixed with `probs`: mix_records). With `with_locations`, also each record's location ("file: line
    N") for the caller's errors. `hint`: what a missing key's error adds (a script's other way to read the data);
    `text_keys`: the keys whose values must be text (read_records says what text is)."""
    sources = [s for s in str(source).split(",") if s] or [str(source)]
    if probs is None:
        rows = [row for s in sources for row in read_records(s, split, required_keys, max_samples, hint, text_keys)]
        rows = rows[:max_samples or None]
    else:
        rows = mix_records(source, sources, probs, split, required_keys, max_samples, seed, hint, text_keys)
    records = [record for record, _ in rows]
    return (records, [where for _, where in rows]) if with_locations else records


def mix_records(source, sources, probs, split, required_keys, max_samples, seed, hint, text_keys):
    """--dataset_probs: `max_samples` rows (default: as many as all sources hold), each drawn from source i with
    probability probs[i], going through that source in a seeded shuffled order (and round again if needed)."""
    if len(probs) != len(sources):
        fail(f"--dataset_probs has {len(probs)} weights for {len(sources)} datasets ({source})")
    if min(probs) < 0 or sum(probs) <= 0:
        fail(f"--dataset_probs {','.join(map(str, probs))}: weights must be >= 0 with a positive sum")
    if len(sources) == 1:
        return read_records(sources[0], split, required_keys, max_samples, hint, text_keys)[:max_samples or None]
    parts = [read_records(s, split, required_keys, None, hint, text_keys) for s in sources]
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(parts), size=max_samples or sum(map(len, parts)), p=np.array(probs) / sum(probs))
    orders, taken, rows = [rng.permutation(len(part)) for part in parts], [0] * len(parts), []
    for i in picks:
        rows.append(parts[i][orders[i][taken[i] % len(parts[i])]])
        taken[i] += 1
    return rows


def read_records(source, split, required_keys, max_samples, hint=None, text_keys=()):
    """load_records of one source -> [(record, its location)], the first max_samples, each checked."""
    path = Path(source)
    if path.suffix in (".jsonl", ".json", ".parquet", ".csv") and not path.is_file():
        fail(f"dataset file not found: {source}")
    records, where = read_json(source) if path.suffix in (".jsonl", ".json") else read_dataset(source, split)
    if not records:
        fail(f"dataset {source} is empty")
    rows = list(zip(records, where))[:max_samples or None]
    for record, location in rows:
        if not isinstance(record, dict):
            fail(f"{location}: expected a JSON object, got {type(record).__name__}")
        for key in required_keys:
            if record.get(key) is None:
                fail(f"{location}: missing key {key!r} (keys: {', '.join(record) or 'none'}); "
                     f"set the matching --*_key flag" + (f", or {hint}" if hint else ""))
            value = record[key]  # text: a string, a number (as its text), or messages (each with a string role)
            if key in text_keys and (isinstance(value, (bool, dict)) or isinstance(value, list) and not (value and all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) for m in value))):
                fail(f"{location}: {key!r} is {json.dumps(value)[:60]}, not text (a string or a number, or a list of "
                     "messages with a string role)")
    return rows


def read_json(source):
    """A .json array or .jsonl file -> (records, their locations), parsed here so a malformed line is named."""
    try:
        text = Path(source).read_text(encoding="utf-8-sig")  # (a byte-order mark is allowed)
    except UnicodeDecodeError as e:  # e.object: the file's bytes
        fail(f"{source}: line {len(e.object[:e.start + 1].splitlines())} is not UTF-8 text (byte "
             f"{e.object[e.start]:#04x}): save the file as UTF-8")
    if text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            fail(f"{source}: invalid JSON at line {e.lineno}: {e.msg}")
        return records, [f"{source}: line {line} (record {i})" for i, line in enumerate(array_lines(text))]
    records, where = [], []
    for i, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                fail(f"{source}: line {i} is not valid JSON ({e.msg})")
            where.append(f"{source}: line {i}")
    return records, where


def array_lines(text):
    """The line each element of a JSON array (valid JSON) starts on, in one pass."""
    decoder, at, lines, line, counted = json.JSONDecoder(), text.index("[") + 1, [], 1, 0
    while True:
        while text[at] in " \t\r\n,":  # (the comma between elements)
            at += 1
        if text[at] == "]":
            return lines
        line, counted = line + text.count("\n", counted, at), at
        lines.append(line)
        at = decoder.raw_decode(text, at)[1]


def read_dataset(source, split):
    """Not JSON, via `datasets`: a .parquet/.csv file, a save_to_disk directory, a hub name -> (records, locations)."""
    import datasets  # not for JSON: its import alone takes most of a second
    path = Path(source)
    try:
        if path.suffix in (".parquet", ".csv"):
            ds = datasets.load_dataset(path.suffix[1:], data_files=str(path), split="train")
        elif (path / "dataset_info.json").exists() or (path / "state.json").exists():
            ds = datasets.load_from_disk(str(path))
        else:
            ds = datasets.load_dataset(str(source), split=split)
    except Exception as e:  # datasets raises many kinds; the user needs the first line only
        fail(f"cannot load dataset {source!r}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    records = ds.to_list()
    return records, [f"{source}: record {i}" for i in range(len(records))]


def format_prompt(raw, tokenizer, args):
    """The prompt text: chat template (generation prompt added), or --input_template, or as is."""
    if args.apply_chat_template:
        messages = raw if isinstance(raw, list) else [{"role": "user", "content": str(raw)}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return args.input_template.format(raw) if args.input_template else str(raw)  # (a number: its text)


def rank_share(items):
    """This rank's share of `items` (every world-th), and for each whether it is real. Every rank gets the same count
    (a ZeRO-3 forward needs all ranks): the shortfall is filled with items[0], marked real=False: run, not counted."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = list(range(rank, len(items), world))
    mine += [-1] * (-(-len(items) // world) - len(mine))
    return [items[max(j, 0)] for j in mine], [j >= 0 for j in mine]


def batch_sequences(seqs, pad_value, packing):
    """1-D LongTensors -> input tensor plus position_ids and attention mask.
    padded: [B, T] right-padded, mask 1 on real tokens. packed: [1, sum(T_i)], position_ids restarting
    at 0 for every sequence and no mask (transformers finds the boundaries from position_ids; the
    forward must run with use_cache=False or the boundaries are lost)."""
    if packing:
        ids = torch.cat(seqs)[None]
        pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
        return ids, None, pos
    ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=pad_value)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(s) for s in seqs], batch_first=True)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, pos


# ------------------------------------------------------------------------------ log-probs of responses
def response_inputs(model, batch, pad_id, packing, share_prompts=False):
    """(prompt_ids, response_ids) pairs -> (the forward's inputs, where): model(**inputs) outputs at `where`,
    [sum of response lengths], are the positions that predict each response token, in order (the one before it).
    Padded rows, or with `packing` one packed row (packing.py; share_prompts: a group's prompt laid out once)."""
    device = next(model.parameters()).device
    if packing:
        from packing import packed_inputs
        return packed_inputs(model, batch, share_prompts, device)
    ids, attn, pos = (t.to(device) for t in batch_sequences([torch.cat(s) for s in batch], pad_id, packing=False))
    inputs = dict(input_ids=ids, position_ids=pos, attention_mask=attn, use_cache=False)
    rows = torch.cat([torch.full((len(r),), i) for i, (_, r) in enumerate(batch)])
    cols = torch.cat([torch.arange(len(p) - 1, len(p) + len(r) - 1) for p, r in batch])
    return inputs, (rows.to(device), cols.to(device))


def masked_mean(x, mask, dim=None):
    """Mean of x over the entries where mask is true (over all of them, or along `dim`)."""
    mask = mask.to(x.dtype)
    return (x * mask).sum(dim) / mask.sum(dim)  # (dim=None: over all entries)


def masked_whiten(x, mask, shift_mean=True, eps=1e-8, across_ranks=False, std_norm=True):
    """(x - mean) / std over the masked entries (population variance, float64 sums); shift_mean=False adds the mean
    back, so only the scale changes; std_norm=False only subtracts the mean (OpenRLHF's --no_advantage_std_norm).
    Entries outside the mask come out as 0. With `across_ranks` the mean and variance are those of the masked entries
    on every rank (a batch split over processes), from one all-reduce."""
    kept = x[mask.bool()].double()
    sums = [kept.numel(), kept.sum().item(), (kept ** 2).sum().item()]
    count, total, squares = all_reduce_sum(sums) if across_ranks else sums
    mean = total / count
    whitened = (x - mean) / (math.sqrt(max(squares / count - mean ** 2, 0.0) + eps) if std_norm else 1.0)
    return (whitened if shift_mean else whitened + mean) * mask.to(x.dtype)


def approx_kl(logprobs, ref_logprobs, estimator="k1"):
    """Per-token estimate of KL(policy || reference) from samples of the policy, d = logprobs - ref_logprobs:
    k1 = d (unbiased, can be negative), k2 = d^2 / 2, k3 = exp(-d) - 1 + d (unbiased and >= 0; Schulman's)."""
    d = logprobs - ref_logprobs
    if estimator == "k1":
        return d
    if estimator == "k2":
        return d ** 2 / 2
    if estimator == "k3":
        return torch.expm1(-d) + d
    raise ValueError(f"unknown KL estimator {estimator!r}: use k1, k2 or k3")


def forward_hidden(model, inputs):
    """model(**inputs) without its logits -> (the final hidden states [B, T, H] its output layer reads, the forward's
    output: its MoE router loss). The decoder's output is caught by a hook and the output layer gets no position
    (logits_to_keep=[]), so all the model's own forward still runs (ZeRO-3's gathers, LoRA, Liger, the router loss).
    A model's first call keeps its last position's logits, to check output_layer against them."""
    inner, caught = unwrap(model), []
    first = not getattr(inner, "_output_layer_checked", False)
    hook = inner.get_decoder().register_forward_hook(lambda module, args, out: caught.append(out[0]))
    try:
        out = model(**{**inputs, "use_cache": False},  # no KV cache: a loss's forward (packed rows need it so)
                    logits_to_keep=1 if first else torch.zeros(0, dtype=torch.long, device=inputs["input_ids"].device))
    finally:
        hook.remove()
    if first:
        check_output_layer(model, inner, caught[0][:, -1:], out.logits)
    return caught[0], out


def check_output_layer(model, inner, hidden, logits):
    """Once per model (on every rank alike): its own logits are output_layer's of the hidden states forward_hidden
    catches. A family that scales its logits some way output_layer does not know, or remote code whose decoder output
    is not what its output layer reads, stops here in one line instead of training on wrong numbers."""
    with torch.no_grad():
        got = output_layer(model)(hidden).float()
    if got.shape != logits.shape or not torch.allclose(got, logits.detach().float(), rtol=1e-3, atol=1e-3):
        fail(f"{type(inner).__name__}: its logits are not its output layer applied to its decoder's last hidden state "
             "(it scales or caps them in a way common.output_layer does not know): the chunked losses cannot read it")
    inner._output_layer_checked = True


def unwrap(model):
    """The transformers model inside a DeepSpeed engine and/or a PEFT wrapper."""
    model = getattr(model, "module", model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


# what Granite, Cohere and Gemma 2/3 do to the output layer's logits (output_layer; sft.py's fused loss skips them)
LOGIT_SCALING = ("logits_scaling", "logit_scale", "final_logit_softcapping")


def frozen_partitioned(params):
    """A frozen output layer under ZeRO-3 (LoRA): output_layer reads it from one gathered copy, no module call."""
    return bool(params) and all(hasattr(p, "ds_id") and not p.requires_grad for p in params)


def output_layer(model):
    """hidden states [..., H] -> logits [..., V] as the model's own forward makes them: its output layer (a module call,
    so ZeRO-3 gathers it and LoRA applies), then the scaling or soft-capping some families add (LOGIT_SCALING)."""
    inner = unwrap(model)
    head, cfg = inner.get_output_embeddings(), inner.config.get_text_config()
    divide, scale, cap = (getattr(cfg, k, None) for k in LOGIT_SCALING)
    params = list(head.parameters())
    if frozen_partitioned(params):
        # backward's recompute of a chunk would find it released (ZeRO-3 regathers only what gets a gradient): copy it
        with deepspeed.zero.GatheredParameters(params):
            weight, bias = (None if w is None else w.detach().clone() for w in (head.weight, head.bias))
        head = functools.partial(torch.nn.functional.linear, weight=weight, bias=bias)

    def logits(hidden):
        x = head(hidden)
        x = x / divide if divide else x
        x = x * scale if scale else x
        return torch.tanh(x / cap) * cap if cap else x
    return logits


LOGPROB_CHUNK = 1024  # the most tokens whose logits exist at once
CHUNK_LOGITS = 1024 * 32768  # the most logits a chunk holds: [1024, 32k], 128 MB in fp32


def chunk_rows(vocab):
    """Tokens per chunk of the output layer: LOGPROB_CHUNK, fewer past a 32k vocabulary so that one chunk's logits
    stay within CHUNK_LOGITS (220 tokens at Qwen's 152k; Liger sizes its chunks so too), but never under 128 (a
    narrower matmul wastes the machine; past a 262k vocabulary a chunk holds a little more)."""
    return min(LOGPROB_CHUNK, max(CHUNK_LOGITS // vocab, 128))


def chunked(model, fn, *rows):
    """fn(*chunk) over chunk_rows rows of each of `rows` at a time -> its outputs, each concatenated (None stays None).
    fn makes a chunk's logits from hidden states and reduces them; with a graph each chunk runs under checkpoint, so
    backward makes its logits again and autograd keeps none: the [tokens, V] logits never exist (and whatever changes
    the model, an adapter switch or a device move, must last until after backward). Under ZeRO-3 each output-layer call
    gathers it by a collective (unless frozen_partitioned), so every rank makes as many calls (empty chunks pad the
    shorter), and as many as the most its kind (training, no-grad) made before: DeepSpeed prefetches along the order of
    module calls it recorded, which a count changing with the batch's token count would void."""
    inner = unwrap(model)
    head = inner.get_output_embeddings()
    vocab = getattr(head, "out_features", None) or inner.config.get_text_config().vocab_size  # (ZeRO-3: no shape)
    chunks = list(zip(*(r.split(chunk_rows(vocab)) for r in rows)))
    params = list(head.parameters())
    if any(hasattr(p, "ds_id") for p in params) and not frozen_partitioned(params):  # a ZeRO-3 module call
        most, kind = inner.__dict__.setdefault("_most_chunks", {}), torch.is_grad_enabled()
        most[kind] = int(all_reduce_max([max(len(chunks), most.get(kind, 0))])[0])
        chunks += [tuple(r[:0] for r in rows)] * (most[kind] - len(chunks))
    outs = [checkpoint(fn, *chunk, use_reentrant=False) if torch.is_grad_enabled() else fn(*chunk) for chunk in chunks]
    return [None if o[0] is None else torch.cat(o) for o in zip(*outs)]


def token_logprobs(model, hidden, tokens, temperature=1.0, with_entropy=False, entropy_grad=True):
    """log pi(token | hidden) at `temperature` of each of `tokens` [N], from the final hidden states [N, H] that
    predict them -> (logprobs [N], entropy [N] or None), through the output layer a chunk at a time (chunked)."""
    logits = output_layer(model)
    return chunked(model, lambda h, t: chunk_logprobs(logits(h), t, temperature, with_entropy, entropy_grad),
                   hidden, tokens)


def response_logprobs(model, batch, pad_id, packing, temperature=1.0, per_token=True, with_entropy=False,
                      entropy_grad=True, share_prompts=True):
    """log pi(token | what precedes it) at `temperature` of each response token of batch, (prompt_ids, response_ids)
    pairs (padded, or with `packing` one row: response_inputs) -> (logprobs [B, R] (0 on padding), or per_token=False
    their sum per response [B]; entropy [B, R] or None (differentiable, the bonus; entropy_grad=False: a metric,
    without a graph); the forward's MoE router loss, None unless --aux_loss_coef turned it on)."""
    inputs, where = response_inputs(model, batch, pad_id, packing, share_prompts=share_prompts)
    hidden, out = forward_hidden(model, inputs)
    tokens, lengths = torch.cat([r for _, r in batch]).to(hidden.device), [len(r) for _, r in batch]
    logp, entropy = token_logprobs(model, hidden[where], tokens, temperature, with_entropy, entropy_grad)  # [sum R]
    entropy = pad_sequence(entropy.split(lengths), batch_first=True) if with_entropy else None
    if per_token:
        return pad_sequence(logp.split(lengths), batch_first=True), entropy, getattr(out, "aux_loss", None)
    sequence = torch.arange(len(batch), device=logp.device).repeat_interleave(torch.tensor(lengths, device=logp.device))
    return logp.new_zeros(len(batch)).index_add(0, sequence, logp), entropy, getattr(out, "aux_loss", None)


def chunk_logprobs(logits, tokens, temperature, with_entropy, entropy_grad):
    """token_logprobs of one chunk: the token's logit minus the logsumexp (no log-softmax over the whole
    vocabulary), in fp32 at least (a float64 model, as the tests run, stays exact)."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    x = x / temperature if temperature != 1 else x  # (a whole pass over the chunk, forward and backward)
    lse = x.logsumexp(-1)
    logp = x.gather(-1, tokens[:, None]).squeeze(-1) - lse
    if not with_entropy:
        return logp, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):  # the bonus, or just a metric
        logp_all = x - lse[:, None]
        return logp, -(logp_all.exp() * logp_all).sum(-1)


def seq_mean(x, action_mask):
    """Each row's mean [B] over its response tokens (padding may hold anything)."""
    mask = action_mask.bool()
    return torch.where(mask, x, 0.0).sum(-1) / mask.sum(-1).clamp(min=1)


# ---------------------------------------------------------------------------------- saving / resume
def save_hf_model(engine, tokenizer, path, args, extra_config=None):
    """Write a plain Hugging Face directory (ZeRO-3 shards gathered on rank 0). With --lora_rank it
    holds the adapter (adapter_config.json, adapter_model.safetensors; merge_lora.py makes a full model)."""
    model = engine.module
    state, saved_names = {}, set(model.state_dict())
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if name not in saved_names:
            continue  # non-persistent buffers (rotary tables)
        with deepspeed.zero.GatheredParameters([tensor], enabled=args.zero_stage == 3):
            if is_rank0():
                state[name] = tensor.detach().cpu().clone()
    if is_rank0():
        write_hf_dir(model, tokenizer, path, state, extra_config)
    dist.barrier()


def write_hf_dir(model, tokenizer, path, state=None, extra_config=None):
    """save_pretrained, atomically (into a temporary directory, then renamed into place: a crash never leaves half a
    model). With LoRA adapters transformers writes only them, so `extra_config` (a reward model's mean/std) goes to
    extra_config.json, where merge_lora.py finds it (a config.json would pass the directory off as a full model)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.config.update(extra_config or {})
    model.save_pretrained(tmp, **({} if state is None else {"state_dict": dict(state)}))  # a copy: it empties its input
    if getattr(model, "_hf_peft_config_loaded", False) and extra_config:
        (tmp / "extra_config.json").write_text(json.dumps(extra_config, indent=2) + "\n")
    tokenizer.save_pretrained(tmp)
    # save_pretrained writes model.safetensors 0600, which another user could not load: every file gets the mode a
    # new file gets here (0644 usually), read off one the tokenizer wrote with open() (reading the umask sets it)
    mode = (tmp / "tokenizer_config.json").stat().st_mode & 0o777
    for f in filter(Path.is_file, tmp.rglob("*")):
        f.chmod(mode)
    old = path.with_name(f".{path.name}.old-{os.getpid()}")
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(engine, args, step, extra=None, others=None):
    """--save_steps: a resumable checkpoint of the run at `step` in --ckpt_path (checkpoints.save)."""
    import checkpoints
    checkpoints.save(engine, args, step, extra, others)


def load_checkpoint(engine, args, total_steps, others=None):
    """With --load_checkpoint, resume from the latest checkpoint in --ckpt_path where there is one (checkpoints.resume)
    -> (the step to continue from, save_checkpoint's `extra` keys); else (0, {})."""
    if not args.load_checkpoint:
        return 0, {}
    import checkpoints
    return checkpoints.resume(engine, args, total_steps, others)


def interrupted(args, signum, frame):
    """Ctrl-C (SIGINT, set by parse_args under plain python): one line naming the checkpoint to resume from
    (checkpoints.interrupted), then exit 130."""
    import checkpoints
    checkpoints.interrupted(args)


# --------------------------------------------------------------------------------------------- logging
class Logger:
    """A rich progress bar on rank 0, plus TensorBoard / wandb when asked; metrics are already reduced."""
    def __init__(self, args, total_steps, start_step=0, timed=()):
        self.args, self.rank0, self.trackers = args, is_rank0(), None
        self.steps, self.start_step, self.totals = total_steps, start_step, dict.fromkeys(timed, 0.0)
        if not self.rank0:
            return
        if args.use_tensorboard or args.use_wandb:
            import trackers  # --use_tensorboard, --use_wandb
            self.trackers = trackers.Trackers(args)
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeRemainingColumn(), TextColumn("{task.fields[metrics]}"), console=console)
        self.task = self.progress.add_task("train", total=total_steps, completed=start_step, metrics="")
        self.progress.start()

    def log(self, step, metrics, prefix="train"):
        if prefix == "train":  # the `timed` seconds, summed for run_times
            self.totals = {k: v + metrics.get(k, 0.0) for k, v in self.totals.items()}
        if not self.rank0:
            return
        text = " ".join(f"{k}={v:.4g}" for k, v in metrics.items())
        if prefix == "train":
            self.progress.update(self.task, completed=step, metrics=text)
        if prefix != "train" or step % self.args.logging_steps == 0 or step == self.steps:  # the last step too
            self.progress.console.print(f"{prefix} step {step}: {text}", markup=False)
        if self.trackers:
            self.trackers.log(step, metrics, prefix)

    def log_samples(self, step, rows, prefix="eval", limit=400):
        """Samples at `step` (rows: dicts with the same keys, of texts and numbers; an RL script's eval_samples): a
        table on the console, a text over `limit` characters as its start and end; the rows in full to the trackers."""
        if not self.rank0 or not rows:
            return
        texts = [[v if isinstance(v, str) else f"{v:.4g}" for v in row.values()] for row in rows]
        table = Table(title=f"{prefix} samples, step {step}", show_lines=True)
        for name in rows[0]:
            table.add_column(name, overflow="fold")  # a long token is folded, not cut
        for row in texts:  # as Text: brackets in a completion are not rich markup
            table.add_row(*(Text(t if len(t) <= limit else f"{t[:limit // 2]} …[{len(t) - limit} characters]… "
                                                           f"{t[-(limit // 2):]}") for t in row))
        self.progress.console.print(table)
        if self.trackers:
            self.trackers.log_samples(step, rows, texts, prefix)

    def run_times(self, start):
        """eval_results.json's train_time_s, steps and each `timed` metric's mean per step run (generate_s_per_step)."""
        done = max(self.steps - self.start_step, 1)
        return dict(train_time_s=time.time() - start, steps=self.steps,
                    **{f"{k[:-2]}_s_per_step": v / done for k, v in self.totals.items()})

    def close(self):
        if self.rank0:
            self.progress.stop()
            if self.trackers:
                self.trackers.close()


def log_eval(logger, step, metrics, results=None, suffix=""):
    """Log eval metrics at `step` ({name: mean}, or an RL script's evaluate: {"metrics": ..., "samples": rows}, whose
    rows Logger.log_samples shows); with `results`, keep the metrics there too, as eval_<name><suffix>."""
    metrics, samples = (metrics["metrics"], metrics["samples"]) if "samples" in metrics else (metrics, [])
    logger.log(step, metrics, prefix="eval")
    logger.log_samples(step, samples)
    if results is not None:
        results.update({f"eval_{k}{suffix}": v for k, v in metrics.items()})


def due(every, step, total_steps=None):
    """Whether a step is one of every `every` (--save_steps, --eval_steps; <= 0: never); with total_steps, not the
    last (the final eval is the run's own)."""
    return every > 0 and step % every == 0 and (total_steps is None or step < total_steps)


def finish(engine, tokenizer, args, results, logger, extra_config=None, evaluate=None):
    """The end of every training script: the final eval (with `evaluate`: logged, and kept in results), close the
    logs, save the model and beside it eval_results.json (the figures the demo table reads), and say where."""
    if evaluate is not None:
        log_eval(logger, logger.steps, evaluate(), results)
    logger.close()
    save_hf_model(engine, tokenizer, args.save_path, args, extra_config=extra_config)
    if is_rank0():
        results["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        if torch.cuda.is_available():  # this process's tensors on its GPU (bench/gpu_check.py reports it)
            results["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
        (Path(args.save_path) / "eval_results.json").write_text(json.dumps(results, indent=2) + "\n")
        console.print(f"saved to {args.save_path}: {figures(results)}", markup=False)


def figures(values):
    """{name: value} as one line, "k=v ...", floats to 4 significant digits (counts as they are)."""
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())
