"""grpo.py's math against naive float64 loops, dynamic filtering's kept samples checked one by one, and the reward
clients (a reward_func file, a real HTTP server on 127.0.0.1 that fails twice before answering, one that never
answers)."""
import math
import time

import pytest
import torch

import common
import packing
import grpo
from conftest import RewardServer


# ------------------------------------------------------------------------------------ advantages
def loop_advantages(rewards, n, estimator, eps=1e-6):
    out = []
    for g in range(0, len(rewards), n):
        group = rewards[g:g + n]
        mean = sum(group) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in group) / (n - 1))
        for i, r in enumerate(group):
            if estimator == "group_norm":
                out.append((r - mean) / (std + eps))
            elif estimator in ("dr_grpo", "reinforce_baseline"):
                out.append(r - mean)
            elif estimator == "rloo":
                out.append(r - sum(group[j] for j in range(n) if j != i) / (n - 1))
            else:
                out.append(r)
    return out


@pytest.mark.parametrize("estimator", grpo.ESTIMATORS)
def test_group_advantages_match_loop(estimator):
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(24, generator=g, dtype=torch.float64)
    rewards[8:12] = 0.7  # a group of equal rewards: zero std, zero advantage (not NaN, not huge)
    rewards[12:16] = torch.tensor([0.0, 1.0, 1.0, 0.0], dtype=torch.float64)  # 0/1 rewards as in the toy task
    got = grpo.group_advantages(rewards, 4, estimator)
    want = torch.tensor(loop_advantages(rewards.tolist(), 4, estimator), dtype=torch.float64)
    assert torch.allclose(got, want, atol=1e-12), (got, want)
    if estimator != "reinforce":
        assert got[8:12].abs().max() < 1e-12


def test_group_advantages_errors():
    with pytest.raises(ValueError, match="groups of 4"):
        grpo.group_advantages(torch.zeros(6), 4, "group_norm")
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        grpo.group_advantages(torch.zeros(8), 4, "ppo")


def test_token_advantages_match_loop():
    g = torch.Generator().manual_seed(1)
    adv = torch.randn(3, generator=g, dtype=torch.float64)
    kl = torch.randn(3, 5, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    got = grpo.token_advantages(adv, kl, mask, kl_coef=0.3)
    for b in range(3):
        n = int(mask[b].sum())
        for t in range(5):
            # per-token reward: -0.3 kl_s on each response token, the sequence advantage at the last one
            want = sum(-0.3 * kl[b, s].item() + (adv[b].item() if s == n - 1 else 0.0) for s in range(t, n)) \
                if t < n else 0.0
            assert abs(got[b, t].item() - want) < 1e-12


# ------------------------------------------------------------------------------------ policy loss
def loop_policy_loss(logp, old, adv, mask, low, high, mode, max_len, ref, kl_coef, dual_clip):
    """The surrogate token by token, in float64 Python scalars."""
    per_seq, tokens = [], []
    for b in range(len(logp)):
        seq = []
        for t in range(len(logp[b])):
            if not mask[b][t]:
                continue
            a = adv[b][t] if isinstance(adv[b], list) else adv[b]
            ratio = math.exp(logp[b][t] - old[b][t])
            clipped = min(max(ratio, 1 - low), 1 + high)
            loss = -min(ratio * a, clipped * a)
            if dual_clip is not None and a < 0:
                loss = min(loss, -dual_clip * a)
            if ref is not None:
                d = logp[b][t] - ref[b][t]
                loss += kl_coef * (math.exp(-d) - 1 + d)
            seq.append(loss)
        per_seq.append(seq)
        tokens += seq
    if mode == "token-mean":
        return sum(tokens) / len(tokens)
    if mode == "seq-mean-token-mean":
        return sum(sum(s) / len(s) for s in per_seq) / len(per_seq)
    if mode == "seq-mean-token-sum":
        return sum(sum(s) for s in per_seq) / len(per_seq)
    return sum(sum(s) / max_len for s in per_seq) / len(per_seq)


@pytest.mark.parametrize("mode", grpo.LOSS_AGG_MODES)
@pytest.mark.parametrize("variant", ["plain", "clip_higher_dual_kl", "token_advantages"])
def test_policy_loss_matches_loop(mode, variant):
    g = torch.Generator().manual_seed(3)
    B, T = 4, 6
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.4  # ratios well outside [0.8, 1.2]
    ref = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 2 + [0] * 4, [1] * 5 + [0]])
    logp = torch.where(mask.bool(), logp, torch.tensor(50.0, dtype=torch.float64))  # garbage on padding
    adv = torch.tensor([1.5, -0.7, 0.3, -2.0], dtype=torch.float64)
    kwargs = dict(loss_agg_mode=mode, generate_max_len=8)
    low, high, ref_in, kl_coef, dual = 0.2, 0.2, None, 0.0, None
    if variant == "clip_higher_dual_kl":
        low, high, ref_in, kl_coef, dual = 0.2, 0.28, ref, 0.05, 3.0
    if variant == "token_advantages":
        adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    kl = {} if ref_in is None else dict(ref_logprobs=ref_in, kl_coef=kl_coef)  # KL as a loss (--use_kl_loss)
    got = grpo.policy_loss(logp, old, adv, mask, low, high, dual, **kl, **kwargs)
    want = loop_policy_loss(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), low, high, mode, 8,
                            None if ref_in is None else ref.tolist(), kl_coef, dual)
    assert abs(got.item() - want) < 1e-10, (got.item(), want)


