"""What a resume checks (issue 64): a checkpoint records the run that wrote it (run.json: the script, the model it
started from, the flags that shape its state), and --load_checkpoint on another script's checkpoint, from another
model or flags, or on a finished run stops in one line before anything loads; a checkpoint written before run.json
still resumes. Ctrl-C ends a run in one line naming the last checkpoint and the command that resumes, rc 130."""
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, run_main

SCRIPTS = ["sft.py", "rm.py", "prm.py", "dpo.py", "grpo.py", "ppo.py", "online_dpo.py", "distill.py"]
# one optimizer step (SFT-like) or one rollout step (RL) of each script on the toy world's defaults, no eval
ONE_STEP = {
    **dict.fromkeys(["sft.py", "rm.py", "prm.py", "dpo.py"],
                    ["--max_samples", 16, "--train_batch_size", 16, "--micro_train_batch_size", 8, "--max_epochs", 1]),
    **dict.fromkeys(["grpo.py", "ppo.py", "online_dpo.py", "distill.py"],
                    ["--max_samples", 8, "--rollout_batch_size", 8, "--train_batch_size", 16,
                     "--micro_train_batch_size", 8, "--num_episodes", 1, "--micro_rollout_batch_size", 16]),
}
EXTRA = {"grpo.py": ["--n_samples_per_prompt", 2],
         "ppo.py": ["--n_samples_per_prompt", 2, "--remote_rm_url", ROOT / "toy.py"],
         "online_dpo.py": ["--remote_rm_url", ROOT / "toy.py", "--train_batch_size", 8],
         "distill.py": ["--train_batch_size", 8], "dpo.py": ["--eval_generate_samples", 0]}


def one_step(script, tmp, toy_world):
    teacher = ["--teacher_pretrain", toy_world / "model"] if script == "distill.py" else []
    return [*ONE_STEP[script], *EXTRA.get(script, []), *teacher, "--eval_dataset", "", "--save_steps", 1,
            "--save_path", tmp / script.removesuffix(".py")]


@pytest.fixture(scope="module")
def checkpoints(toy_world, tmp_path_factory):
    """{script: its --ckpt_path after one step, saved}: real checkpoints, each script's own."""
    tmp = tmp_path_factory.mktemp("checkpoints")
    out = {}
    for script in SCRIPTS:
        run_main(script, *one_step(script, tmp, toy_world))
        out[script] = tmp / (script.removesuffix(".py") + "_checkpoints")
        assert (out[script] / "latest").read_text() == "global_step1"
    return out


def error(proc):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and lines[-1].startswith("error: "), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    return lines[-1]


@pytest.mark.parametrize("script", SCRIPTS)
def test_another_scripts_checkpoint_stops_in_one_line(checkpoints, script, tmp_path, toy_world):
    """Every script's --load_checkpoint against every other script's checkpoint: one line naming both, and nothing
    saved (the issue's case: grpo.py took sft.py's step 20 and saved SFT's weights as its result, rc 0)."""
    for other in SCRIPTS:
        if other == script:
            continue
        proc = run_main(script, *one_step(script, tmp_path, toy_world), "--load_checkpoint", "--ckpt_path",
                        checkpoints[other], check=False)
        assert error(proc) == (f"error: --load_checkpoint: {checkpoints[other] / 'global_step1'} was written by "
                               f"{other}, not {script}: give this run's own --ckpt_path (by default --save_path + "
                               "_checkpoints)")
        assert not (tmp_path / script.removesuffix(".py")).exists()


