"""The 2026 policy-loss family of grpo.token_policy_loss and grpo.policy_loss (GSPO's sequence-level ratio, CISPO, SAPO, the two-sided
delta clip, the ratio-weighted KL) and the rollout correction of grpo.py and ppo.py (engines.rollout_correction_weights: token/sequence, truncate/
mask), each against a token-by-token float64 loop, with padding holding garbage, and their gradients against
closed forms or central finite differences."""
import math

import pytest
import torch

import grpo
import ppo
from engines import ROLLOUT_CORRECTIONS, rollout_correction_weights

B, T = 4, 6
MASK = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 2 + [0] * 4, [1] * 5 + [0]])


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def loop_losses(logp, old, adv, mask, level="token", kind="ppo", low=0.2, high=0.2, dual_clip=None, delta=None,
                tau_pos=1.0, tau_neg=1.05, ref=None, kl_coef=0.0, kl_weighted=False, rollout=None, correction=None,
                bounds=(0.0, 2.0)):
    """Per-token losses {(b, t): loss} over the response tokens, in Python floats, from the definitions."""
    out = {}
    for b in range(len(logp)):
        tokens = [t for t in range(len(logp[b])) if mask[b][t]]
        seq_log_ratio = sum(logp[b][t] - old[b][t] for t in tokens) / len(tokens)
        seq_log_w = sum(old[b][t] - rollout[b][t] for t in tokens) / len(tokens) if rollout else None
        for t in tokens:
            a = adv[b][t] if isinstance(adv[b], list) else adv[b]
            r = math.exp(seq_log_ratio if level == "sequence" else logp[b][t] - old[b][t])
            if kind == "ppo":
                unclipped = r if delta is None else min(r, delta)
                loss = -min(unclipped * a, min(max(r, 1 - low), 1 + high) * a)
                if dual_clip is not None and a < 0:
                    loss = min(loss, -dual_clip * a)
            elif kind == "cispo":
                loss = -min(r, 1 + high) * a * logp[b][t]
            else:
                tau = tau_pos if a > 0 else tau_neg
                loss = -sigmoid(tau * (r - 1)) * 4 / tau * a
            if correction:
                w = math.exp(old[b][t] - rollout[b][t])
                stat = w if correction.startswith("token") else math.exp(seq_log_w)
                if correction.endswith("truncate"):
                    loss *= min(max(stat, bounds[0]), bounds[1])
                else:
                    loss *= w if bounds[0] <= stat <= bounds[1] else 0.0
            if ref is not None:
                d = logp[b][t] - ref[b][t]
                k3 = math.exp(-d) - 1 + d
                loss += kl_coef * (k3 * r if kl_weighted else k3)
            out[b, t] = loss
    return out


