"""Two nodes on one machine, started as a user starts them: `torchrun --nnodes 2 --nproc_per_node 1 --node_rank K
--master_addr 127.0.0.1 --master_port P` in two processes (gloo), each node in a working directory of its own: its
relative --save_path and --ckpt_path are what a node keeps on its own disk; the models, data and toy world sit at
absolute paths both read (a shared filesystem, or the same copy on every node). Each run is checked against the same
two ranks on one node: the same logged numbers, the final model written once (on node 0), checkpoints on both nodes'
disks that resume on both to the weights of the run never interrupted; and a toy world both nodes build at once. Then a
two-node Ray cluster (Ray's cluster utilities) whose vLLM engines land on both nodes."""
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from transformers import AutoModelForSequenceClassification

import common
from conftest import ROOT, max_diff, run_script, weights

SFT = ["--max_samples", 128, "--train_batch_size", 32, "--micro_train_batch_size", 16, "--max_epochs", 1,
       "--zero_stage", 3, "--eval_generate_samples", 0]  # 4 steps
RL = ["--max_samples", 32, "--rollout_batch_size", 8, "--n_samples_per_prompt", 2, "--train_batch_size", 16,
      "--micro_train_batch_size", 8, "--eval_dataset", ""]  # 4 steps of 8 prompts x 2


def two_nodes(script, *args, root, env=None, timeout=600, check=True):
    """Node 0 and node 1 of one run, each in root/node{K}: -> what each printed (with check, after both succeeded)."""
    port, procs = common.free_port(), []
    for node in (0, 1):
        cwd = root / f"node{node}"
        cwd.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1", "--node_rank",
               str(node), "--master_addr", "127.0.0.1", "--master_port", str(port), str(ROOT / script),
               *map(str, args)]
        log = open(cwd / f"{script}.log", "w")  # a file, not a pipe: a node blocked on a full pipe would stall both
        procs.append((subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                       env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))), log))
    try:
        for proc, _ in procs:
            proc.wait(timeout=timeout)
    finally:  # a node that hangs must not outlive the test, nor its workers
        for proc, log in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            log.close()
    outs = [(root / f"node{node}" / f"{script}.log").read_text() for node in (0, 1)]
    for node, (proc, _) in enumerate(procs):
        assert proc.returncode == 0 or not check, f"node {node} failed:\n{outs[node][-6000:]}"
    return outs


def logged(text):
    """Every 'train step' line's numbers but the seconds: {step: {key: value}}."""
    out = {}
    for line in text.splitlines():
        if line.startswith("train step"):
            step, rest = line[len("train step "):].split(": ", 1)
            out[int(step)] = {k: float(v) for k, v in (kv.split("=") for kv in rest.split()) if not k.endswith("_s")}
    return out


def check_run(root, one_node, save, ckpt, steps, kept, critic=False):
    """The two-node run against the one-node one: the same numbers at every step; the model on node 0 only; on each
    node's disk its checkpoints: 'latest' naming the last step, the last --max_ckpt_num steps, its own rank's RNG."""
    node = [root / "node0", root / "node1"]
    two = logged(next(node[0].glob("*.py.log")).read_text())
    assert sorted(two) == list(range(1, steps + 1))
    for step, numbers in logged(one_node).items():
        assert two[step] == pytest.approx(numbers, rel=1e-6, abs=1e-9), step
    assert (node[0] / save / "config.json").exists() and not (node[1] / save).exists()
    assert (node[0] / f"{save}_critic" / "config.json").exists() == critic
    for k in (0, 1):
        for d in [node[k] / ckpt] + ([node[k] / ckpt / "critic"] if critic else []):
            assert (d / "latest").read_text() == f"global_step{steps}", (k, d)
            assert sorted(p.name for p in d.glob("global_step*")) == [f"global_step{s}" for s in kept], (k, d)
        assert [p.name for p in (node[k] / ckpt / f"global_step{steps}").glob("rng_rank*.pt")] == [f"rng_rank{k}.pt"]


def roll_back(root, ckpt, to, critic=False):
    """Both nodes back to step `to`, as after a crash: the later checkpoints gone, 'latest' naming it."""
    for k in (0, 1):
        for d in [root / f"node{k}" / ckpt] + ([root / f"node{k}" / ckpt / "critic"] if critic else []):
            for p in d.glob("global_step*"):
                if int(p.name[len("global_step"):]) > to:
                    shutil.rmtree(p)
            (d / "latest").write_text(f"global_step{to}")


CKPT = ["--logging_steps", 1, "--save_steps", 1, "--max_ckpt_num", 2]


def test_sft_zero3(toy_world, tmp_path):
    one = run_script("sft.py", *SFT, *CKPT, "--save_path", tmp_path / "one" / "sft", nproc=2)
    two_nodes("sft.py", *SFT, *CKPT, "--save_path", "runs/sft", root=tmp_path)
    check_run(tmp_path, one.stdout + one.stderr, "runs/sft", "runs/sft_checkpoints", 4, [3, 4])
    roll_back(tmp_path, "runs/sft_checkpoints", 3)
    out = two_nodes("sft.py", *SFT, *CKPT, "--save_path", "runs/sft_b", "--ckpt_path", "runs/sft_checkpoints",
                    "--load_checkpoint", root=tmp_path)
    assert "resumed from runs/sft_checkpoints at step 3" in out[0]
    assert max_diff(weights(tmp_path / "node0/runs/sft"), weights(tmp_path / "node0/runs/sft_b")) < 1e-6
    # node 1 alone rolled back: the nodes would resume from different steps, and both stop saying so
    (tmp_path / "node1/runs/sft_checkpoints/latest").write_text("global_step3")
    out = two_nodes("sft.py", *SFT, "--save_path", "runs/sft_c", "--ckpt_path", "runs/sft_checkpoints",
                    "--load_checkpoint", root=tmp_path, check=False)
    for node in out:  # (torchrun's failure report follows it)
        errors = [line for line in node.splitlines() if line.startswith("error: ")]
        assert errors == ["error: --load_checkpoint: the ranks see different checkpoints in runs/sft_checkpoints "
                          "(rank 0: global_step4, rank 1: global_step3); every node needs the same step"], errors


