"""--async_steps N (grpo.py and ppo.py with --ray): the next batches are generated on the Ray engine while the
trainer updates. Checked: no batch is more than N weight versions old, and the engine's log-probs of each
batch equal a plain HF forward of exactly the weights the engine reported (snapshotted as the trainer sent
them), and not of the newer ones; a resumed run trains on the same prompts; SIGTERM and an exception in the
trainer leave no Ray process behind."""
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

# conftest puts the repository on sys.path: this file also runs as a script (recorded_run)
from conftest import ROOT, logged, results, run_script, stock_accuracy, weights

import engines  # noqa: E402

STEPS = ["--max_samples", 80, "--rollout_batch_size", 16, "--n_samples_per_prompt", 4, "--train_batch_size", 32,
         "--micro_train_batch_size", 16, "--logging_steps", 1]  # 5 steps of 16 prompts x 4 samples


def ray_processes():
    """The Ray processes on this machine (head, raylet, workers and actors)."""
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    kinds = ("ray::", "raylet", "gcs_server", "ray/dashboard", "log_monitor", "runtime_env")
    return {line.split()[0] for line in out.splitlines() if any(k in line for k in kinds)}


def recorded_run(out_path, *argv):
    """Run grpo.py's main() in this process, recording each batch the trainer takes (prompts, tokens, engine
    log-probs, the version the engine reported, --partial_rollout: each token's) and the weights of each version as
    the trainer sends them. $SLOW_DECODING (--partial_rollout): seconds the engine sleeps at each decoding step, so
    that batches are still generating when the weights change."""
    import grpo
    import partial_rollout

    taken, sent = [], {}
    draw, sync, start = grpo.draw, engines.RayEngines.sync, partial_rollout.InflightEngine.start
    slow = float(os.environ.get("SLOW_DECODING", 0))

    def recording_draw(*args):
        batch = draw(*args)
        taken.append({"prompts": [r["ids"].tolist() for r in batch.records],
                      "responses": [r.tolist() for _, r in batch.pairs()],
                      "engine_logprobs": [lp[:n].tolist() for lp, n in zip(batch.logprobs, batch.lengths)],
                      "version": batch.version, "versions": None if batch.versions is None else
                      [v[:n].tolist() for v, n in zip(batch.versions, batch.lengths)], "cursor": batch.cursor})
        return batch

    def recording_sync(self, model, version=0):
        sent[version] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if not slow:
            time.sleep(1.0)  # a slow update: the producer gets as far ahead as it may, however busy the machine
        return sync(self, model, version)

    def slow_start(self):  # runs in the engine's actor, this class being pickled by value
        start(self)
        step = self.llm.llm_engine.step
        self.llm.llm_engine.step = lambda: time.sleep(slow) or step()

    grpo.draw, engines.RayEngines.sync = recording_draw, recording_sync
    if slow:
        partial_rollout.InflightEngine.start = slow_start
    sys.argv = ["grpo.py", *argv]
    grpo.main()
    taken.sort(key=lambda b: b["cursor"])  # in the order trained (--partial_rollout's batches may end out of order)
    torch.save({"taken": taken, "sent": sent}, out_path)


def test_producer_runs_at_most_n_ahead_in_order():
    """engines.Producer alone, with a make() that notes the trainer's version when it starts: results in order,
    `count` of them, each started on version >= its index - N, as far ahead as that allows; an error in
    make() comes out of get()."""
    for n in (0, 1, 3):
        version, started = [0], []

        def make():
            started.append(version[0])
            return len(started) - 1

        producer = engines.Producer(make, n, 6)
        for t in range(6):
            assert producer.get() == t
            time.sleep(0.05)  # let it run ahead as far as it may
            assert len(started) == min(t + n + 1, 6)  # n + 1 ahead of the t releases so far, never more
            version[0] = t + 1  # the update, then the sync
            producer.release()
        time.sleep(0.05)
        assert len(started) == 6 and all(v >= i - n for i, v in enumerate(started)), (n, started)

    def failing():
        raise ValueError("the engine went away")

    with pytest.raises(ValueError, match="the engine went away"):
        engines.Producer(failing, 1, 3).get()