def inputs(seed, token_advantages=False):
    """Log-probs whose ratios land on both sides of the clip range; garbage on padding (50 in the log-probs
    being trained, NaN in the engine's), which no result may see."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.4
    ref = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    rollout = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.6  # ratios from ~0.2 to ~5
    logp = torch.where(MASK.bool(), logp, torch.tensor(50.0, dtype=torch.float64))
    rollout = torch.where(MASK.bool(), rollout, torch.tensor(float("nan"), dtype=torch.float64))
    adv = torch.randn(B, T, generator=g, dtype=torch.float64) if token_advantages \
        else torch.tensor([1.5, -0.7, 0.3, -2.0], dtype=torch.float64)
    return logp, old, adv, ref, rollout


def assert_matches(got, want):
    for b in range(B):
        for t in range(T):
            if MASK[b, t]:
                assert abs(got[b, t].item() - want[b, t]) < 1e-12, (b, t, got[b, t].item(), want[b, t])
    assert torch.isfinite(grpo.aggregate_loss(got, MASK))  # the padding's garbage stays out


# ------------------------------------------------------------------------------------ forward vs loop
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("kind", grpo.POLICY_LOSSES)
@pytest.mark.parametrize("variant", ["plain", "kl_ratio_weighted", "token_advantages"])
def test_policy_loss_family_matches_loop(level, kind, variant):
    logp, old, adv, ref, _ = inputs(10, token_advantages=variant == "token_advantages")
    kl = dict(ref_logprobs=ref, kl_coef=0.05, kl_ratio_weighted=True) if variant == "kl_ratio_weighted" else {}
    got = grpo.token_policy_loss(logp, old, adv, MASK, 0.2, 0.28, importance_sampling_level=level,
                           policy_loss_type=kind, tau_pos=0.9, tau_neg=1.3, **kl)
    want = loop_losses(logp.tolist(), old.tolist(), adv.tolist(), MASK.tolist(), level, kind, 0.2, 0.28,
                       tau_pos=0.9, tau_neg=1.3, ref=ref.tolist() if kl else None, kl_coef=0.05, kl_weighted=True)
    assert_matches(got, want)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_delta_two_sided_clip_matches_loop(level):
    logp, old, _, _, _ = inputs(11)
    adv = torch.tensor([-1.5, -0.7, 0.3, -2.0], dtype=torch.float64)
    shift = torch.tensor([0.8, -0.3, 0.1, 0.6], dtype=torch.float64)[:, None] + torch.linspace(-0.5, 0.5, T)
    logp = torch.where(MASK.bool(), old + shift, logp)  # ratios from 0.45 to 3.7, sequences' from 0.6 to 2.2
    got = grpo.token_policy_loss(logp, old, adv, MASK, 0.2, 0.28, importance_sampling_level=level, delta=1.5)
    want = loop_losses(logp.tolist(), old.tolist(), adv.tolist(), MASK.tolist(), level, "ppo", 0.2, 0.28, delta=1.5)
    assert_matches(got, want)
    plain = grpo.token_policy_loss(logp, old, adv, MASK, 0.2, 0.28, importance_sampling_level=level)
    assert (got - plain)[MASK.bool()].abs().max() > 0.1  # the cap binds somewhere (A < 0, ratio > 1.5)


@pytest.mark.parametrize("mode", ROLLOUT_CORRECTIONS)
@pytest.mark.parametrize("kind", grpo.POLICY_LOSSES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_rollout_correction_matches_loop(mode, kind, level):
    logp, old, adv, ref, rollout = inputs(12)
    bounds = (0.0, 2.0) if mode.endswith("truncate") else (0.5, 1.6)
    got = grpo.token_policy_loss(logp, old, adv, MASK, 0.2, 0.28, importance_sampling_level=level,
                                 policy_loss_type=kind, ref_logprobs=ref, kl_coef=0.05, rollout_logprobs=rollout,
                                 rollout_correction=mode, rollout_correction_bounds=bounds)
    want = loop_losses(logp.tolist(), old.tolist(), adv.tolist(), MASK.tolist(), level, kind, 0.2, 0.28,
                       ref=ref.tolist(), kl_coef=0.05, rollout=rollout.tolist(), correction=mode, bounds=bounds)
    assert_matches(got, want)
    if (kind, level) != ("ppo", "token"):
        return
    # ppo.py's copy: the same weights on its surrogate (one clip range), mean over response tokens
    got = ppo.policy_loss(logp, old, adv[:, None].expand(B, T), MASK, 0.2, rollout_logprobs=rollout,
                          rollout_correction=mode, rollout_correction_bounds=bounds)
    want = loop_losses(logp.tolist(), old.tolist(), adv.tolist(), MASK.tolist(), low=0.2, high=0.2,
                       rollout=rollout.tolist(), correction=mode, bounds=bounds)
    assert abs(got.item() - sum(want.values()) / len(want)) < 1e-12


def test_rollout_correction_by_hand():
    """Truncate against mask, token against sequence, on weights written out: pi_old / pi_engine of
    0.3, 1, 2.5, 6 in one sequence (geometric mean 1.46), 1.2, 0.9 (and padding) in another (mean 1.04)."""
    w = torch.tensor([[0.3, 1.0, 2.5, 6.0], [1.2, 0.9, 7.0, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    old, rollout = w.log(), torch.zeros_like(w)
    cases = {("token-truncate", (0.0, 2.0)): ([[0.3, 1.0, 2.0, 2.0], [1.2, 0.9, 0, 0]], [[0, 0, 1, 1], [0, 0, 0, 0]]),
             ("token-mask", (0.5, 5.0)): ([[0.0, 1.0, 2.5, 0.0], [1.2, 0.9, 0, 0]], [[1, 0, 0, 1], [0, 0, 0, 0]]),
             ("seq-truncate", (0.0, 1.2)): ([[1.2] * 4, [1.2 ** 0.5 * 0.9 ** 0.5] * 2 + [0, 0]],
                                            [[1, 1, 1, 1], [0, 0, 0, 0]]),
             ("seq-mask", (0.5, 1.2)): ([[0.0] * 4, [1.2, 0.9, 0, 0]], [[1, 1, 1, 1], [0, 0, 0, 0]])}
    for (mode, bounds), (weights, changed) in cases.items():
        got, got_changed = rollout_correction_weights(old, rollout, mask, mode, bounds)
        assert torch.allclose(got, torch.tensor(weights, dtype=torch.float64), atol=1e-12), (mode, got)
        assert got_changed.tolist() == [[bool(x) for x in row] for row in changed], (mode, got_changed)


def test_seq_mean_token_sum_aggregation():
    loss = torch.tensor([[1.0, 2.0, 3.0, 99.0], [4.0, float("inf"), 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    assert grpo.aggregate_loss(loss, mask, "seq-mean-token-sum").item() == (6.0 + 4.0) / 2


# ------------------------------------------------------------------------------------ gradients
def grad_of(logp, *args, agg="token-mean", **kwargs):
    logp = logp.clone().requires_grad_()
    grpo.policy_loss(logp, *args[:2], MASK, *args[2:], loss_agg_mode=agg, **kwargs).backward()
    return logp.grad


def test_gspo_gradient_flows_through_the_sequence_mean():
    """One ratio s_b per sequence, the same loss on each of its n_b tokens: with seq-mean-token-mean each
    token's gradient is -A_b * s_b / (n_b * B) where the unclipped term is the smaller objective, else 0;
    equal over a sequence's tokens, whatever each token's own ratio."""
    logp, old, _, _, _ = inputs(13)
    adv = torch.tensor([1.5, -0.7, 0.3, -2.0], dtype=torch.float64)
    # each sequence's mean log-ratio 0.3, -0.02, 0.01, -0.4, its tokens' own spread around it by up to 0.5
    base = torch.tensor([0.3, -0.02, 0.01, -0.4], dtype=torch.float64)[:, None]
    spread = torch.linspace(-0.5, 0.5, T, dtype=torch.float64).expand(B, T)
    spread = spread - (spread * MASK).sum(-1, keepdim=True) / MASK.sum(-1, keepdim=True)  # mean 0 over each row
    logp = torch.where(MASK.bool(), old + base + spread, logp)
    grad = grad_of(logp, old, adv, 0.2, 0.28, importance_sampling_level="sequence", agg="seq-mean-token-mean")
    for b in range(B):
        n = int(MASK[b].sum())
        s = math.exp(sum(logp[b, t].item() - old[b, t].item() for t in range(n)) / n)
        a = adv[b].item()
        binds = (a > 0 and s > 1.28) or (a < 0 and s < 0.8)
        for t in range(T):
            want = 0.0 if not MASK[b, t] or binds else -a * s / (n * B)
            assert abs(grad[b, t].item() - want) < 1e-12, (b, t)
    # both clip sides bind on a whole sequence (0: ratio 1.35, A > 0; 3: ratio 0.67, A < 0); 1 and 2 move
    assert grad[0].abs().max() == 0 and grad[3].abs().max() == 0 and grad[1:3][MASK[1:3].bool()].abs().min() > 0
    token = grad_of(logp, old, adv, 0.2, 0.28, agg="seq-mean-token-mean")  # each token's own ratio: not this
    assert (token - grad).abs().max() > 1e-3


def test_cispo_gradient_is_the_stopped_clipped_weight():
    """CISPO: d loss / d logprobs_t = -min(r_t, 1 + eps_high) * A / N, for clipped tokens too, where the
    clipped surrogate's gradient is 0, and without the ratio's own derivative (the weight is stopped)."""
    logp, old, adv, _, _ = inputs(14)
    grad = grad_of(logp, old, adv, 0.2, 0.28, policy_loss_type="cispo")
    n = int(MASK.sum())
    for b in range(B):
        for t in range(T):
            r = math.exp(logp[b, t].item() - old[b, t].item())
            want = -min(r, 1.28) * adv[b].item() / n if MASK[b, t] else 0.0
            assert abs(grad[b, t].item() - want) < 1e-12
    surrogate = grad_of(logp, old, adv, 0.2, 0.28)
    assert (surrogate == 0).logical_and(grad != 0).any()  # clipped tokens: no gradient there, CISPO keeps one


def test_sapo_gradient_closed_form():
    """SAPO: d/dlogp of -sigmoid(tau (r - 1)) * 4 / tau * A = -4 sigma (1 - sigma) r A, which is -A at r = 1."""
    logp, old, adv, _, _ = inputs(15)
    grad = grad_of(logp, old, adv, policy_loss_type="sapo", tau_pos=1.0, tau_neg=1.05)
    n = int(MASK.sum())
    for b in range(B):
        for t in range(T):
            if MASK[b, t]:
                r, a = math.exp(logp[b, t].item() - old[b, t].item()), adv[b].item()
                s = sigmoid((1.0 if a > 0 else 1.05) * (r - 1))
                assert abs(grad[b, t].item() - (-4 * s * (1 - s) * r * a / n)) < 1e-12
    at_one = grad_of(old.clone(), old, adv, policy_loss_type="sapo")  # on-policy: the plain policy gradient
    assert torch.allclose(at_one, torch.where(MASK.bool(), -adv[:, None] / n, 0.0), atol=1e-12)


@pytest.mark.parametrize("kwargs", [
    dict(importance_sampling_level="sequence"),
    dict(importance_sampling_level="sequence", policy_loss_type="sapo"),
    dict(delta=1.5),
    dict(kl_ratio_weighted=True, kl_coef=0.1),
    dict(importance_sampling_level="sequence", kl_ratio_weighted=True, kl_coef=0.1),
    dict(rollout_correction="seq-truncate", rollout_correction_bounds=(0.0, 1.1)),
])
def test_gradients_match_finite_differences(kwargs):
    """Everything without a stop-gradient inside: autograd against central differences in float64."""
    logp, old, adv, ref, rollout = inputs(16, token_advantages=True)
    rollout = torch.where(MASK.bool(), rollout, 0.0)
    kwargs = dict(kwargs, ref_logprobs=ref if "kl_coef" in kwargs else None, rollout_logprobs=rollout)
    grad = grad_of(logp, old, adv, 0.2, 0.28, **kwargs)

    def f(x):
        return grpo.policy_loss(x, old, adv, MASK, 0.2, 0.28, **kwargs).item()

    h = 1e-6
    for b in range(B):
        for t in range(T):
            if not MASK[b, t]:
                continue
            up, down = logp.clone(), logp.clone()
            up[b, t] += h
            down[b, t] -= h
            assert abs(grad[b, t].item() - (f(up) - f(down)) / (2 * h)) < 1e-7, (b, t)


def test_kl_ratio_weighted_gradient_carries_the_ratio():
    """k3 * r: d/dlogp = k3'(d) r + k3(d) r with d = logp - ref, r = exp(logp - old); the KL alone (no A)."""
    logp, old, _, ref, _ = inputs(17)
    grad = grad_of(logp, old, torch.zeros(B, dtype=torch.float64), ref_logprobs=ref, kl_coef=1.0,
                   kl_ratio_weighted=True)
    n = int(MASK.sum())
    for b in range(B):
        for t in range(T):
            if MASK[b, t]:
                d, r = logp[b, t].item() - ref[b, t].item(), math.exp(logp[b, t].item() - old[b, t].item())
                want = ((1 - math.exp(-d)) * r + (math.exp(-d) - 1 + d) * r) / n
                assert abs(grad[b, t].item() - want) < 1e-12


