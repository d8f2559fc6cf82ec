"""The layout: the default path (HF generate; a rule, reward_func file, HTTP or local reward model; DeepSpeed; no
packing) runs through a script and common.py only (test_copies checks that no script imports another; rollout.py is
a deprecation shim no script loads). What a flag adds lives in a module of its own, imported by the line that handles
the flag: importing a script imports none of them, and neither does a short default run of each RL script (so it
enters none of their functions). --help listing every flag is test_options' check."""
import subprocess
import sys

import pytest

from conftest import ROOT

OPTIONAL = ("engines", "agents", "agent_server", "packing", "lora", "process_rewards", "speedups", "checkpoints",
            "trackers", "rollout", "partial_rollout")
SCRIPTS = ("sft.py", "rm.py", "prm.py", "dpo.py", "grpo.py", "ppo.py", "online_dpo.py", "distill.py", "make_pairs.py",
           "serve_rm.py", "merge_lora.py")
# run a script in a fresh interpreter (or, with no flags, import the scripts named), then say which optional
# modules are loaded
PROBE = """
import importlib, runpy, sys
root, script, *flags = sys.argv[1:]
sys.path.insert(0, root)
if flags:
    sys.argv = [script, *flags]
    runpy.run_path(f"{root}/{script}", run_name="__main__")
else:
    for name in script.split(","):
        importlib.import_module(name[:-3])
print("loaded:" + ",".join(m for m in %r if m in sys.modules))
""" % (OPTIONAL,)


def loaded(script, *flags, cwd=ROOT):
    proc = subprocess.run([sys.executable, "-c", PROBE, str(ROOT), script, *map(str, flags)], capture_output=True,
                          text=True, timeout=600, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def test_importing_the_scripts_loads_no_optional_module():
    assert loaded(",".join(SCRIPTS)) == "loaded:"


@pytest.mark.parametrize("script, flags", [
    ("grpo.py", []),
    ("ppo.py", ["--remote_rm_url", ROOT / "toy.py"]),
    ("online_dpo.py", ["--remote_rm_url", ROOT / "toy.py", "--num_episodes", 1]),
    ("distill.py", ["--teacher_pretrain", "TOY_MODEL", "--lmbda", 1, "--num_episodes", 1]),
])
def test_a_default_rl_run_loads_no_optional_module(toy_world, tmp_path, script, flags):
    """The toy world's defaults, cut short: the rollout, the rewards, the update, the eval and the save all ran."""
    eval_file = tmp_path / "eval.jsonl"
    held_out = toy_world / ("sft_test.jsonl" if script == "distill.py" else "prompts_test.jsonl")  # the toy data's
    eval_file.write_text("".join(held_out.read_text().splitlines(keepends=True)[:16]))
    short = ["--max_samples", 64, "--eval_dataset", eval_file, "--save_path", tmp_path / "run"]
    flags = [toy_world / "model" if f == "TOY_MODEL" else f for f in flags]
    assert loaded(script, *flags, *short, cwd=tmp_path) == "loaded:"
    assert (tmp_path / "run" / "eval_results.json").exists()


def test_a_flag_loads_its_module(toy_world, tmp_path):
    """The other side: the line that handles a flag imports its module (here --packing_samples, --lora_rank,
    --save_steps and --use_tensorboard)."""
    out = loaded("sft.py", "--max_samples", 64, "--max_epochs", 1, "--packing_samples", "--lora_rank", 4,
                 "--save_steps", 1, "--use_tensorboard", tmp_path / "tb", "--save_path", tmp_path / "run", cwd=tmp_path)
    assert out == "loaded:packing,lora,checkpoints,trackers"


def test_generated_files_are_ignored_by_git():
    """What running the scripts leaves in a checkout (the toy world's lock beside it, runs/, models/) is ignored."""
    paths = [".toy_world.lock", "toy_world/VERSION", "runs/sft/model.safetensors", "models/x", ".venv/x"]
    ignored = subprocess.run(["git", "check-ignore", *paths], cwd=ROOT, capture_output=True, text=True).stdout.split()
    assert ignored == paths
