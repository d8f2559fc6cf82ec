import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Nothing can be downloaded here; DeepSpeed runs on its CPU accelerator with gloo.
os.environ.update(HF_HUB_OFFLINE="1", DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false")

import common  # noqa: E402  (imports after the environment they read)
from transformers import AutoTokenizer  # noqa: E402


@pytest.fixture(scope="session")
def toy_world(tmp_path_factory):
    """A fresh toy world for the session (never the developer's ./toy_world), shared by subprocesses."""
    path = tmp_path_factory.mktemp("toy") / "toy_world"
    os.environ["TOY_WORLD_DIR"] = str(path)
    import toy

    return toy.ensure_toy_world(path)


@pytest.fixture(scope="session")
def tokenizer(toy_world):
    return AutoTokenizer.from_pretrained(toy_world / "model")


def script_args(**flags):
    """The parsed defaults of common.add_common_args, with the given flags (script-specific ones included)
    set on top: what a script's helpers see, without running its main()."""
    args = common.add_common_args(argparse.ArgumentParser()).parse_args([])
    for k, v in flags.items():
        setattr(args, k, v)
    return args


def run_script(script, *args, nproc=1, launcher="torchrun", cwd=None, timeout=600, check=True):
    """Run one of our scripts as a user would: `python script.py`, or with N processes under
    `torchrun` or the `deepspeed` launcher."""
    with socket.socket() as s:  # a free port: torchrun's --master_port=0 hangs the gloo rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if nproc == 1:
        cmd = [sys.executable, str(ROOT / script)]
    elif launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={port}",
               str(ROOT / script)]
    else:
        cmd = [str(Path(sys.executable).parent / "deepspeed"), f"--num_gpus={nproc}", f"--master_port={port}",
               str(ROOT / script)]
    env = dict(os.environ, OMP_NUM_THREADS="1" if nproc > 1 else os.environ.get("OMP_NUM_THREADS", "2"))
    proc = subprocess.run(cmd + [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def results(path):
    """eval_results.json, the figures a script wrote beside its saved model."""
    return json.loads((Path(path) / "eval_results.json").read_text())