def test_rollout_correction_weights_are_constants_in_the_gradient():
    """token-truncate: each token's surrogate gradient times its clamped weight, nothing through the weight."""
    logp, old, adv, _, rollout = inputs(18)
    grad = grad_of(logp, old, adv, 0.2, 0.28, rollout_logprobs=rollout, rollout_correction="token-truncate")
    plain = grad_of(logp, old, adv, 0.2, 0.28)
    w = torch.where(MASK.bool(), (old - rollout).exp().clamp(0, 2), 0.0)
    assert torch.allclose(grad, plain * w, atol=1e-14)
    assert (w[MASK.bool()] == 2).any() and (w[MASK.bool()] < 1).any()


# ------------------------------------------------------------------------------------ errors
def test_policy_loss_family_errors():
    x, adv = torch.zeros(2, 3), torch.zeros(2)
    with pytest.raises(ValueError, match="unknown policy_loss_type"):
        grpo.token_policy_loss(x, x, adv, policy_loss_type="grpo", dual_clip=3.0)
    with pytest.raises(ValueError, match="unknown importance_sampling_level"):
        grpo.token_policy_loss(x, x, adv, importance_sampling_level="seq")
    with pytest.raises(ValueError, match="need action_mask"):
        grpo.token_policy_loss(x, x, adv, importance_sampling_level="sequence")
    with pytest.raises(ValueError, match="dual_clip and delta"):
        grpo.token_policy_loss(x, x, adv, policy_loss_type="cispo", dual_clip=3.0)
    with pytest.raises(ValueError, match="needs rollout_logprobs"):
        grpo.token_policy_loss(x, x, adv, torch.ones(2, 3), rollout_correction="token-mask")
    with pytest.raises(ValueError, match="unknown rollout_correction"):
        rollout_correction_weights(x, x, torch.ones(2, 3), "tis", (0, 2))
