"""What --save_steps and --load_checkpoint add: resumable checkpoints (DeepSpeed's model, optimizer and scheduler,
each rank's RNG, the data position a script passes, and run.json: which script, model and state-shaping flags wrote
it), the checks a resume makes before anything loads, and the resume itself. common.save_checkpoint,
common.load_checkpoint and common.parse_args import this module only where those flags ask for it; importing it only
defines things."""

import hashlib
import json
import os
import random
import shlex
import shutil
import signal
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import common
from common import console, fail

RUN_FLAGS = ("lora_rank", "target_modules", "zero_stage")  # what shapes a checkpoint's saved state
NODE_LOCAL = {}  # node_local's answer per --ckpt_path, for the run
OWN = set()  # the checkpoints this process resumed from or saved (or began to): what Ctrl-C may name


def node_local(args):
    """common.checkpoints_node_local's answer, kept for the run: every rank leaves a mark in --ckpt_path, and a rank
    that misses one sees another disk."""
    world = dist.get_world_size()
    if args.ckpt_path not in NODE_LOCAL:
        run = [os.urandom(8).hex()]
        dist.broadcast_object_list(run, src=0)  # this run's marks, not a crashed run's
        marks = Path(args.ckpt_path) / f".ranks-{run[0]}"
        marks.mkdir(parents=True, exist_ok=True)
        (marks / str(dist.get_rank())).touch()
        dist.barrier()
        missing, = common.all_reduce_sum([sum(not (marks / str(r)).exists() for r in range(world))])
        dist.barrier()
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:
            shutil.rmtree(marks, ignore_errors=True)
        NODE_LOCAL[args.ckpt_path] = missing > 0
    return NODE_LOCAL[args.ckpt_path]


def node_writer(args):
    """The process that writes a checkpoint's shared files: rank 0, or each node's first with node-local storage."""
    if common.checkpoints_node_local(args):
        return int(os.environ.get("LOCAL_RANK", 0)) == 0
    return common.is_rank0()


def save(engine, args, step, extra=None, others=None):
    """Resumable state: model, optimizer, scheduler (DeepSpeed), data position (step, plus what a script
    puts in `extra`) and each rank's RNG; `others` ({name: engine}, e.g. a critic) go to <ckpt_path>/<name>
    first. DeepSpeed writes the 'latest' pointer last, so a kill mid-save resumes from the previous one."""
    tag = f"global_step{step}"
    tag_dir = Path(args.ckpt_path) / tag
    tag_dir.mkdir(parents=True, exist_ok=True)
    for name, other in (others or {}).items():
        other.save_checkpoint(str(Path(args.ckpt_path) / name), tag=tag)
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
           "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
    torch.save(rng, tag_dir / f"rng_rank{dist.get_rank()}.pt")
    if node_writer(args):  # what wrote it, which a resume checks (check)
        (tag_dir / ".run.json.tmp").write_text(json.dumps(run_record(args), indent=2) + "\n")
        (tag_dir / ".run.json.tmp").rename(tag_dir / "run.json")
    OWN.add(str(tag_dir))  # (named once 'latest' says it: DeepSpeed writes that last)
    engine.save_checkpoint(args.ckpt_path, tag=tag, client_state={"step": step, **(extra or {})})
    if node_writer(args):  # (DeepSpeed's save ends when every rank's files are written)
        for d in [Path(args.ckpt_path)] + [Path(args.ckpt_path) / name for name in others or {}]:
            if not common.is_rank0():  # DeepSpeed writes 'latest' on rank 0 only: the other nodes' copies
                tmp = d / f".latest.tmp-{dist.get_rank()}"
                tmp.write_text(tag)
                tmp.rename(d / "latest")
            old = sorted(d.glob("global_step*"), key=lambda p: int(p.name[len("global_step"):]))
            for p in old[:-args.max_ckpt_num]:
                shutil.rmtree(p, ignore_errors=True)
    dist.barrier()


def resume(engine, args, total_steps, others=None):
    """load_checkpoint's resume: model, optimizer and scheduler (DeepSpeed), `others` from the same step, this rank's
    RNG, from the checkpoint every rank sees as the latest (none: start afresh); one at or past the run's
    `total_steps` (a finished run, or another run's) stops in one line."""
    tags = [None] * dist.get_world_size()  # what each rank would resume from: all the same step, or none
    dist.all_gather_object(tags, latest_tag(args.ckpt_path))
    if all(t is None for t in tags):
        return 0, {}
    if len(set(tags)) > 1:
        seen = ", ".join(f"rank {r}: {t or 'none'}" for r, t in enumerate(tags))
        fail(f"--load_checkpoint: the ranks see different checkpoints in {args.ckpt_path} ({seen}); every node needs "
             "the same step")
    ckpt_path, tag = args.ckpt_path, Path(args.ckpt_path) / tags[0]
    if not tags[0].startswith("global_step") or not tags[0][len("global_step"):].isdigit():
        fail(f"--load_checkpoint: {tag} is not a checkpoint of this project's (global_stepN)")
    step, done = int(tags[0][len("global_step"):]), Path(args.save_path) / "eval_results.json"
    # its step the run's last, and the final model saved after it (not a run stopped before its final save)
    finished = step == total_steps and done.is_file() and done.stat().st_mtime >= tag.stat().st_mtime
    if step > total_steps or common.all_reduce_max([finished])[0]:
        why = f"the run is finished (its model: {args.save_path}); more epochs or episodes continue it" \
            if step == total_steps else "past this run's end: the run that saved it was longer (more epochs, " \
            "samples or episodes)"
        fail(f"--load_checkpoint: {tag} is at step {step}, this run has {total_steps} steps: {why}; a new "
             "--ckpt_path starts afresh")
    load_path, client_state = engine.load_checkpoint(ckpt_path)
    if load_path is None:
        fail(f"could not load the checkpoint in {ckpt_path}")
    step = client_state["step"]
    for name, other in (others or {}).items():
        loaded, _ = other.load_checkpoint(str(Path(ckpt_path) / name), tag=f"global_step{step}")
        if loaded is None:
            fail(f"could not load the {name} checkpoint of step {step} in {ckpt_path}")
    rng = torch.load(Path(ckpt_path) / f"global_step{step}" / f"rng_rank{dist.get_rank()}.pt", weights_only=False)
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None:
        torch.cuda.set_rng_state_all(rng["cuda"])
    OWN.add(str(tag))
    if common.is_rank0():
        console.print(f"resumed from {ckpt_path} at step {step}")
    return step, client_state


