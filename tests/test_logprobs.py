"""common.response_logprobs, the log-probs every loss and KL is made of, against a naive float64
reference: each (prompt, response) run alone through the stock model (sdpa), log_softmax over the whole vocabulary
at every position, each response token picked. Padded and packed (a group's prompt laid out once), prompts and
responses of different lengths (an empty one too), a temperature, one chunk of rows or several: log-probs and
entropies within 1e-6, their gradients as the reference's; the output layer sees only the response positions, a
chunk at a time."""
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import common
import packing

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def batch(policy):
    """Three prompts of different lengths, the first one twice (a group), responses of 4, 1, 6, 0 and 3 tokens."""
    tok = AutoTokenizer.from_pretrained(policy)
    x, y, z = (torch.tensor(tok(text)["input_ids"]) for text in ("12+34=", "7+8=", "123+4567="))
    g = torch.Generator().manual_seed(0)
    responses = [torch.randint(4, len(tok), (n,), generator=g) for n in (4, 1, 6, 0, 3)]
    return list(zip([x, y, x, z, x], responses)), tok.pad_token_id


def float64_model(policy, attention):
    packing.register_packed_sdpa()
    return AutoModelForCausalLM.from_pretrained(policy, attn_implementation=attention).double()


def naive(model, batch):
    """-> per pair: the response's log-probs and entropies [len(r)] (float64, with their graphs)."""
    out = []
    for p, r in batch:
        logits = model(torch.cat([p, r])[None]).logits[0, len(p) - 1:len(p) + len(r) - 1]
        logp_all = torch.log_softmax(logits.double() / TEMPERATURE, -1)
        out.append((logp_all[torch.arange(len(r)), r], -(logp_all.exp() * logp_all).sum(-1)))
    return out


def grads(model, loss):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)


@pytest.mark.parametrize("chunk", [1024, 3], ids=["one_chunk", "chunks_of_3"])
@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("share_prompts", [True, False], ids=["shared_prompt", "prompt_per_pair"])
def test_response_logprobs_match_a_float64_reference(policy, batch, share_prompts, packing, chunk, monkeypatch):
    pairs, pad_id = batch
    n_rows = sum(len(r) for _, r in pairs)
    assert chunk >= n_rows or chunk < n_rows // 2  # one chunk, or several (a partial last one)
    monkeypatch.setattr(common, "LOGPROB_CHUNK", chunk)
    model = float64_model(policy, "packed_sdpa" if packing else "sdpa")
    head_rows = []  # the output layer sees the response positions only, at most `chunk` of them at a time
    model.get_output_embeddings().register_forward_hook(lambda m, inp, out: head_rows.append(inp[0].shape[:-1].numel()))
    logp, entropy, _ = common.response_logprobs(model, pairs, pad_id, packing, TEMPERATURE, with_entropy=True,
                                                share_prompts=share_prompts)
    # (a model's first forward keeps each row's last position, to check output_layer against: once by it, once ours)
    rows = 1 if packing else len(pairs)
    assert head_rows == [rows, rows] + [min(chunk, n_rows - i) for i in range(0, n_rows, chunk)]
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones(len(r), dtype=torch.bool) for _, r in pairs], batch_first=True)
    assert logp.shape == entropy.shape == mask.shape and not logp[~mask].any() and not entropy[~mask].any()

    reference = float64_model(policy, "sdpa")  # eager attention takes its softmax in float32
    expected = naive(reference, pairs)
    for i, (ref_logp, ref_entropy) in enumerate(expected):
        torch.testing.assert_close(logp[i, mask[i]], ref_logp, atol=1e-6, rtol=0)
        torch.testing.assert_close(entropy[i, mask[i]], ref_entropy, atol=1e-6, rtol=0)
    # the gradients, through the chunks: of the log-probs (every loss), and of the entropy (the bonus). Relative
    # to the largest: 1e-10, or 1e-6 where a group's prompt is laid out once: the RMSNorm upcasts to float32
    # even in a float64 model, so the prompt's summed gradient is rounded once instead of once per copy
    tol = 1e-6 if share_prompts and packing else 1e-10
    for ours, theirs in [(logp.sum(), sum(lp.sum() for lp, _ in expected)),
                         (entropy.sum(), sum(h.sum() for _, h in expected))]:
        for g, ref_g in zip(grads(model, ours), grads(reference, theirs)):
            assert (g is None) == (ref_g is None)
            if ref_g is not None:
                torch.testing.assert_close(g, ref_g, atol=tol * ref_g.abs().max().item(), rtol=0)


@pytest.mark.parametrize("share_prompts", [True, False], ids=["shared_prompt", "prompt_per_pair"])
def test_entropy_as_a_metric_has_no_graph(policy, batch, share_prompts):
    """entropy_grad=False (--entropy_loss_coef 0): the same entropies, without a graph; the log-probs keep theirs."""
    pairs, pad_id = batch
    model = AutoModelForCausalLM.from_pretrained(policy)
    kwargs = dict(pad_id=pad_id, packing=False, temperature=TEMPERATURE, share_prompts=share_prompts)
    logp, entropy, _ = common.response_logprobs(model, pairs, with_entropy=True, **kwargs)
    metric_logp, metric, _ = common.response_logprobs(model, pairs, with_entropy=True, entropy_grad=False, **kwargs)
    assert entropy.requires_grad and logp.requires_grad and metric_logp.requires_grad
    assert not metric.requires_grad
    torch.testing.assert_close(metric, entropy.detach(), atol=0, rtol=0)
    torch.testing.assert_close(metric_logp, logp, atol=0, rtol=0)
    with torch.no_grad():  # the rollout: no graph at all
        rollout_logp, none, _ = common.response_logprobs(model, pairs, **kwargs)
    assert none is None and not rollout_logp.requires_grad
    torch.testing.assert_close(rollout_logp, logp.detach(), atol=0, rtol=0)
