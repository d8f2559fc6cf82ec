"""What a run prints: none of the libraries' known noise (DeepSpeed's shm op "built successfully" and its accelerator
guess, transformers' deprecations through peft, a sync time where nothing is synced), each model's line labelled, the
final figures rounded; a first start says what it compiles, once. (vLLM's reload warnings: test_rollout_engines.py.)"""
import os
import re
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

import common
from conftest import ROOT, results, run_main, run_script

NOISE = ("built successfully", "Setting accelerator to CPU", "Warning:", "Failed to load weights", "sync_s=")


def noise(log):
    """The lines of a run's log that hold a known noise line."""
    return [line for line in log.splitlines() if any(n in line for n in NOISE)]


def rounded(line):
    """Whether every number of a `k=v ...` line has at most 4 significant digits (Logger's {:.4g})."""
    values = re.findall(r"=(\S+)", line)
    return bool(values) and all(len(re.sub(r"e.*|\D", "", v).lstrip("0")) <= 4 for v in values)


def test_a_fresh_ppo_run_prints_no_noise(toy_world, eval_file, tmp_path, monkeypatch):
    """A new process as a user starts it (DeepSpeed picks its accelerator and loads its shm op per process; no
    DS_ACCELERATOR set), HF generate, one step: no noise line; the actor's and the critic's parameter lines say which;
    the last line's figures are rounded."""
    monkeypatch.delenv("DS_ACCELERATOR")  # (conftest's, which the run would inherit)
    proc = run_script("ppo.py", "--pretrain", toy_world / "model", "--remote_rm_url", ROOT / "toy.py", "--max_samples",
                      16, "--rollout_batch_size", 16, "--train_batch_size", 16, "--micro_train_batch_size", 16,
                      "--eval_dataset", eval_file, "--save_path", tmp_path / "run", cwd=tmp_path)
    log = proc.stdout + proc.stderr
    assert noise(log) == []
    assert sum(line.startswith("compiling DeepSpeed's") for line in log.splitlines()) <= 1  # a first start only
    total = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(toy_world / "model").parameters())
    trained = [line for line in log.splitlines() if "training " in line and " parameters (" in line]
    assert [line.split(": training")[0] for line in trained] == ["actor", "critic"], trained
    assert f"actor: training {total:,} of {total:,} parameters" in trained[0]
    final = [line for line in log.splitlines() if line.startswith(f"saved to {tmp_path / 'run'}: ")]
    assert len(final) == 1 and rounded(final[0]) and "eval_accuracy=" in final[0], final
    # output to a file (here a pipe) has no width: the progress bar's last line keeps every figure of the last step
    # (at rich's 80 columns it ended "t… reward=0 ..."), and a sample table's row is one line, not folded
    bar, logged = [[line for line in log.splitlines() if line.startswith(p)] for p in ("train ━", "train step ")]
    assert bar and all(f" {k}=" in bar[-1] for k in re.findall(r"(\w+)=", logged[-1])), (bar, logged)
    table = log[log.index("eval samples, step"):].splitlines()
    table = table[:next(i for i, line in enumerate(table) if line.startswith("└")) + 1]
    assert len(table) > 4 and all(not a.startswith("│") or b[0] in "├└" for a, b in zip(table, table[1:])), table
    assert "sync_s_per_step" not in results(tmp_path / "run")  # HF generate: nothing synced, nothing timed


def test_grpo_without_an_engine_logs_no_sync_time(toy_world, tmp_path):
    proc = run_main("grpo.py", "--pretrain", toy_world / "model", "--max_samples", 8, "--rollout_batch_size", 8,
                    "--n_samples_per_prompt", 2, "--train_batch_size", 16, "--micro_train_batch_size", 16,
                    "--logging_steps", 1, "--eval_dataset", "", "--save_path", tmp_path / "run")
    log = proc.stdout + proc.stderr
    assert "train step 1: " in log and noise(log) == []
    assert "sync_s_per_step" not in results(tmp_path / "run")


def test_make_pairs_summary_is_rounded(policy, toy_world, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join((toy_world / "prompts_train.jsonl").read_text().splitlines(keepends=True)[:16]))
    proc = run_main("make_pairs.py", "--pretrain", policy, "--dataset", prompts, "--label_key", "label",
                    "--remote_rm_url", ROOT / "toy.py", "--n_samples_per_prompt", 4, "--prompt_max_len", 16,
                    "--generate_max_len", 6, "--save_path", tmp_path / "pairs.jsonl")
    summary = [line for line in proc.stderr.splitlines() if line.startswith("wrote ")]
    assert len(summary) == 1 and rounded(summary[0]) and " mean_score=" in summary[0], summary
    assert noise(proc.stdout + proc.stderr) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="DeepSpeed builds its shm op on a CPU only")
def test_the_shm_op_build_is_announced_once_and_its_line_dropped(tmp_path, monkeypatch, capsys):
    """common.announce_shm_build around what DeepSpeed prints at init_distributed: before a first build (nothing in
    TORCH_EXTENSIONS_DIR) one line saying what is compiled; once built, none; its "built successfully" never, and
    whatever else the call prints passes."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    for built in (False, True):
        with common.announce_shm_build():
            print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully")
            print("something else")
        out = capsys.readouterr()
        assert out.out == "something else\n"
        said = [line for line in out.err.splitlines() if line.startswith("compiling DeepSpeed's")]
        if built:
            assert said == []
        else:
            assert len(said) == 1 and str(tmp_path / "deepspeed_shm_comm") in said[0]
        (tmp_path / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").touch()


def test_merge_lora_prints_no_deprecation(toy_world, tmp_path):
    """peft reads a property transformers 5 deprecates: merge_lora.py in a new process (a warning shows once per
    process) prints its one line and nothing else."""
    run_main("sft.py", "--lora_rank", 4, "--max_samples", 64, "--max_epochs", 1, "--eval_generate_samples", 0,
             "--save_path", tmp_path / "lora")
    proc = run_script("merge_lora.py", "--model_path", toy_world / "model", "--lora_path", tmp_path / "lora",
                      "--output_path", tmp_path / "merged")
    assert noise(proc.stdout + proc.stderr) == [] and "Warning" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"merged {tmp_path / 'lora'} into {toy_world / 'model'}: saved to "
                                                f"{tmp_path / 'merged'}"]


def test_the_toy_world_is_built_without_progress_bars(tmp_path):
    """transformers 5 draws a "Writing model shards" bar for the toy model's 4 MB: python toy.py prints its summary."""
    proc = run_script("toy.py", tmp_path / "world")
    assert proc.stderr == "", proc.stderr
    assert proc.stdout.splitlines()[-1] == f"model/ at {tmp_path / 'world' / 'model'}"


def test_deepspeeds_op_is_cached_in_the_venv(tmp_path):
    """Two checkouts (two venvs) shared torch's per-user cache, and the op's build flags hold each venv's paths: every
    switch rebuilt it (a minute of both cores). In a venv, common keeps it there (unless TORCH_EXTENSIONS_DIR says:
    test_the_shm_op_build_is_announced_once_and_its_line_dropped builds in one it sets)."""
    code = "import common, os; print(os.environ['TORCH_EXTENSIONS_DIR'])"
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    ran = lambda env: subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,  # noqa
                                     text=True, check=True).stdout.strip()
    assert sys.prefix != sys.base_prefix  # (the suite runs in .venv)
    assert ran(env) == os.path.join(sys.prefix, "torch_extensions")