def test_grpo_zero2_and_a_toy_world_both_nodes_build(policy, toy_world, tmp_path):
    """ZeRO-2: DeepSpeed's model-states file, written on rank 0 alone unless each node's first process writes its own
    copy. The nodes share a toy world not yet built: both build it at once, one at a time."""
    flags = [*RL, "--pretrain", policy, "--zero_stage", 2, *CKPT]
    one = run_script("grpo.py", *flags, "--save_path", tmp_path / "one" / "grpo", nproc=2)
    world = tmp_path / "shared" / "toy_world"
    two_nodes("grpo.py", *flags, "--save_path", "runs/grpo", root=tmp_path, env={"TOY_WORLD_DIR": str(world)})
    assert (world / "VERSION").read_text() == (toy_world / "VERSION").read_text()
    assert not list(world.parent.glob(".toy_world-*"))  # no half-built copy left behind
    check_run(tmp_path, one.stdout + one.stderr, "runs/grpo", "runs/grpo_checkpoints", 4, [3, 4])
    roll_back(tmp_path, "runs/grpo_checkpoints", 3)
    two_nodes("grpo.py", *flags, "--save_path", "runs/grpo_b", "--ckpt_path", "runs/grpo_checkpoints",
              "--load_checkpoint", root=tmp_path)
    assert max_diff(weights(tmp_path / "node0/runs/grpo"), weights(tmp_path / "node0/runs/grpo_b")) < 1e-6


def test_ppo_with_its_critic(policy, tmp_path):
    flags = [*RL, "--pretrain", policy, "--remote_rm_url", ROOT / "toy.py", "--save_value_network", *CKPT]
    one = run_script("ppo.py", *flags, "--save_path", tmp_path / "one" / "ppo", nproc=2)
    two_nodes("ppo.py", *flags, "--save_path", "runs/ppo", root=tmp_path)
    check_run(tmp_path, one.stdout + one.stderr, "runs/ppo", "runs/ppo_checkpoints", 4, [3, 4], critic=True)
    roll_back(tmp_path, "runs/ppo_checkpoints", 3, critic=True)
    two_nodes("ppo.py", *flags, "--save_path", "runs/ppo_b", "--ckpt_path", "runs/ppo_checkpoints",
              "--load_checkpoint", root=tmp_path)
    node0 = tmp_path / "node0" / "runs"
    assert max_diff(weights(node0 / "ppo"), weights(node0 / "ppo_b")) < 1e-6
    critic = (weights(node0 / name, AutoModelForSequenceClassification) for name in ("ppo_critic", "ppo_b_critic"))
    assert max_diff(*critic) < 1e-6


BUILD = """
import sys, toy
built = toy.build_tokenizer
toy.build_tokenizer = lambda: (print("building", flush=True), built())[1]
world = toy.ensure_toy_world(sys.argv[1])
assert toy.is_current(world) and (world / "model" / "model.safetensors").exists()
"""


def test_concurrent_callers_find_one_world_built(tmp_path):
    """Four processes (ranks of two nodes) ask for a stale world at once: one builds, the others wait and find it."""
    world = tmp_path / "toy_world"
    world.mkdir()
    (world / "VERSION").write_text("stale")
    procs = [subprocess.Popen([sys.executable, "-c", BUILD, str(world)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=str(ROOT))) for _ in range(4)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4
    assert sum(out.count("building") for out in outs) == 1


def test_grpo_ray_engines_on_both_nodes_of_a_ray_cluster(policy, tmp_path):
    """A two-node Ray cluster on this machine (Ray's own cluster utilities: a head and a second node, 1 CPU each),
    joined by both trainer nodes with --ray_address: the 2 engines land one on each Ray node, the run ends, and the
    actors it started are gone with it; then the cluster goes, leaving no Ray process behind."""
    from ray.cluster_utils import Cluster
    from test_async import ray_processes

    before = ray_processes()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        running = ray_processes()
        out = two_nodes("grpo.py", *RL, "--pretrain", policy, "--ray", "--ray_address", cluster.address,
                        "--vllm_num_engines", 2, "--save_path", "runs/grpo", root=tmp_path)
        assert "2 vLLM engines on 2 Ray node(s)" in out[0]
        assert gone(lambda: ray_processes() - running)  # the engines and workers the run started
    finally:
        cluster.shutdown()
    assert gone(lambda: ray_processes() - before)


def gone(left, seconds=60):
    """Whether left() (processes) empties within `seconds`: Ray stops a finished job's workers, then a cluster's
    own processes, a moment after it is told."""
    deadline = time.time() + seconds
    while left() and time.time() < deadline:
        time.sleep(1)
    return not left()
