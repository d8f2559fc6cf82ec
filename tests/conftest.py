import argparse
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Nothing can be downloaded here; DeepSpeed runs on its CPU accelerator with gloo.
os.environ.update(HF_HUB_OFFLINE="1", DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false")

import common  # noqa: E402  (imports after the environment they read)
from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer,  # noqa: E402
                          GenerationConfig)

# rich picks its colours when common.console is made: under `pytest -s` in a terminal that would put ANSI codes into
# the logs run_main captures and tests parse
common.console._color_system = None


@pytest.fixture(scope="session")
def toy_world(tmp_path_factory):
    """A fresh toy world for the session (never the developer's ./toy_world), shared by subprocesses."""
    path = tmp_path_factory.mktemp("toy") / "toy_world"
    os.environ["TOY_WORLD_DIR"] = str(path)
    import toy

    return toy.ensure_toy_world(path)


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory):
    """tests/families.py's five checkpoint layouts (Qwen2.5 instruct and base, Llama 3, Mistral, GPT-2), built once."""
    import families

    root = tmp_path_factory.mktemp("families")
    return {f: families.build(f, root / f) for f in families.FAMILIES}


@pytest.fixture(scope="session")
def tokenizer(toy_world):
    return AutoTokenizer.from_pretrained(toy_world / "model")


def script_args(**flags):
    """The parsed defaults of the training flags (sft.add_training_args: every training script's copy is the same),
    with the given flags (script-specific ones included) set on top: what a script's helpers see, without running its
    main()."""
    import sft

    args = sft.add_training_args(argparse.ArgumentParser()).parse_args([])
    for k, v in flags.items():
        setattr(args, k, v)
    return args


def run_script(script, *args, nproc=1, launcher="torchrun", cwd=None, timeout=600, check=True):
    """Run one of our scripts as a user would: `python script.py`, or with N processes under
    `torchrun` or the `deepspeed` launcher."""
    port = common.free_port()  # torchrun's --master_port=0 hangs the gloo rendezvous
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


def run_main(script, *args, cwd=None, check=True):
    """A script's main() in this process, as `python script.py args` runs it (one process, no vLLM or Ray, which
    change the process): -> a subprocess.CompletedProcess, its stderr what the run printed and the error it exited
    with. Seconds faster than run_script's fresh interpreter (the imports are done). The environment, the working
    directory and transformers' verbosity are restored after; the world-of-one process group the first run starts
    stays for the session (DeepSpeed keeps its groups). An exception other than SystemExit fails the test with its
    traceback; so does a non-zero exit with `check`, as in run_script."""
    import contextlib
    import importlib
    import io
    import signal

    import transformers

    module = importlib.import_module(Path(script).stem)
    env, cwd_before, argv, verbosity = dict(os.environ), os.getcwd(), sys.argv, transformers.logging.get_verbosity()
    sigint = signal.getsignal(signal.SIGINT)  # parse_args sets the run's Ctrl-C handler: pytest's again after
    out, err = io.StringIO(), io.StringIO()
    try:
        os.chdir(cwd or cwd_before)
        sys.argv = [str(ROOT / script), *map(str, args)]
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            module.main()
        code = 0
    except SystemExit as e:
        code = e.code
    except BaseException:
        sys.stderr.write(out.getvalue() + err.getvalue())  # the run's log, beside the traceback
        raise
    finally:
        sys.argv = argv
        signal.signal(signal.SIGINT, sigint)
        os.chdir(cwd_before)
        os.environ.clear()
        os.environ.update(env)
        transformers.logging.set_verbosity(verbosity)
    if isinstance(code, str):  # SystemExit("error: ..."): what the interpreter prints before exiting with 1
        err.write(code + "\n")
    proc = subprocess.CompletedProcess([script, *args], 1 if isinstance(code, str) else code or 0, out.getvalue(),
                                       err.getvalue())
    if check and proc.returncode:
        raise AssertionError(f"{script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def results(path):
    """eval_results.json, the figures a script wrote beside its saved model."""
    return json.loads((Path(path) / "eval_results.json").read_text())


@pytest.fixture(scope="session")
def policy(toy_world, tmp_path_factory):
    """A short SFT run (~11% held-out accuracy): RL tests start here, so rewards vary and updates are real."""
    out = tmp_path_factory.mktemp("rl") / "sft"
    run_script("sft.py", "--max_epochs", 2, "--save_path", out, "--eval_generate_samples", 0)
    return out


@pytest.fixture(scope="session")
def eval_file(toy_world, tmp_path_factory):
    """The first 64 held-out RL prompts."""
    path = tmp_path_factory.mktemp("rl_eval") / "eval.jsonl"
    path.write_text("".join(open(toy_world / "prompts_test.jsonl").readlines()[:64]))
    return path


@torch.no_grad()
def stock_accuracy(path, eval_file, tie=1e-4):
    """Greedy accuracy of the saved policy on the eval prompts: stock class, one prompt at a time, as a
    pytest.approx a reported accuracy must equal. Exact, except that a prompt whose greedy decode passes a
    near-tie (two best logits within `tie`) may go either way: a batched forward, vLLM or another CPU rounds
    differently in float32 (~1e-6 here, ~1e-5 for vLLM), so each such prompt widens it by one."""
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    correct, near_ties, records = 0, 0, [json.loads(line) for line in open(eval_file)]
    for r in records:
        ids = tok(r["input"], return_tensors="pt")["input_ids"]
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, output_scores=True,
                             return_dict_in_generate=True)
        correct += tok.decode(out.sequences[0, ids.size(1):], skip_special_tokens=True).strip() == r["label"]
        top2 = torch.stack(out.scores)[:, 0].topk(2, -1).values  # [steps, 2]
        near_ties += bool(((top2[:, 0] - top2[:, 1]) < tie).any())
    return pytest.approx(correct / len(records), abs=near_ties / len(records) + 1e-9)


