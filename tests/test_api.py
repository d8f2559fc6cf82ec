"""The public math's signatures are an API: README.md lists each function with its signature, and this file checks
that every listed function has exactly that signature (names, order, kinds, defaults) and calls each one exactly
as written there, positionally where README gives no default, against numbers worked out here by hand or by a plain
loop."""
import inspect
import math
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

import common
import distill
import dpo
import engines
import grpo
import ppo
import prm
import rm
import sft
from conftest import ROOT

MODULES = {m.__name__: m for m in (common, distill, dpo, engines, grpo, ppo, prm, rm, sft)}


def documented():
    """{"module.name": "its parameters"} from README's API block (continuation lines joined, comments dropped)."""
    block = (ROOT / "README.md").read_text().split("are an API (`tests/test_api.py`")[1]
    block = block.split("```python\n", 1)[1].split("```", 1)[0]
    entries = []
    for line in block.splitlines():
        code = line.split("  #")[0].strip()
        if line.startswith(" "):
            entries[-1] += " " + code
        else:
            entries.append(code)
    return dict(re.fullmatch(r"([\w.]+)\((.*)\)", e).groups() for e in entries)


def test_every_listed_function_has_its_documented_signature():
    listed = documented()
    assert len(listed) >= 20
    for name, params in listed.items():
        module, func = name.split(".")
        namespace = {}
        exec(f"def f({params}): pass", namespace)  # the documented signature, as Python reads it
        assert str(inspect.signature(getattr(MODULES[module], func))) == str(inspect.signature(namespace["f"])), name
    assert set(listed) == set(CALLS), "a listed function without a call below, or the reverse"


F64 = dict(dtype=torch.float64)


def close(got, want, atol=1e-9):
    torch.testing.assert_close(got, torch.tensor(want, dtype=got.dtype), atol=atol, rtol=0)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -9.0]], **F64)
ADV = torch.tensor([1.0, -2.0], **F64)


def call_sft_loss():
    logits = torch.tensor([[[2.0, 0.0], [0.0, 1.0], [5.0, 5.0]]], **F64)
    labels = torch.tensor([[-100, 1, 0]])  # position 0 predicts 1, position 1 predicts 0
    want = (-math.log(math.exp(0) / (math.exp(2) + 1)) - math.log(1 / (1 + math.e))) / 2
    assert sft.sft_loss(logits, labels).item() == pytest.approx(want)


def call_pairwise_loss():
    got = rm.pairwise_loss(torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0]))
    assert got.item() == pytest.approx((math.log1p(math.exp(-1)) + math.log1p(math.exp(1))) / 2)


def call_prm_loss():
    logits = torch.zeros(1, 3, 5, **F64)
    logits[0, 1, 3] = math.log(3)  # at the placeholder: reward token 3 three times as likely as token 4
    loss, accuracy = prm.prm_loss(logits, torch.tensor([[0, 2, 1]]), torch.tensor([[0, 3, 0]]), 2, [3, 4])
    assert loss.item() == pytest.approx(-math.log(0.75)) and accuracy.item() == 1.0


def call_score_steps(toy_world, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(toy_world / "model")
    placeholder, good, bad = tokenizer.convert_tokens_to_ids(["=", "1", "2"])
    model.config.placeholder_token_id, model.config.reward_token_ids = placeholder, [good, bad]
    text = "12+34=46+5+5="
    got = prm.score_steps(model, tokenizer, text)
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits[0].double()
    want = [torch.softmax(logits[i, [good, bad]], -1)[0].item() for i in range(ids.size(1)) if ids[0, i] == placeholder]
    assert len(got) == 2 and got == pytest.approx(want, abs=1e-6)


def call_step_probabilities(toy_world, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(toy_world / "model")
    placeholder, good, bad = tokenizer.convert_tokens_to_ids(["=", "1", "2"])
    model.config.placeholder_token_id, model.config.reward_token_ids = placeholder, [good, bad]
    seqs = [torch.tensor(tokenizer(t)["input_ids"]) for t in ("12+34=46+5=", "7=")]
    got = prm.step_probabilities(model, seqs, tokenizer.pad_token_id)
    want = []
    for ids in seqs:  # one at a time, no padding, float64 softmax
        with torch.no_grad():
            logits = model(ids[None]).logits[0].double()
        want.append([torch.softmax(logits[i, [good, bad]], -1)[0].item()
                     for i in range(len(ids)) if ids[i] == placeholder])
    assert [len(g) for g in got] == [2, 1]
    assert [x for g in got for x in g] == pytest.approx([x for w in want for x in w], abs=1e-6)


def call_process_advantages():
    # one group of two: steps scoring 1, 0 (sample 1, ending at tokens 0 and 2) and 1 (sample 2, at token 1);
    # mean 2/3, unbiased std 1/sqrt(3): normalized 1/sqrt(3), -2/sqrt(3), 1/sqrt(3)
    rewards = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], **F64)
    ends = torch.tensor([[True, False, True], [False, True, False]])
    got = grpo.process_advantages(rewards, ends, 2, 0.0)
    r3 = 1 / math.sqrt(3)
    close(got, [[r3 - 2 * r3, -2 * r3, -2 * r3], [r3, r3, 0.0]])