def test_a_finished_run_another_model_or_flags_stop(checkpoints, tmp_path, toy_world):
    """A finished run (its final model saved after its last checkpoint), another model (toy_world's model_half: the
    same architecture, other weights), another state-shaping flag: one line each. A model moved elsewhere is the
    same model: its run resumes."""
    ckpt = tmp_path / "sft_checkpoints"
    shutil.copytree(checkpoints["sft.py"], ckpt)
    tag = ckpt / "global_step1"
    run = json.loads((tag / "run.json").read_text())
    assert run.keys() == {"script", "pretrain", "model", "lora_rank", "target_modules", "zero_stage"}
    assert run["script"] == "sft.py" and run["pretrain"] == str(toy_world / "model") and run["lora_rank"] == 0
    resume = [*one_step("sft.py", tmp_path, toy_world), "--load_checkpoint", "--ckpt_path", ckpt]
    out = tmp_path / "sft"
    shutil.copytree(checkpoints["sft.py"].parent / "sft", out)  # the finished run's model, written after its checkpoint
    assert error(run_main("sft.py", *resume, check=False)) == (
        f"error: --load_checkpoint: {tag} is at step 1, this run has 1 steps: the run is finished (its model: "
        f"{out}); more epochs or episodes continue it; a new --ckpt_path starts afresh")
    assert error(run_main("sft.py", *resume, "--pretrain", toy_world / "model_half", check=False)) == (
        f"error: --load_checkpoint: {tag} continues a run from --pretrain {toy_world / 'model'}, another model than "
        f"this run's --pretrain {toy_world / 'model_half'} (their configs or weights differ): resume with the model it "
        "started from, or give a new --ckpt_path")
    assert error(run_main("sft.py", *resume, "--lora_rank", 4, check=False)) == (
        f"error: --load_checkpoint: {tag} continues a run with --lora_rank 0, this run has --lora_rank 4: resume with "
        "the flags it was saved with, or give a new --ckpt_path")

    # a run stopped after its last checkpoint, before its final save (a crash in the final eval, Ctrl-C): resumed, it
    # trains no step and saves the model; its model moved to another directory is still its model
    shutil.rmtree(out)
    moved = shutil.copytree(toy_world / "model", tmp_path / "moved" / "model")
    proc = run_main("sft.py", *resume, "--pretrain", moved)
    assert f"resumed from {ckpt} at step 1" in proc.stderr and (out / "eval_results.json").is_file()


def test_a_checkpoint_without_run_json_still_resumes(checkpoints, tmp_path, toy_world):
    """Checkpoints written before run.json existed resume as before (a line says they were not checked); one past
    the run's steps still stops (the issue's grpo-on-sft case, as an old checkpoint: step 20 of a 2-step run)."""
    old = tmp_path / "old_checkpoints"  # resumed by a run of 2 steps
    shutil.copytree(checkpoints["sft.py"], old)
    (old / "global_step1" / "run.json").unlink()
    flags = [*one_step("sft.py", tmp_path, toy_world), "--max_samples", 32, "--load_checkpoint", "--ckpt_path", old]
    proc = run_main("sft.py", *flags)
    assert f"--load_checkpoint: {old / 'global_step1'} has no run.json" in proc.stderr
    assert f"resumed from {old} at step 1" in proc.stderr
    assert json.loads((old / "global_step2" / "run.json").read_text())["script"] == "sft.py"  # checked from now on
    (old / "global_step2" / "run.json").unlink()
    (old / "global_step2").rename(old / "global_step20")
    (old / "latest").write_text("global_step20")
    assert error(run_main("sft.py", *flags, check=False)) == (
        f"error: --load_checkpoint: {old / 'global_step20'} is at step 20, this run has 2 steps: past this run's end: "
        "the run that saved it was longer (more epochs, samples or episodes); a new --ckpt_path starts afresh")


def interrupt(cmd, cwd, ready, log):
    """Start `cmd`, send it SIGINT (Ctrl-C) once ready(log text) holds -> (its exit status, what it printed)."""
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=err, text=True)
    deadline = time.time() + 300
    while not ready(log.read_text()):
        assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=120)
    return proc.returncode, log.read_text()


def test_ctrl_c_says_where_the_checkpoint_is_and_how_to_resume(toy_world, tmp_path):
    """The issue's case: ~80 lines of KeyboardInterrupt traceback. Now one line, rc 130, and the command it gives
    resumes (interrupted again, it says the same without a second --load_checkpoint)."""
    flags = ["--max_samples", 64, "--train_batch_size", 16, "--micro_train_batch_size", 8, "--max_epochs", 100,
             "--save_steps", 2, "--eval_dataset", "", "--save_path", "out"]
    cmd = [sys.executable, str(ROOT / "sft.py"), *map(str, flags)]
    latest = tmp_path / "out_checkpoints" / "latest"
    code, log = interrupt(cmd, tmp_path, lambda _: latest.exists(), tmp_path / "first.log")
    last = log.strip().splitlines()[-1]
    assert code == 130 and "Traceback" not in log and "KeyboardInterrupt" not in log, log[-3000:]
    resume = shlex.join(["python", str(ROOT / "sft.py"), *map(str, flags), "--load_checkpoint"])
    assert last == f"interrupted: the last checkpoint is out_checkpoints/{latest.read_text()}; resume with {resume}"
    step = int(latest.read_text().removeprefix("global_step"))

    command = shlex.split(last.split("resume with ")[1])
    code, log = interrupt([sys.executable, *command[1:]], tmp_path, lambda text: "resumed from" in text,
                          tmp_path / "second.log")
    assert f"resumed from out_checkpoints at step {step}" in log
    assert code == 130 and log.strip().splitlines()[-1].endswith(f"resume with {resume}"), log[-3000:]
