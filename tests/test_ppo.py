"""ppo.py's math against plain float64 loops and hand computation."""

import pytest
import torch

import ppo


def loop_gae(rewards, values, gamma, lam):
    """One sequence's GAE, the textbook recursion in Python floats; V after the last token is 0."""
    T, adv, last = len(rewards), [0.0] * len(rewards), 0.0
    for t in reversed(range(T)):
        next_v = values[t + 1] if t + 1 < T else 0.0
        last = rewards[t] + gamma * next_v - values[t] + gamma * lam * last
        adv[t] = last
    return adv, [a + v for a, v in zip(adv, values)]


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.99, 1.0), (0.9, 0.0), (1.0, 1.0)])
@pytest.mark.parametrize("side", ["right", "left"])
def test_gae_matches_loop(gamma, lam, side):
    g = torch.Generator().manual_seed(0)
    lengths = [5, 3, 1, 4]
    seqs = [(torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64))
            for n in lengths]
    T = 6
    rewards, values = torch.full((4, T), 9.0, dtype=torch.float64), torch.full((4, T), -7.0, dtype=torch.float64)
    mask = torch.zeros(4, T, dtype=torch.bool)
    for b, (r, v) in enumerate(seqs):  # garbage (9, -7) on padding must not leak in
        sl = slice(0, len(r)) if side == "right" else slice(T - len(r), T)
        rewards[b, sl], values[b, sl], mask[b, sl] = r, v, True
    adv, ret = ppo.compute_gae(rewards, values, mask, gamma, lam)
    for b, (r, v) in enumerate(seqs):
        want_adv, want_ret = loop_gae(r.tolist(), v.tolist(), gamma, lam)
        assert torch.allclose(adv[b][mask[b]], torch.tensor(want_adv, dtype=torch.float64), atol=1e-12)
        assert torch.allclose(ret[b][mask[b]], torch.tensor(want_ret, dtype=torch.float64), atol=1e-12)
        assert (adv[b][~mask[b]] == 0).all() and (ret[b][~mask[b]] == 0).all()


def test_gae_packed_row_equals_separate_rows():
    """Responses packed into one row, separated by masked (prompt) tokens, get the GAE of each alone."""
    g = torch.Generator().manual_seed(1)
    parts = [torch.randn(2, n, generator=g, dtype=torch.float64) for n in (4, 2, 3)]
    prompt = torch.tensor([[5.0, 5.0], [3.0, 3.0]], dtype=torch.float64)[:, :2]  # two prompt tokens before each
    row = torch.cat([torch.cat([prompt, p], 1) for p in parts], 1)
    mask = torch.cat([torch.cat([torch.zeros(2), torch.ones(p.size(1))]) for p in parts]).bool()
    adv, ret = ppo.compute_gae(row[0:1], row[1:2], mask[None], 0.99, 0.9)
    separate = [ppo.compute_gae(p[0:1], p[1:2], torch.ones(1, p.size(1)), 0.99, 0.9) for p in parts]
    assert torch.allclose(adv[0][mask], torch.cat([a[0] for a, _ in separate]), atol=1e-12)
    assert torch.allclose(ret[0][mask], torch.cat([r[0] for _, r in separate]), atol=1e-12)


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 0.8)])
def test_gae_steps_over_an_agents_feedback(gamma, lam):
    """Multi-turn episodes: action tokens with the environment's feedback between them (and after the last), in
    padded rows beside a packed-style row. GAE over the action tokens alone, as if the feedback were not there
    (the naive loop on the actions only), scattered back; feedback and padding get 0. Without `skip` a feedback
    gap would end the episode (the packed-row rule), which the last assertion shows differs."""
    g = torch.Generator().manual_seed(2)
    layouts = ["aaffaaaf", "aafffa..", "aaaaaaaa", "a.......", "aafa.aaf"]  # a action, f feedback, . padding
    B, T = len(layouts), len(layouts[0])
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.tensor([[c == "a" for c in row] for row in layouts])
    skip = torch.tensor([[c == "f" for c in row] for row in layouts])
    adv, ret = ppo.compute_gae(rewards, values, mask, gamma, lam, skip=skip)
    # each row's episodes, by their action positions (the last row packs two, "aafa" and "aaf", apart)
    episodes = [[[0, 1, 4, 5, 6]], [[0, 1, 5]], [list(range(8))], [[0]], [[0, 1, 3], [5, 6]]]
    for b in range(B):
        for actions in episodes[b]:
            want_adv, want_ret = loop_gae(rewards[b, actions].tolist(), values[b, actions].tolist(), gamma, lam)
            assert torch.allclose(adv[b, actions], torch.tensor(want_adv, dtype=torch.float64), atol=1e-12)
            assert torch.allclose(ret[b, actions], torch.tensor(want_ret, dtype=torch.float64), atol=1e-12)
        assert (adv[b][~mask[b]] == 0).all() and (ret[b][~mask[b]] == 0).all()
    plain, _ = ppo.compute_gae(rewards, values, mask, gamma, lam)
    assert not torch.allclose(plain[0, :2], adv[0, :2])  # ended at the gap, the first turn loses what follows
    assert torch.equal(plain[2], adv[2])  # no feedback: the same numbers, bit for bit