def call_group_advantages():
    got = grpo.group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2, "rloo")
    assert got.tolist() == [1.0, -1.0, 0.0, 0.0]


def call_token_advantages():
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.5, 9.0]], **F64)
    got = grpo.token_advantages(ADV, kl, MASK, 1.0)
    close(got, [[1.0 - 0.6, 1.0 - 0.5, 1.0 - 0.3], [-3.0, -2.5, 0.0]])


def call_policy_loss():
    logp = OLD + torch.tensor([[0.0, math.log(2), 0.0], [math.log(0.5), 0.0, 0.0]], **F64)
    # ratio 1, 2 (clipped at 1.28 for A = 1 > 0), 1; then 0.5 (clipped at 0.8 for A = -2 < 0: the max), 1
    got = grpo.policy_loss(logp, OLD, ADV, MASK, 0.2, 0.28)
    assert got.item() == pytest.approx((-1 - 1.28 - 1 + 2 * 0.8 + 2) / 5)
    per_sequence = grpo.policy_loss(logp, OLD, ADV, MASK, 0.2, 0.28, loss_agg_mode="seq-mean-token-mean")
    assert per_sequence.item() == pytest.approx(((-1 - 1.28 - 1) / 3 + (2 * 0.8 + 2) / 2) / 2)


def call_token_policy_loss():
    got = grpo.token_policy_loss(OLD, OLD, ADV, MASK)  # on-policy: ratio 1, the loss is -A
    assert got[MASK.bool()].tolist() == [-1.0, -1.0, -1.0, 2.0, 2.0]


def call_aggregate_loss():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, float("inf")]], **F64)
    assert grpo.aggregate_loss(loss, MASK).item() == pytest.approx(15 / 5)
    assert grpo.aggregate_loss(loss, MASK, "seq-mean-token-sum-norm", 10).item() == pytest.approx((6 + 9) / 10 / 2)


def call_kl_penalized_rewards():
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.5, 9.0]], **F64)
    got = ppo.kl_penalized_rewards(torch.tensor([1.0, 2.0], **F64), kl, MASK, 0.1)
    close(got, [[-0.01, -0.02, 1 - 0.03], [-0.05, 2 - 0.05, 0.0]])


def call_compute_gae():
    rewards = torch.tensor([[0.0, 1.0]], **F64)
    values = torch.tensor([[0.5, 0.25]], **F64)
    advantages, returns = ppo.compute_gae(rewards, values, torch.ones(1, 2), 1.0, 0.5)
    last = 1.0 - 0.25
    first = 0.0 + 0.25 - 0.5 + 0.5 * last
    close(advantages, [[first, last]])
    close(returns, [[first + 0.5, last + 0.25]])


def call_ppo_policy_loss():
    got = ppo.policy_loss(OLD, OLD, ADV[:, None].expand(2, 3), MASK)  # ratio 1: the mean of -A over tokens
    assert got.item() == pytest.approx((-3 + 4) / 5)


def call_value_loss():
    values = torch.tensor([[1.0, 0.0, 0.0]], **F64)
    got = ppo.value_loss(values, torch.zeros(1, 3, **F64), torch.tensor([[2.0, 1.0, 0.0]], **F64), torch.ones(1, 3))
    # clipped values 0.2, 0, 0: max((v - R)^2, (clip - R)^2) = max(1, 3.24), 1, 0
    assert got.item() == pytest.approx(0.5 * (3.24 + 1) / 3)


def call_adaptive_kl_coef():
    assert ppo.adaptive_kl_coef(0.1, 3.0, 1.0, 100, 10) == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))


def call_dpo_loss():
    loss, chosen, rejected = dpo.dpo_loss(torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.0]),
                                          torch.tensor([-2.0]))
    assert loss.item() == pytest.approx(math.log1p(math.exp(-0.1 * 2)))
    assert chosen.item() == pytest.approx(0.1) and rejected.item() == pytest.approx(-0.1)