def test_policy_loss_gradient_matches_loop():
    """d loss / d logprobs from autograd equals the loop's derivative: ratio * A inside the clip range
    (or where clipping would not bind), 0 where the clipped term is the smaller objective."""
    g = torch.Generator().manual_seed(4)
    old = -torch.rand(3, 5, generator=g, dtype=torch.float64)
    logp = (old + torch.randn(3, 5, generator=g, dtype=torch.float64) * 0.3).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64)
    mask = torch.tensor([[1] * 5, [1] * 3 + [0] * 2, [1] * 5])
    grpo.policy_loss(logp, old, adv, mask, 0.2, 0.28).backward()
    n = int(mask.sum())
    for b in range(3):
        for t in range(5):
            ratio = math.exp(logp[b, t].item() - old[b, t].item())
            a = adv[b].item()
            clipped_binds = (a > 0 and ratio > 1.28) or (a < 0 and ratio < 0.8)
            want = 0.0 if not mask[b, t] or clipped_binds else -ratio * a / n
            assert abs(logp.grad[b, t].item() - want) < 1e-12


def test_policy_loss_errors():
    x, m = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="generate_max_len"):
        grpo.policy_loss(x, x, torch.zeros(2), m, loss_agg_mode="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="unknown loss_agg_mode"):
        grpo.policy_loss(x, x, torch.zeros(2), m, loss_agg_mode="sum")


# ------------------------------------------------------------------------------------ dynamic filtering
def scored_round(lengths, scores, seed):
    """A round of groups of two: responses of the given lengths (so rounds differ in width), scored by hand, step
    tensors as --process_rewards gives them ([N, R], R the round's longest response)."""
    g = torch.Generator().manual_seed(seed)
    responses = [torch.randint(3, 50, (k,), generator=g) for k in lengths]
    records = [{"ids": torch.tensor([1, seed, i]), "label": f"{seed}.{i}"} for i in range(len(lengths))]
    scores, width = torch.tensor(scores), max(lengths)
    scored = {"rewards": scores * 2, "scores": scores, "logs": {"x": scores + 1},
              "step_rewards": torch.rand(len(lengths), width, generator=g),
              "step_ends": torch.rand(len(lengths), width, generator=g) > 0.5}
    metrics = dict(generate_s=1.5, rounds=1, groups_dropped=0, groups_topped_up=0)
    return grpo.Round(grpo.Rollout.of(records, 0, responses), scored, metrics)


def test_dynamic_filtering_keeps_the_groups_with_signal_sample_by_sample():
    """keep_groups_with_signal: the groups whose mean score is strictly inside the range, drawing rounds until there
    are `want`; every per-sample value of the result (the rollout's tensors and the scored step tensors, padded to
    the widest round, the logs) is the kept sample's own, checked one by one; the metrics are the rounds' sums."""
    first = scored_round([3, 1, 2, 2], [0.0, 0.0, 0.5, 1.0], 0)  # group means 0 (dropped), 0.75 (kept)
    second = scored_round([5, 4, 1, 1], [1.0, 1.0, 0.2, 0.4], 1)  # 1 (dropped), 0.3 (kept)
    got = grpo.keep_groups_with_signal(first, lambda: second, 2, 2, (0.0, 1.0))
    kept = [(first, 2), (first, 3), (second, 2), (second, 3)]
    assert [r["label"] for r in got.batch.records] == ["0.2", "0.3", "1.2", "1.3"]
    assert got.batch.responses.shape == got.scored["step_rewards"].shape == (4, 5)
    for i, (r, j) in enumerate(kept):
        k = int(r.batch.lengths[j])
        assert got.batch.responses[i, :k].tolist() == r.batch.responses[j, :k].tolist()
        assert not got.batch.responses[i, k:].any() and got.batch.action_mask[i].sum() == k
        for name in ("step_rewards", "step_ends"):
            width = r.scored[name].size(1)
            assert got.scored[name][i, :width].tolist() == r.scored[name][j].tolist()
            assert not got.scored[name][i, width:].any()
        for name in ("rewards", "scores"):
            assert got.scored[name][i] == r.scored[name][j]
        assert got.scored["logs"]["x"][i] == r.scored["logs"]["x"][j]
    assert got.metrics == dict(generate_s=3.0, rounds=2, groups_dropped=2, groups_topped_up=0)


def test_dynamic_filtering_tops_up_after_ten_rounds():
    """No group with signal in ten rounds: the first dropped groups fill the share, counted as topped up."""
    flat = scored_round([2, 2, 3, 3], [1.0, 1.0, 0.0, 0.0], 0)
    got = grpo.keep_groups_with_signal(flat, lambda: flat, 2, 2, (0.0, 1.0))
    assert [r["label"] for r in got.batch.records] == ["0.0", "0.1", "0.2", "0.3"]
    assert got.metrics == dict(generate_s=15.0, rounds=10, groups_dropped=20, groups_topped_up=2)


# ------------------------------------------------------------------------------------ shared prompts
def test_group_shares_its_prompt_in_the_update(policy, tokenizer):
    """--packing_samples packs a group's prompt once: the row response_logprobs runs is shorter by the
    repeats, and its log-probs and gradients equal each (prompt, response) run alone by the stock eager
    model (float64 log-softmax), an empty response included."""
    from transformers import AutoModelForCausalLM

    ids = lambda text: torch.tensor(tokenizer(text)["input_ids"])  # noqa: E731
    x, y = ids("12+34="), ids("7+8=")
    g = torch.Generator().manual_seed(0)
    responses = [torch.randint(4, len(tokenizer), (n,), generator=g) for n in (3, 1, 0, 5, 2, 4)]
    batch = list(zip([x, x, y, y, x, y], responses))  # x three times, y three (the first empty), interleaved
    packing.register_packed_sdpa()
    model = AutoModelForCausalLM.from_pretrained(policy, attn_implementation="packed_sdpa")
    rows = []
    model.get_input_embeddings().register_forward_hook(lambda m, inp, out: rows.append(inp[0].shape))
    logp, _, _ = common.response_logprobs(model, batch, tokenizer.pad_token_id, packing=True, temperature=0.7)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones(len(r), dtype=torch.bool) for _, r in batch], batch_first=True)
    assert logp.shape == mask.shape and not logp[~mask].any()  # 0 on padding
    assert rows == [(1, len(x) + len(y) + sum(len(r) for r in responses))]
    (logp * mask).sum().backward()
    reference = AutoModelForCausalLM.from_pretrained(policy, attn_implementation="eager")
    for i, (p, r) in enumerate(batch):
        assert mask[i].sum() == len(r)
        if len(r):
            logits = reference(torch.cat([p, r])[None]).logits[0, len(p) - 1:-1]
            ref = torch.log_softmax(logits.double() / 0.7, -1)[torch.arange(len(r)), r]
            torch.testing.assert_close(logp[i, :len(r)].double(), ref.detach(), atol=1e-5, rtol=0)
            ref.sum().backward()
    grads = dict(reference.named_parameters())
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n].grad, atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------------------------ reward clients
def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_reward_func_file_forms(tmp_path):
    queries, prompts, labels = ["1+1=2", "1+1=3", "2+2=4"], ["1+1=", "1+1=", "2+2="], ["2", "2", "4"]
    as_list = write(tmp_path, "as_list.py", "def reward_func(queries, prompts, labels):\n"
                    "    return [float(q[len(p):] == l) for q, p, l in zip(queries, prompts, labels)]\n")
    out = grpo.reward_client(as_list)(queries, prompts, labels)
    assert out["rewards"].tolist() == [1.0, 0.0, 1.0] and out["scores"].tolist() == [1.0, 0.0, 1.0]
    assert out["logs"] == {}
    as_dict = write(tmp_path, "as_dict.py", "import torch\ndef reward_func(queries, prompts, labels):\n"
                    "    r = torch.tensor([len(q) for q in queries], dtype=torch.float32)\n"
                    "    return {'rewards': r * 2, 'scores': r, 'extra_logs': {'len': r, 'const': 0.5}}\n")
    out = grpo.reward_client(as_dict)(queries, prompts, labels)
    assert out["rewards"].tolist() == [10.0, 10.0, 10.0] and out["scores"].tolist() == [5.0, 5.0, 5.0]
    assert out["logs"]["len"].tolist() == [5.0] * 3 and out["logs"]["const"].tolist() == [0.5] * 3


