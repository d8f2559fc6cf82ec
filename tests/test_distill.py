"""distill.py: GKD's generalized JSD and the sampled-token reverse-KL policy gradient against float64 loops over small
vocabularies, TRL's beta convention, and the script's one-line errors."""
import math
import re

import pytest
import torch

import distill

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
def test_toy_run_with_a_teacher_only(policy, tmp_path):
    """With only --teacher_pretrain, the toy world: the random toy student, prompts and answers from its SFT data,
    --max_samples 64 is one logged step (on-policy or not, by --lmbda's coin)."""
    from conftest import results, run_main

    proc = run_main("distill.py", "--teacher_pretrain", policy, "--max_samples", 64, "--save_path", tmp_path / "d")
    assert "train step 1" in proc.stdout + proc.stderr
    assert "eval_accuracy" in results(tmp_path / "d")


@pytest.mark.parametrize("flags, message", [
    ([], "needs a teacher"),
    (["--teacher_pretrain", "TEACHER", "--lmbda", 1.5], "must be in \\[0, 1\\]"),
    (["--teacher_pretrain", "TEACHER", "--dataset", "PROMPTS", "--input_key", "input", "--lmbda", 0.5],
     "name them with --output_key"),
    (["--teacher_pretrain", "TEACHER", "--loss_type", "sampled", "--lmbda", 0.5], "needs --lmbda 1"),
])
def test_one_line_errors(policy, toy_world, tmp_path, flags, message):
    from conftest import run_main

    flags = [policy if f == "TEACHER" else toy_world / "prompts_train.jsonl" if f == "PROMPTS" else f for f in flags]
    proc = run_main("distill.py", *flags, "--save_path", tmp_path / "d", check=False)
    assert proc.returncode != 0 and re.search(message, proc.stderr.strip().splitlines()[-1])