def call_masked_mean():
    assert common.masked_mean(OLD, MASK).item() == pytest.approx((-1 - 2 - 0.5 - 0.3 - 1.2) / 5)


def call_masked_whiten():
    x = torch.tensor([[1.0, 3.0, 100.0]], **F64)
    got = common.masked_whiten(x, torch.tensor([[1, 1, 0]]))
    close(got, [[-1.0, 1.0, 0.0]], atol=1e-6)


def call_approx_kl():
    d = torch.tensor([0.5], **F64)
    assert common.approx_kl(d, torch.zeros(1, **F64)).item() == 0.5
    assert common.approx_kl(d, torch.zeros(1, **F64), "k3").item() == pytest.approx(math.exp(-0.5) - 1 + 0.5)


def call_response_logprobs(toy_world, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(toy_world / "model").double()
    prompt, response = (torch.tensor(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in ("12+34=", "46"))
    logprobs, entropy, _ = common.response_logprobs(model, [(prompt, response)], tokenizer.pad_token_id, False)
    with torch.no_grad():
        logits = model(torch.cat([prompt, response])[None]).logits[0]
    want = [torch.log_softmax(logits[len(prompt) - 1 + i], -1)[t].item() for i, t in enumerate(response.tolist())]
    assert entropy is None and logprobs[0].tolist() == pytest.approx(want, abs=1e-9)


def call_rollout_correction_weights():
    rollout_logprobs = OLD - torch.tensor([[math.log(3), 0.0, 0.0], [0.0, 0.0, 0.0]], **F64)  # weight 3, then 1s
    weights, changed = engines.rollout_correction_weights(OLD, rollout_logprobs, MASK, "token-truncate", (0.0, 2.0))
    close(weights, [[2.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    assert changed.tolist() == [[True, False, False], [False, False, False]]


def call_generalized_jsd_loss():
    # one token, two symbols: student (1/2, 1/2), teacher (3/4, 1/4) (logits log 3, 0)
    s, t = torch.zeros(1, 2, **F64), torch.tensor([[math.log(3), 0.0]], **F64)
    kl = lambda p, q: sum(a * math.log(a / b) for a, b in zip(p, q))  # noqa: E731
    m = [0.5 * 0.75 + 0.5 * 0.5, 0.5 * 0.25 + 0.5 * 0.5]
    assert distill.generalized_jsd_loss(s, t).item() == pytest.approx(
        0.5 * kl([0.75, 0.25], m) + 0.5 * kl([0.5, 0.5], m))
    assert distill.generalized_jsd_loss(s, t, 0.0).item() == pytest.approx(kl([0.75, 0.25], [0.5, 0.5]))


def call_sampled_kl_loss():
    # ratio 1 (old = current): the loss is minus the mean reward, the reward log pi_teacher - log pi_old
    logprobs = torch.tensor([[-1.0, -2.0]], **F64)
    loss = distill.sampled_kl_loss(logprobs, logprobs, torch.tensor([[-1.5, -1.0]], **F64), torch.tensor([[1, 1]]))
    assert loss.item() == pytest.approx(-(-0.5 + 1.0) / 2)


CALLS = {"sft.sft_loss": call_sft_loss, "rm.pairwise_loss": call_pairwise_loss, "prm.prm_loss": call_prm_loss,
         "prm.score_steps": call_score_steps, "prm.step_probabilities": call_step_probabilities,
         "grpo.process_advantages": call_process_advantages, "grpo.group_advantages": call_group_advantages,
         "grpo.token_advantages": call_token_advantages, "grpo.policy_loss": call_policy_loss,
         "grpo.token_policy_loss": call_token_policy_loss, "grpo.aggregate_loss": call_aggregate_loss,
         "ppo.kl_penalized_rewards": call_kl_penalized_rewards, "ppo.compute_gae": call_compute_gae,
         "ppo.policy_loss": call_ppo_policy_loss, "ppo.value_loss": call_value_loss,
         "ppo.adaptive_kl_coef": call_adaptive_kl_coef, "dpo.dpo_loss": call_dpo_loss,
         "common.masked_mean": call_masked_mean, "common.masked_whiten": call_masked_whiten,
         "common.approx_kl": call_approx_kl, "common.response_logprobs": call_response_logprobs,
         "engines.rollout_correction_weights": call_rollout_correction_weights,
         "distill.generalized_jsd_loss": call_generalized_jsd_loss, "distill.sampled_kl_loss": call_sampled_kl_loss}


@pytest.mark.parametrize("name", CALLS)
def test_each_function_called_as_documented(name, request):
    call = CALLS[name]
    call(*(request.getfixturevalue(p) for p in inspect.signature(call).parameters))