def check(args):
    """--load_checkpoint, before anything loads: the latest checkpoint in --ckpt_path is this script's, from the same
    model and state-shaping flags (its run.json), else one line saying what was found and what was expected. One
    written before checkpoints kept run.json (this project before 2026-11-29) resumes as then, said in a line."""
    name, rank0 = latest_tag(args.ckpt_path), os.environ.get("RANK", "0") == "0"
    if name is None:
        if rank0:
            console.print(f"--load_checkpoint: no checkpoint in {args.ckpt_path} yet: starting at step 0", markup=False)
        return
    tag = Path(args.ckpt_path) / name
    if not tag.is_dir():
        fail(f"--load_checkpoint: {Path(args.ckpt_path) / 'latest'} names {name}, which is not in {args.ckpt_path}")
    if not (tag / "run.json").is_file():
        if rank0:
            console.print(f"--load_checkpoint: {tag} has no run.json (written before checkpoints kept one): resumed "
                          "without checking which script and model wrote it", markup=False)
        return
    try:
        saved = json.loads((tag / "run.json").read_text())
    except ValueError as e:
        fail(f"--load_checkpoint: {tag / 'run.json'} is not JSON ({e})")
    mine = run_record(args)
    if saved.get("script") != mine["script"]:
        fail(f"--load_checkpoint: {tag} was written by {saved.get('script')}, not {mine['script']}: give this run's "
             "own --ckpt_path (by default --save_path + _checkpoints)")
    if saved.get("model") != mine["model"]:
        fail(f"--load_checkpoint: {tag} continues a run from --pretrain {saved.get('pretrain')}, another model than "
             f"this run's --pretrain {args.pretrain} (their configs or weights differ): resume with the model it "
             "started from, or give a new --ckpt_path")
    differ = [k for k in RUN_FLAGS if saved.get(k) != mine[k]]
    if differ:
        fail(f"--load_checkpoint: {tag} continues a run with {' '.join(f'--{k} {saved.get(k)}' for k in differ)}, "
             f"this run has {' '.join(f'--{k} {mine[k]}' for k in differ)}: resume with the flags it was saved with, "
             "or give a new --ckpt_path")


def run_record(args):
    """What a checkpoint keeps of the run that wrote it (run.json) and a resume must match: the script, the model it
    started from (`model`: model_identity), the flags that shape the saved state."""
    return {"script": Path(sys.argv[0]).name, "pretrain": args.pretrain, "model": model_identity(args.pretrain),
            **{k: getattr(args, k) for k in RUN_FLAGS}}


def model_identity(path):
    """A local model's identity that survives moving its directory and tells two trainings of one architecture apart:
    a hash of its config and of 1 MB from the middle of each weight file (trained weights differ there). A hub name
    is its own identity."""
    root = Path(path).expanduser()
    if not root.is_dir():
        return str(path)
    digest = hashlib.sha256((root / "config.json").read_bytes() if (root / "config.json").is_file() else b"")
    for f in sorted(root.glob("*.safetensors")) + sorted(root.glob("*.bin")):
        with open(f, "rb") as weights:
            size = f.stat().st_size
            weights.seek(size // 2)
            digest.update(f"{f.name} {size}".encode() + weights.read(1 << 20))
    return digest.hexdigest()[:16]


def latest_tag(ckpt_path):
    """The checkpoint `latest` names in ckpt_path (global_stepN), or None where there is none."""
    latest = Path(ckpt_path) / "latest"
    return latest.read_text().strip() if latest.exists() else None


def interrupted(args):
    """Ctrl-C (SIGINT, set by parse_args under plain python; the deepspeed launcher and torchrun end their ranks
    themselves): one line, the checkpoint this run last saved or resumed from and the command that resumes it, then
    exit 130 as a shell's interrupted command, through every `finally` (Ray and vLLM shut down as usual). A second
    Ctrl-C is Python's own KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if os.environ.get("RANK", "0") == "0":
        name = latest_tag(args.ckpt_path)
        tag = name and str(Path(args.ckpt_path) / name)
        command = [a for a in sys.argv if not a.startswith("--local_rank")] + ["--load_checkpoint"] * (
            not args.load_checkpoint)
        launch = "python " if int(os.environ.get("WORLD_SIZE", "1")) == 1 else "your launcher and "
        console.print(f"interrupted: the last checkpoint is {tag}; resume with {launch}{shlex.join(command)}"
                      if tag in OWN else
                      f"interrupted: this run saved no checkpoint (--save_steps {args.save_steps}): nothing to resume",
                      markup=False)
    raise SystemExit(130)