@pytest.mark.parametrize("body, message", [
    ("return [1.0]", "has 1 values for 3 queries"),
    ("return 'good'", "returned str"),
    ("return {'reward': [1, 2, 3]}", "without 'rewards'"),
    ("return [1.0, float('nan'), 0.0]", "NaN"),
    ("return {'rewards': [1, 2, 3], 'extra_logs': [1]}", "extra_logs must be a dict"),
    ("return [[1, 2], 'x', None]", "must be numbers"),
])
def test_reward_func_bad_returns(tmp_path, body, message):
    path = write(tmp_path, "bad.py", f"def reward_func(queries, prompts, labels):\n    {body}\n")
    with pytest.raises(SystemExit, match=message) as e:
        grpo.reward_client(path)(["a", "b", "c"], ["", "", ""], [None] * 3)
    assert "bad.py" in str(e.value)


def test_reward_func_file_errors(tmp_path):
    with pytest.raises(SystemExit, match="neither an http"):
        grpo.reward_client(str(tmp_path / "missing.py"))
    with pytest.raises(SystemExit, match="defines no function reward_func"):
        grpo.reward_client(write(tmp_path, "empty.py", "x = 1\n"))


def test_http_rewards_retry_then_answer_in_order():
    server = RewardServer(fail_first=2)
    try:
        queries = [f"q{'x' * i}" for i in range(7)]
        client = grpo.reward_client(server.url, batch_size=3, timeout=5, retries=3, backoff=0.05)
        out = client(queries, ["p"] * 7, list(range(7)))
        assert out["rewards"].tolist() == [float(len(q)) for q in queries]
        assert out["scores"].tolist() == out["rewards"].tolist()
        # 2 failures, then 3 batches (3 + 3 + 1), each carrying OpenRLHF's three fields
        assert len(server.requests) == 5
        assert [len(r["query"]) for r in server.requests[2:]] == [3, 3, 1]
        assert server.requests[-1] == {"query": queries[6:], "prompts": ["p"], "labels": [6]}
    finally:
        server.close()