@torch.no_grad()
def stock_eval_reward(policy, reward_model, prompts, chat=False):
    """The mean reward of the policy's greedy completions, recomputed with stock classes one prompt at a time:
    the prompt as the template renders it, generate() stopping at the saved tokenizer's eos and told nothing
    by the checkpoint's generation config, the completion's EOS appended if it has none."""
    tok = AutoTokenizer.from_pretrained(policy)
    model = AutoModelForCausalLM.from_pretrained(policy).eval()
    rm_model = AutoModelForSequenceClassification.from_pretrained(reward_model).eval()
    scores = []
    for p in prompts:
        text = tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                       add_generation_prompt=True) if chat else p
        ids = torch.tensor([tok(text, add_special_tokens=not chat)["input_ids"]])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id, generation_config=GenerationConfig(do_sample=False),
                             repetition_penalty=1.0, no_repeat_ngram_size=0)[0]
        seq = out if out[-1] == tok.eos_token_id else torch.cat([out, torch.tensor([tok.eos_token_id])])
        scores.append(rm_model(seq[None]).logits[0, 0].item())
    return sum(scores) / len(scores)


def logged(stdout_and_err, key, prefix="train step"):
    """The values of `key` in a run's log lines that start with `prefix`, in order."""
    return [float(line.split(f" {key}=")[1].split()[0]) for line in stdout_and_err.splitlines()
            if line.startswith(prefix)]


def last_logged(stdout_and_err, key, prefix="train step"):
    """The value of `key` in the last log line of a run that starts with `prefix`."""
    return logged(stdout_and_err, key, prefix)[-1]


def sample_tables(stdout_and_err, prefix="eval"):
    """The tables of samples a run printed (common.Logger.log_samples): {step: [{column: cell}]}, each cell's text
    joined from the lines rich wrapped it over, without whitespace (where rich broke a line is not knowable)."""
    tables, rows, header, cells = {}, None, None, None
    for line in stdout_and_err.splitlines():
        if line.strip().startswith(f"{prefix} samples, step "):
            rows, header, cells = tables.setdefault(int(line.split()[-1]), []), None, None
        elif rows is not None and line.startswith(("┃", "│")):  # a header or a row, one line of it
            parts = ["".join(c.split()) for c in line[1:-1].split(line[0])]
            if line[0] == "┃":
                header = parts if header is None else [a + b for a, b in zip(header, parts)]
            else:
                cells = parts if cells is None else [a + b for a, b in zip(cells, parts)]
        elif rows is not None and line.startswith(("├", "└")):  # a row ends
            rows.append(dict(zip(header, cells)))
            cells, rows = None, None if line.startswith("└") else rows
    return tables


def max_diff(a, b):
    """The largest absolute difference between two models' tensors (`weights` dicts)."""
    return max((a[k] - b[k]).abs().max().item() for k in a)


def weights(path, model_class=AutoModelForCausalLM):
    """A saved model's tensors, for before/after and resume comparisons."""
    model = model_class.from_pretrained(path)
    return {k: v.clone() for k, v in model.state_dict().items()}


class RewardServer:
    """A real HTTP server on 127.0.0.1 in a thread, speaking /get_reward: reward(query, prompt, label) per
    query (default len(query)), after `fail_first` 503s; `hang` makes it never answer in time; `status`
    answers every request with that code. Keeps every request body and the rewards it sent."""

    def __init__(self, fail_first=0, hang=False, status=None, reward=lambda q, p, label: float(len(q))):
        self.requests, self.sent, self.fail_first = [], [], fail_first
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(body)
                if hang:
                    time.sleep(3)
                code = status or (503 if len(outer.requests) <= outer.fail_first else 200)
                rewards = [reward(*x) for x in zip(body["query"], body["prompts"], body["labels"])]
                if code == 200:
                    outer.sent.append(rewards)
                data = json.dumps({"rewards": rewards} if code == 200 else {"detail": "busy"}).encode()
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout)
                    pass

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/get_reward"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
