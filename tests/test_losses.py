"""Loss functions against independent float64 references (closed forms and naive loops)."""
import math

import torch

import prm
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


def prm_reference(logits, ids, labels, placeholder, reward_ids):
    """prm_loss by a plain loop over positions in float64: loss, accuracy and d loss / d logits."""
    steps = [(b, t) for b in range(ids.size(0)) for t in range(ids.size(1)) if ids[b, t] == placeholder]
    n, total, correct = len(steps), 0.0, 0
    grad = torch.zeros_like(logits, dtype=torch.float64)
    for b, t in steps:
        z = [logits[b, t, r].item() for r in reward_ids]
        log_z = math.log(sum(math.exp(x) for x in z))
        q = [math.exp(x - log_z) for x in z]
        if labels.is_floating_point():
            p = labels[b, t].item()
            target = [p, 1 - p]
            correct += (z[0] > z[1]) == (p > 0.5)
        else:
            target = [1.0 if r == labels[b, t].item() else 0.0 for r in reward_ids]
            correct += z.index(max(z)) == target.index(1.0)
        total -= sum(w * (x - log_z) for w, x in zip(target, z))
        for k, r in enumerate(reward_ids):  # softmax minus target, on the reward-token logits only
            grad[b, t, r] = (q[k] - target[k]) / n
    return total / n, correct / n, grad


def test_prm_loss_hard_and_soft_match_float64_loop_with_gradients():
    torch.manual_seed(0)
    B, T, V, placeholder = 3, 12, 10, 9
    ids = torch.randint(0, 9, (B, T))
    ids[0, [3, 7, 11]] = placeholder
    ids[1, [5]] = placeholder
    ids[2, [0, 1, 8]] = placeholder  # row 2: adjacent steps
    for reward_ids in ([4, 2], [4, 2, 7]):  # hard labels work with any number of reward tokens
        logits = torch.randn(B, T, V, dtype=torch.float64, requires_grad=True)
        labels = torch.tensor(reward_ids)[torch.randint(0, len(reward_ids), (B, T))]
        loss, acc = prm.prm_loss(logits, ids, labels, placeholder, reward_ids)
        expected, expected_acc, expected_grad = prm_reference(logits, ids, labels, placeholder, reward_ids)
        assert abs(loss.item() - expected) < 1e-12 and abs(acc.item() - expected_acc) < 1e-6
        (g,) = torch.autograd.grad(loss, logits)
        torch.testing.assert_close(g, expected_grad, atol=1e-12, rtol=0)
    logits = torch.randn(B, T, V, dtype=torch.float64, requires_grad=True)
    soft = torch.rand(B, T, dtype=torch.float64)  # P(first reward token), e.g. Monte-Carlo estimates
    loss, acc = prm.prm_loss(logits, ids, soft, placeholder, [4, 2])
    expected, expected_acc, expected_grad = prm_reference(logits, ids, soft, placeholder, [4, 2])
    assert abs(loss.item() - expected) < 1e-12 and abs(acc.item() - expected_acc) < 1e-6
    (g,) = torch.autograd.grad(loss, logits)
    torch.testing.assert_close(g, expected_grad, atol=1e-12, rtol=0)


def test_prm_loss_soft_labels_of_zero_and_one_equal_hard_labels():
    torch.manual_seed(1)
    logits = torch.randn(2, 6, 5)
    ids = torch.tensor([[0, 4, 1, 4, 2, 4], [4, 1, 1, 1, 4, 3]])
    hard = torch.tensor([[0, 3, 0, 1, 0, 3], [1, 0, 0, 0, 3, 0]])  # reward tokens 3 (good) and 1 (bad)
    soft = (hard == 3).float()
    h_loss, h_acc = prm.prm_loss(logits, ids, hard, 4, [3, 1])
    s_loss, s_acc = prm.prm_loss(logits, ids, soft, 4, [3, 1])
    assert abs(h_loss.item() - s_loss.item()) < 1e-6 and h_acc.item() == s_acc.item()