def test_http_rewards_never_answering_fails_loudly():
    server = RewardServer(hang=True)
    try:
        t = time.time()
        with pytest.raises(SystemExit, match=r"failed 3 times in .* s, 0.15 s of it waiting between tries "
                                             r".*; last error: .*Timeout") as e:
            grpo.reward_client(server.url, timeout=0.3, retries=2, backoff=0.05)(["a"], ["p"], [None])
        assert server.url in str(e.value) and len(server.requests) == 3
        assert time.time() - t < 3
    finally:
        server.close()


def test_http_rewards_retry_for_the_wait_budget_with_capped_backoff():
    """A server down longer than the retries' waits: backoff 0.05, 0.1, 0.2, 0.4, then 0.5 (10x the first) each, the
    last cut to what is left of retry_wait 2 s: 0.05 + 0.1 + 0.2 + 0.4 + 0.5 + 0.5 + 0.25 = 2 s between 8 tries."""
    server = RewardServer(fail_first=100)
    try:
        t = time.time()
        with pytest.raises(SystemExit, match=r"failed 8 times in [\d.]+ s, 2 s of it waiting between tries "
                                             r"\(--remote_rm_retries 50, --remote_rm_retry_wait 2\)"):
            grpo.reward_client(server.url, timeout=5, retries=50, backoff=0.05, retry_wait=2)(["a"], ["p"], [None])
        assert len(server.requests) == 8 and 2 <= time.time() - t < 10
    finally:
        server.close()


def test_http_rewards_client_error_is_not_retried():
    server = RewardServer(status=422)
    try:
        with pytest.raises(SystemExit, match="refused the request .HTTP 422"):
            grpo.reward_client(server.url, timeout=5, retries=3, backoff=0.05)(["a"], ["p"], [None])
        assert len(server.requests) == 1
    finally:
        server.close()
