"""Loss functions against independent float64 references (closed forms and naive loops)."""
import math

import torch

import rm
import sft


def test_pairwise_loss_matches_closed_form_and_gradient():
    torch.manual_seed(0)
    chosen = torch.randn(7, dtype=torch.float64, requires_grad=True)
    rejected = torch.randn(7, dtype=torch.float64, requires_grad=True)
    margin = torch.rand(7, dtype=torch.float64)
    for m in (None, margin):
        mm = [0.0] * 7 if m is None else m.tolist()
        # -log σ(x) = log(1 + e^-x); d/dchosen = -σ(-x) / n
        xs = [c - r - k for c, r, k in zip(chosen.tolist(), rejected.tolist(), mm)]
        expected = sum(math.log1p(math.exp(-x)) for x in xs) / 7
        grad_chosen = [-1 / (1 + math.exp(x)) / 7 for x in xs]
        loss = rm.pairwise_loss(chosen, rejected, m)
        assert abs(loss.item() - expected) < 1e-12
        g_c, g_r = torch.autograd.grad(loss, [chosen, rejected])
        assert torch.allclose(g_c, torch.tensor(grad_chosen, dtype=torch.float64), atol=1e-12)
        assert torch.allclose(g_r, -g_c, atol=1e-12)


def test_pairwise_loss_value_at_known_points():
    # equal rewards: log 2; a margin shifts the decision point
    z = torch.zeros(3)
    assert abs(rm.pairwise_loss(z, z).item() - math.log(2)) < 1e-6
    assert abs(rm.pairwise_loss(z + 1, z, torch.ones(3)).item() - math.log(2)) < 1e-6


def test_sft_loss_is_mean_cross_entropy_over_response_tokens_only():
    torch.manual_seed(0)
    B, T, V = 3, 9, 11
    logits = torch.randn(B, T, V, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, V, (B, T))
    labels = torch.full((B, T), -100)
    spans = [(3, 9), (5, 7), (1, 4)]  # response token positions, the rest is prompt or padding
    for b, (s, e) in enumerate(spans):
        labels[b, s:e] = ids[b, s:e]
    total, n = 0.0, 0
    for b in range(B):
        for t in range(1, T):  # token t is predicted from position t-1
            if labels[b, t] != -100:
                row = logits[b, t - 1].tolist()
                log_z = math.log(sum(math.exp(x) for x in row))
                total += log_z - row[labels[b, t]]
                n += 1
    assert n == sum(e - s for s, e in spans)
    loss = sft.sft_loss(logits, labels)
    assert abs(loss.item() - total / n) < 1e-10
    # gradient: only at positions that predict a response token, (softmax - onehot) / n
    (g,) = torch.autograd.grad(loss, logits)
    for b in range(B):
        for t in range(T - 1):
            expected = torch.zeros(V, dtype=torch.float64)
            if labels[b, t + 1] != -100:
                expected = torch.softmax(logits[b, t].detach(), -1)
                expected[labels[b, t + 1]] -= 1
                expected /= n
            assert torch.allclose(g[b, t], expected, atol=1e-12)
        assert torch.all(g[b, T - 1] == 0)