def test_overlapping_producer_has_batches_in_flight_side_by_side_in_order():
    """--partial_rollout's Producer: the next make() starts once this one's batch is queued (submitted()), not when
    it is done, so up to N + 1 wait on the engine at once; each reads the prompt stream in turn and the results come
    out in that order, whichever finishes first."""
    stream, waiting, finish = iter(range(6)), [], {k: threading.Event() for k in range(6)}

    def make():
        k = next(stream)
        waiting.append(k)
        engines.submitted()
        finish[k].wait(10)  # the engine's answer; the later batch is done first
        return k

    producer = engines.Producer(make, 1, 6, overlap=True)
    producer.thread.start()
    time.sleep(0.2)
    assert waiting == [0, 1]  # two in flight before either ended: N + 1 permits, never more
    finish[1].set()
    time.sleep(0.1)
    assert waiting == [0, 1]  # batch 1's end frees nothing: only the trainer's release() does
    finish[0].set()
    for t in range(6):
        finish[t].set()
        assert producer.get() == t
        producer.release()
    assert waiting == list(range(6))


def logprobs_under(model, prompt, response, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].double() / temperature
    logp = torch.log_softmax(logits, -1)
    return logp[torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1), torch.tensor(response)]


def test_async_batches_are_at_most_n_versions_old(policy, tmp_path):
    """N = 2, so the producer gets two batches ahead. N = 1 (the usual setting) is bounded by the logged staleness the
    other --async_steps 1 runs assert (at most 1, and 1 reached), and this run shows the logged staleness is the
    real one."""
    from transformers import AutoModelForCausalLM

    n = 2
    out = tmp_path / "record.pt"
    proc = subprocess.run([sys.executable, __file__, str(out), *map(str, STEPS), "--pretrain", str(policy),
                           "--eval_dataset", "", "--ray", "--async_steps", str(n), "--temperature", "0.8",
                           "--learning_rate", "5e-4",
                           "--save_path", str(tmp_path / "run")], capture_output=True, text=True, timeout=600,
                          cwd=ROOT, env=dict(os.environ, TORCHDYNAMO_DISABLE="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    record = torch.load(out)
    taken, sent = record["taken"], record["sent"]
    versions = [b["version"] for b in taken]
    assert len(taken) == 5 and sorted(sent) == [0, 1, 2, 3, 4, 5]
    # step t trains on weights of version t (t updates); its batch was sampled with weights t - n .. t
    assert all(t - n <= v <= t for t, v in enumerate(versions)), versions
    assert any(v == t - n for t, v in enumerate(versions) if t >= n), versions  # it really ran ahead
    log = proc.stdout + proc.stderr
    stale = [float(line.split(" staleness_max=")[1].split()[0]) for line in log.splitlines()
             if line.startswith("train step")]
    assert stale == [float(t - v) for t, v in enumerate(versions)]  # what the log says is what happened

    model = AutoModelForCausalLM.from_pretrained(policy).eval()
    told_apart = 0
    for t, batch in enumerate(taken):
        v = batch["version"]
        model.load_state_dict(sent[v])
        diff = max((torch.tensor(lp, dtype=torch.float64) - logprobs_under(model, p, r, 0.8)).abs().max().item()
                   for p, r, lp in zip(batch["prompts"], batch["responses"], batch["engine_logprobs"]))
        assert diff <= 1e-4, (t, v, diff)  # the engine had exactly the weights of the version it reported
        # and not the next version's, where the update moved these log-probs past 1e-3 (a step whose groups all
        # scored alike has zero advantages, and a small one hardly moves them: those two versions cannot be told
        # apart here), at least twice
        if v + 1 in sent:
            model.load_state_dict(sent[v + 1])
            newer = max((torch.tensor(lp, dtype=torch.float64) - logprobs_under(model, p, r, 0.8)).abs().max().item()
                        for p, r, lp in zip(batch["prompts"], batch["responses"], batch["engine_logprobs"]))
            told_apart += newer > 1e-3
    assert told_apart >= 2


def test_partial_rollout_tokens_carry_their_versions(policy, tmp_path):
    """--partial_rollout --async_steps 1, the engine slowed so that batches are generating at every sync: a sample's
    versions rise at most once (where the sync it spans happened), from at most N = 1 version behind the trainer;
    each token's engine log-prob is a plain HF forward's under the weights of its own version (the tokens before it
    included, as the engine prefilled them again), and after a sync not the old weights' any more; the logged
    staleness and spanning_sync are what the record shows."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "record.pt"
    proc = subprocess.run([sys.executable, __file__, str(out), *map(str, STEPS), "--pretrain", str(policy),
                           "--eval_dataset", "", "--ray", "--async_steps", "1", "--partial_rollout", "--temperature",
                           "0.8", "--learning_rate", "5e-4", "--save_path", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env=dict(os.environ, TORCHDYNAMO_DISABLE="1", SLOW_DECODING="0.3"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    record = torch.load(out)
    taken, sent = record["taken"], record["sent"]
    assert len(taken) == 5 and sorted(sent) == [0, 1, 2, 3, 4, 5]
    model = AutoModelForCausalLM.from_pretrained(policy).eval()
    spans, told_apart = [], 0
    for t, batch in enumerate(taken):
        assert batch["version"] == min(v[0] for v in batch["versions"])
        spans.append([])
        for prompt, response, lp, versions in zip(batch["prompts"], batch["responses"], batch["engine_logprobs"],
                                                  batch["versions"]):
            lp = torch.tensor(lp, dtype=torch.float64)
            changes = [j for j in range(1, len(versions)) if versions[j] != versions[j - 1]]
            assert len(changes) <= 1 and versions == sorted(versions) and t - 1 <= versions[0] <= versions[-1] <= t
            spans[-1].append(bool(changes))
            for v in set(versions):
                model.load_state_dict(sent[v])
                mine = torch.tensor(versions) == v
                diff = (lp - logprobs_under(model, prompt, response, 0.8))[mine].abs().max().item()
                assert diff <= 1e-4, (t, v, diff)  # the weights of its own version, the text before it re-read
            if changes:  # the tokens after the sync: not the old weights' log-probs
                model.load_state_dict(sent[versions[0]])
                told_apart += (lp - logprobs_under(model, prompt, response, 0.8))[changes[0]:].abs().max() > 1e-3
    assert any(map(any, spans)) and told_apart >= 1, spans  # the syncs really met generating batches
    log = proc.stdout + proc.stderr
    assert logged(log, "staleness_max") == [float(t - b["version"]) for t, b in enumerate(taken)]
    assert logged(log, "spanning_sync") == pytest.approx([sum(s) / len(s) for s in spans], abs=1e-3)
    assert all(a + b == pytest.approx(1, abs=1e-3)
               for a, b in zip(logged(log, "tokens_age_0"), logged(log, "tokens_age_1")))


def test_async_resume_trains_on_the_same_prompts(policy, tmp_path):
    """A checkpoint stores where the prompt stream stood after the batch trained on, not after the batches the
    producer sampled ahead: the resumed run samples those again and trains on exactly the prompts the
    uninterrupted run trained on from there; the resumed run has --partial_rollout, whose producer keeps several
    batches in flight and must still read the prompts in order."""
    flags = [*map(str, STEPS), "--pretrain", str(policy), "--eval_dataset", "", "--ray", "--async_steps", "1",
             "--ckpt_path", str(tmp_path / "ckpt")]
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1")
    for name, extra in (("a", ["--save_steps", "2"]), ("b", ["--load_checkpoint", "--partial_rollout"])):
        proc = subprocess.run([sys.executable, __file__, str(tmp_path / f"{name}.pt"), *flags, *extra,
                               "--save_path", str(tmp_path / name)], capture_output=True, text=True, timeout=600,
                              cwd=ROOT, env=env)
        assert proc.returncode == 0, proc.stderr[-4000:]
        if name == "a":  # resume from the step-2 checkpoint
            (tmp_path / "ckpt" / "latest").write_text("global_step2")
    a, b = torch.load(tmp_path / "a.pt")["taken"], torch.load(tmp_path / "b.pt")["taken"]
    assert "resumed from" in proc.stdout + proc.stderr
    assert [x["prompts"] for x in b] == [x["prompts"] for x in a[2:]]
    assert b[0]["version"] == 2  # the engine starts on the checkpoint's weights
    assert a[-1]["versions"] is None and b[-1]["versions"] is not None


@pytest.mark.parametrize("how", ["sigterm", "exception", "engine killed"])
def test_async_run_stopped_leaves_no_ray_process(policy, tmp_path, how):
    """SIGTERM, an exception in the trainer, or the engine's process killed mid-generation (--partial_rollout) stop
    the run, the last two in one line, and leave no Ray process behind."""
    before = ray_processes()
    flags = [*STEPS, "--max_samples", 800, "--pretrain", policy, "--eval_dataset", "", "--ray", "--async_steps", 1,
             "--save_path", tmp_path / "run", *(["--partial_rollout"] if how == "engine killed" else [])]
    if how == "exception":  # the trainer's reward function fails at the third step
        reward = tmp_path / "reward.py"
        reward.write_text("calls = [0]\n\ndef reward_func(queries, prompts, labels):\n    calls[0] += 1\n"
                          "    if calls[0] == 3:\n        raise ValueError('the reward service went away')\n"
                          "    return [0.0] * len(queries)\n")
        proc = run_script("grpo.py", *flags, "--remote_rm_url", reward, check=False)
        assert proc.returncode != 0 and "the reward service went away" in proc.stderr
    else:
        log = tmp_path / "log.txt"
        with open(log, "w") as f:
            proc = subprocess.Popen([sys.executable, str(ROOT / "grpo.py"), *map(str, flags)], stdout=f,
                                    stderr=subprocess.STDOUT, cwd=ROOT)
            for _ in range(300):
                if "train step 2:" in log.read_text() or proc.poll() is not None:
                    break
                time.sleep(1)
            assert ray_processes() - before  # the engine and the cluster are up
            if how == "sigterm":
                proc.send_signal(signal.SIGTERM)
            else:
                out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
                engine = [int(line.split()[0]) for line in out.splitlines() if "ray::InflightEngine" in line]
                assert len(engine) == 1, out
                os.kill(engine[0], signal.SIGKILL)
            assert proc.wait(timeout=120) != 0
        text = log.read_text()
        assert ("error: stopped by SIGTERM" if how == "sigterm" else "error: --ray: a vLLM engine failed") in text
        assert "Traceback" not in text, text[-3000:]
    for _ in range(30):  # the cluster's processes exit within seconds of the driver
        if not ray_processes() - before:
            break
        time.sleep(1)
    assert not ray_processes() - before


def test_grpo_async_two_processes_zero3(policy, eval_file, tmp_path):
    """Two trainer ranks under ZeRO-3 share one Ray engine, each with its own producer thread: staleness at
    most 1 on both, and the reported accuracy is the saved model's."""
    proc = run_script("grpo.py", *STEPS, "--pretrain", policy, "--eval_dataset", eval_file, "--ray", "--async_steps",
                      1, "--zero_stage", 3, "--save_path", tmp_path / "z3", nproc=2)
    stale = [float(line.split(" staleness_max=")[1].split()[0]) for line in (proc.stdout + proc.stderr).splitlines()
             if line.startswith("train step")]
    assert len(stale) == 5 and max(stale) == 1, stale
    assert results(tmp_path / "z3")["eval_accuracy"] == stock_accuracy(tmp_path / "z3", eval_file)


def test_ppo_async(policy, eval_file, tmp_path):
    """ppo.py --ray --async_steps 1 --partial_rollout (in-flight weight updates; the whole-batch producer is grpo's
    tests' and shares all of ppo.py's code but that flag) with a critic warm-up step: the first batches come from the
    starting weights, later ones at most one actor update old; it trains, reports the accuracy HF measures, and leaves
    no Ray process behind when it ends."""
    before_run = ray_processes()
    proc = run_script("ppo.py", "--max_samples", 64, "--rollout_batch_size", 16, "--train_batch_size", 16,
                      "--micro_train_batch_size", 16, "--logging_steps", 1, "--pretrain", policy, "--remote_rm_url",
                      ROOT / "toy.py", "--eval_dataset", eval_file, "--ray", "--async_steps", 1, "--partial_rollout",
                      "--freezing_actor_steps", 1, "--actor_learning_rate", 1e-4, "--save_path", tmp_path / "p")
    log = proc.stdout + proc.stderr
    stale = [float(line.split(" staleness_max=")[1].split()[0]) for line in log.splitlines()
             if line.startswith("train step")]
    assert len(stale) == 4 and stale[:2] == [0, 0] and max(stale) == 1, stale  # steps 1-2: no actor update yet
    assert len(logged(log, "tokens_age_1")) == 4 and len(logged(log, "engine_idle_s")) == 4
    assert results(tmp_path / "p")["eval_accuracy"] == stock_accuracy(tmp_path / "p", eval_file)
    before, after = weights(policy), weights(tmp_path / "p")
    assert max((after[k] - before[k]).abs().max().item() for k in before) > 1e-4
    for _ in range(30):
        if not ray_processes() - before_run:
            break
        time.sleep(1)
    assert not ray_processes() - before_run


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    recorded_run(sys.argv[1], *sys.argv[2:])