@pytest.mark.parametrize("side", ["right", "left"])
def test_kl_penalized_rewards_score_at_last_response_token(side):
    kl = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 0.7, 0.8]], dtype=torch.float64)
    if side == "right":
        mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
        last = [2, 3]
    else:
        mask = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1]])
        last = [3, 3]
    scores = torch.tensor([2.0, -1.0], dtype=torch.float64)
    got = ppo.kl_penalized_rewards(scores, kl, mask, kl_coef=0.1)
    for b in range(2):
        for t in range(4):
            want = (-0.1 * kl[b, t].item() if mask[b, t] else 0.0) + (scores[b].item() if t == last[b] else 0.0)
            assert abs(got[b, t].item() - want) < 1e-12


def test_policy_loss_by_hand():
    # one sequence, three tokens: ratio 1.5 with A=+1 (clipped to 1.2), ratio 0.5 with A=-2 (clipped to 0.8:
    # the clipped term -0.8*-2 = 1.6 is the larger loss), ratio 1.1 with A=+1 (inside the range); one pad
    old = torch.zeros(1, 4, dtype=torch.float64)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 7.0]], dtype=torch.float64)).requires_grad_()
    adv = torch.tensor([[1.0, -2.0, 1.0, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]])
    loss = ppo.policy_loss(logp, old, adv, mask, eps_clip=0.2)
    assert loss.item() == pytest.approx((-1.2 + 1.6 - 1.1) / 3, abs=1e-12)
    loss.backward()
    # gradient d/dlogp of -ratio*A = -ratio*A where the unclipped term is active, else 0
    assert logp.grad[0].tolist() == pytest.approx([0.0, 0.0, -1.1 / 3, 0.0], abs=1e-12)
    # dual clip 3: token 2 with A=-2 and ratio 5 gives -min(5*-2, 1.2*-2) = 10, capped at 3*2 = 6
    logp2 = torch.log(torch.tensor([[1.0, 5.0]], dtype=torch.float64))
    adv2 = torch.tensor([[1.0, -2.0]], dtype=torch.float64)
    loss = ppo.policy_loss(logp2, torch.zeros(1, 2, dtype=torch.float64), adv2, torch.ones(1, 2), 0.2, dual_clip=3.0)
    assert loss.item() == pytest.approx((-1.0 + 6.0) / 2, abs=1e-12)
    loss = ppo.policy_loss(logp2, torch.zeros(1, 2, dtype=torch.float64), adv2, torch.ones(1, 2), 0.2)
    assert loss.item() == pytest.approx((-1.0 + 10.0) / 2, abs=1e-12)


def test_value_loss_by_hand():
    old = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    values = torch.tensor([[1.5, 1.1, 0.0, 3.0]], dtype=torch.float64, requires_grad=True)
    returns = torch.tensor([[2.0, 0.0, 2.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]])
    # token 1: v=1.5 (clipped 1.2), R=2: max(0.25, 0.64) = 0.64 (clipped term, no gradient)
    # token 2: v=1.1 (inside), R=0: max(1.21, 1.21) = 1.21
    # token 3: v=0.0 (clipped 0.8), R=2: max(4, 1.44) = 4 (unclipped term)
    loss = ppo.value_loss(values, old, returns, mask, value_clip=0.2)
    assert loss.item() == pytest.approx(0.5 * (0.64 + 1.21 + 4.0) / 3, abs=1e-12)
    loss.backward()
    assert values.grad[0].tolist() == pytest.approx([0.0, 0.5 * 2 * 1.1 / 3, 0.5 * 2 * -2.0 / 3, 0.0], abs=1e-12)
    unclipped = ppo.value_loss(values, old, returns, mask, value_clip=None)
    assert unclipped.item() == pytest.approx(0.5 * (0.25 + 1.21 + 4.0) / 3, abs=1e-12)


def test_adaptive_kl_coef():
    # KL twice the target: error clipped to +0.2, coefficient grows by 0.2 * 1000 / 10000
    assert ppo.adaptive_kl_coef(0.1, kl=2.0, target=1.0, horizon=10000, n_samples=1000) == pytest.approx(0.102)
    assert ppo.adaptive_kl_coef(0.1, kl=0.9, target=1.0, horizon=10000, n_samples=1000) == pytest.approx(0.099)


def test_rollout_of_pads_and_reads_eos():
    """Rollout.of from an engine's plain tensors: right-padded with 0, stopped where a response ends with EOS, the
    action mask given (an agent's) or every response token."""
    records = [{"ids": torch.tensor([5, 6]), "label": "a"}, {"ids": torch.tensor([7]), "label": None}]
    batch = ppo.Rollout.of(records, 2, [torch.tensor([9, 2]), torch.tensor([4, 4, 4])], version=3)
    assert batch.responses.tolist() == [[9, 2, 0], [4, 4, 4]] and batch.lengths.tolist() == [2, 3]
    assert batch.stopped.tolist() == [True, False] and batch.version == 3 and batch.logprobs is None
    assert batch.action_mask.tolist() == [[True, True, False], [True, True, True]]
    assert [(p.tolist(), r.tolist()) for p, r in batch.pairs([1, 0])] == [([7], [4, 4, 4]), ([5, 6], [9, 2])]
    assert batch.labels == ["a", None]
    episodes = ppo.Rollout.of(records, 2, [torch.tensor([9, 8, 2]), torch.tensor([4])], stopped=[False, True],
                              action_mask=[torch.tensor([1, 0, 1]), torch.tensor([1])],
                              agent_rewards={"rewards": torch.tensor([1.0, 0.0])})
    assert episodes.action_mask.tolist() == [[True, False, True], [True, False, False]]
    assert episodes.response_mask.tolist() == [[True, True, True], [True, False, False]]
    assert episodes.stopped.tolist() == [False, True] and episodes.agent_rewards["rewards"].tolist() == [1.0, 0.0]


def test_score_penalizes_unfinished_then_clips():
    """score: --non_stop_penalty replaces the reward of a completion cut at --generate_max_len, then
    --reward_clip_range clips; the reward source's scores and logs pass through by name."""
    from types import SimpleNamespace

    batch = SimpleNamespace(stopped=torch.tensor([True, False, True, False]))
    source = {"rewards": torch.tensor([20.0, 3.0, -0.5, -30.0]), "scores": torch.tensor([1.0, 2.0, 3.0, 4.0]),
              "logs": {"accuracy": torch.tensor([1.0, 0.0, 0.0, 0.0])}}
    args = SimpleNamespace(non_stop_penalty=-1.0, reward_clip_range=(-10.0, 10.0))
    out = ppo.score(batch, lambda b: source, args)
    assert out["rewards"].tolist() == [10.0, -1.0, -0.5, -1.0]
    assert out["scores"] is source["scores"] and out["logs"] is source["logs"]
    args.non_stop_penalty = None  # as scored, then clipped
    assert ppo.score(batch, lambda b: source, args)["rewards"].tolist() == [10.0, 3.0, -0.5, -10.0]


def test_check_rewards_gives_a_named_result():
    """What a reward function returns, read by name: a list is the rewards and the scores; a dict's scalar extra log is
    one value per query; step_rewards stay as sent (process_rewards.py checks them)."""
    out = ppo.check_rewards([1, 2.5], 2, "test")
    assert set(out) == {"rewards", "scores", "logs"} and out["logs"] == {}
    assert out["rewards"].tolist() == [1.0, 2.5] and out["scores"].tolist() == [1.0, 2.5]
    out = ppo.check_rewards({"scores": [0.5, 1], "extra_logs": {"n": 3}, "step_rewards": [[0.1], "x"]}, 2, "test")
    assert out["rewards"].tolist() == [0.5, 1.0] and out["scores"].tolist() == [0.5, 1.0]
    assert out["logs"]["n"].tolist() == [3.0, 3.0] and out["step_rewards"] == [[0.1], "x"]


def test_remote_rewards_join_requests_in_order():
    """A /get_reward server asked two queries a request: the named result joins the replies in query order."""
    from conftest import RewardServer

    server = RewardServer()
    try:
        out = ppo.reward_client(server.url, batch_size=2, retries=0)(["a", "bbb", "cc"], ["", "", ""], [None] * 3)
    finally:
        server.close()
    assert [len(r["query"]) for r in server.requests] == [2, 1]
    assert out["rewards"].tolist() == [1.0, 3.0, 2.0] and out["scores"].tolist() == [1.0, 3.0, 2.0]
    assert out["logs"] == {} and "step_rewards" not in out
