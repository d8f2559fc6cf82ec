"""The losses that never build [tokens, V] logits (issue 52: hidden states through the output layer a chunk of tokens
at a time, each chunk's logits made again in backward) against the plain computation in float64: each sample run
alone through the stock model, log_softmax over the whole vocabulary at every position, the loss written out by its
definition. Values and parameter gradients, on the toy model and the five tokenizer families' stand-ins, with one
chunk and with chunks of 3 tokens (several, a partial last one):
  - SFT: sft.py's sft_loss_chunked, padded and packed rows;
  - the RL / DPO log-probs and entropy: common.response_logprobs (tests/test_logprobs.py checks the toy model's
    padded, packed and shared-prompt layouts in detail);
  - GKD: distill.py's gkd_loss (generalized JSD of student and teacher) and the two models' token log-probs;
  - PRM: prm.py's prm_loss on the output layer's logits at the placeholders only.
And common.output_layer reproduces the logits of families that scale or soft-cap them (Granite, Cohere, Gemma 2)."""
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import common
import distill
import families
import packing
import prm
import sft

MODELS = ["toy"] + families.FAMILIES
TEXTS = [("12+34=", "46"), ("7+8=", "15 and more"), ("123+4567=", "4690")]


def rel_close(got, want, tol):
    torch.testing.assert_close(got, want, atol=tol * want.abs().max().item(), rtol=0)


def grads(model, loss):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)


def same_grads(model, loss, reference, ref_loss, tol=1e-9):
    for g, ref_g in zip(grads(model, loss), grads(reference, ref_loss)):
        assert (g is None) == (ref_g is None)
        if ref_g is not None:
            rel_close(g, ref_g, tol)


@pytest.fixture(scope="module")
def checkpoints(toy_world, family_dirs):
    return {"toy": toy_world / "model", **{f: d / "model" for f, d in family_dirs.items()}}


def load(path, attention="sdpa"):
    packing.register_packed_sdpa()
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation=attention).double()


def encode(path):
    """TEXTS as (prompt ids, response ids) in the checkpoint's tokenizer, and an id to pad with."""
    tok = AutoTokenizer.from_pretrained(path)
    pairs = [(torch.tensor(tok(p)["input_ids"]), torch.tensor(tok(r, add_special_tokens=False)["input_ids"]))
             for p, r in TEXTS]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return pairs, pad


def plain_logprobs(model, prompt, response, temperature=1.0):
    """[len(response), V] float64 log-softmax of the logits that predict each response token (the sample alone)."""
    logits = model(torch.cat([prompt, response])[None]).logits[0, len(prompt) - 1:len(prompt) + len(response) - 1]
    return torch.log_softmax(logits.double() / temperature, -1)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "recomputed"])
@pytest.mark.parametrize("chunk", [1024, 3], ids=["one_chunk", "chunks_of_3"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("name", MODELS)
def test_sft_loss_chunked_matches_float64(checkpoints, name, packed, chunk, fused, monkeypatch):
    """Both of sft.token_nll_sum's ways: LinearNLL (a plain output matrix, its gradient taken in forward), and
    token_logprobs (the way of a ZeRO-3 partitioned, LoRA or soft-capped output layer)."""
    monkeypatch.setattr(common, "LOGPROB_CHUNK", chunk)
    if not fused:
        monkeypatch.setattr(sft.LinearNLL, "apply", lambda hidden, weight, tokens: -common.token_logprobs(
            model, hidden, tokens)[0].sum())
    model = load(checkpoints[name], "packed_sdpa" if packed else "sdpa")
    pairs, pad = encode(checkpoints[name])
    seqs = [torch.cat([p, r]) for p, r in pairs]
    labels = [torch.cat([torch.full_like(p, -100), r]) for p, r in pairs]
    ids, mask, pos = common.batch_sequences(seqs, pad, packed)
    labels, _, _ = common.batch_sequences(labels, -100, packed)
    hidden, _ = common.forward_hidden(model, dict(input_ids=ids, attention_mask=mask, position_ids=pos,
                                                  use_cache=False))
    loss = sft.sft_loss_chunked(model, hidden, labels)
    assert ("LinearNLL" in type(loss.grad_fn.next_functions[0][0]).__name__) == fused

    reference = load(checkpoints[name])
    token_nll = [-plain_logprobs(reference, p, r)[torch.arange(len(r)), r] for p, r in pairs]
    want = torch.cat(token_nll).mean()
    assert loss.dtype == torch.float64 and abs(loss.item() - want.item()) < 1e-10
    # the public reference form on the whole logits says the same
    assert abs(sft.sft_loss(model(input_ids=ids, attention_mask=mask, position_ids=pos).logits, labels).item()
               - want.item()) < 1e-10
    same_grads(model, loss, reference, want)


@pytest.mark.parametrize("chunk", [1024, 3], ids=["one_chunk", "chunks_of_3"])
@pytest.mark.parametrize("name", MODELS)
def test_response_logprobs_and_entropy_match_float64(checkpoints, name, chunk, monkeypatch):
    monkeypatch.setattr(common, "LOGPROB_CHUNK", chunk)
    model = load(checkpoints[name])
    pairs, pad = encode(checkpoints[name])
    logp, entropy, _ = common.response_logprobs(model, pairs, pad, False, temperature=0.7, with_entropy=True)
    reference = load(checkpoints[name])
    ref_logp, ref_entropy = [], []
    for i, (p, r) in enumerate(pairs):
        all_logp = plain_logprobs(reference, p, r, 0.7)
        ref_logp.append(all_logp[torch.arange(len(r)), r])
        ref_entropy.append(-(all_logp.exp() * all_logp).sum(-1))
        torch.testing.assert_close(logp[i, :len(r)], ref_logp[-1], atol=1e-10, rtol=0)
        torch.testing.assert_close(entropy[i, :len(r)], ref_entropy[-1], atol=1e-10, rtol=0)
    # a loss weighting each token differently, as a policy gradient does, and the entropy bonus
    weights = [torch.linspace(-1, 2, len(r), dtype=torch.float64) for _, r in pairs]
    ours = sum((logp[i, :len(r)] * w).sum() for i, ((_, r), w) in enumerate(zip(pairs, weights))) - 0.1 * entropy.sum()
    theirs = sum((lp * w).sum() for lp, w in zip(ref_logp, weights)) - 0.1 * sum(h.sum() for h in ref_entropy)
    same_grads(model, ours, reference, theirs)


@pytest.mark.parametrize("chunk", [1024, 3], ids=["one_chunk", "chunks_of_3"])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("name", MODELS)
def test_gkd_loss_matches_float64(checkpoints, name, beta, chunk, monkeypatch):
    monkeypatch.setattr(common, "LOGPROB_CHUNK", chunk)
    student, teacher = load(checkpoints[name]), load(checkpoints[name])
    torch.manual_seed(1)
    with torch.no_grad():  # a different teacher: its weights moved a little
        for p in teacher.parameters():
            p.add_(0.5 * torch.randn_like(p) * p.std().nan_to_num())
    teacher.requires_grad_(False)
    pairs, pad = encode(checkpoints[name])
    vocab = len(AutoTokenizer.from_pretrained(checkpoints[name]))
    loss, logp_s, logp_t, _ = distill.gkd_loss(student, teacher, pairs, pad, False, vocab, beta, 0.7)

    reference = load(checkpoints[name])
    per_token, ref_s, ref_t = [], [], []
    for p, r in pairs:  # the definition, term by term, over the whole vocabulary
        s = torch.log_softmax(reference(torch.cat([p, r])[None]).logits[0, len(p) - 1:len(p) + len(r) - 1, :vocab]
                              .double() / 0.7, -1)
        with torch.no_grad():
            t = torch.log_softmax(teacher(torch.cat([p, r])[None]).logits[0, len(p) - 1:len(p) + len(r) - 1, :vocab]
                                  .double() / 0.7, -1)
        if beta == 0:
            kl = (t.exp() * (t - s)).sum(-1)
        elif beta == 1:
            kl = (s.exp() * (s - t)).sum(-1)
        else:
            m = torch.log(beta * t.exp() + (1 - beta) * s.exp())
            kl = beta * (t.exp() * (t - m)).sum(-1) + (1 - beta) * (s.exp() * (s - m)).sum(-1)
        per_token.append(kl)
        ref_s.append(s[torch.arange(len(r)), r].detach())
        ref_t.append(t[torch.arange(len(r)), r])
    want = torch.cat(per_token).mean()
    assert want.item() > 1e-3  # the two models differ: the loss is not trivially 0
    assert abs(loss.item() - want.item()) < 1e-10 * max(1.0, want.item())
    torch.testing.assert_close(logp_s, torch.cat(ref_s), atol=1e-10, rtol=0)
    torch.testing.assert_close(logp_t, torch.cat(ref_t), atol=1e-10, rtol=0)
    same_grads(student, loss, reference, want)


@pytest.mark.parametrize("name", MODELS)
def test_prm_loss_at_the_placeholders_matches_float64(checkpoints, name):
    model = load(checkpoints[name])
    pairs, pad = encode(checkpoints[name])
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    placeholder, reward_ids = 5, [7, 9]
    seqs = [torch.cat([p, r]) for p, r in pairs]
    for s in seqs:  # a few judged positions per sample
        s[torch.randperm(len(s), generator=g)[:3]] = placeholder
    hard = [torch.where(s == placeholder, torch.tensor(reward_ids)[torch.randint(2, s.shape, generator=g)], -100)
            for s in seqs]
    ids, mask, pos = common.batch_sequences(seqs, pad, False)
    labels, _, _ = common.batch_sequences(hard, -100, False)
    hidden, _ = common.forward_hidden(model, dict(input_ids=ids, attention_mask=mask, position_ids=pos,
                                                  use_cache=False))
    at = (ids == placeholder) & mask.bool()
    head_rows = []  # as prm.py trains: the output layer at the judged positions only
    hook = model.get_output_embeddings().register_forward_hook(lambda m, a, o: head_rows.append(a[0].shape[0]))
    logits = common.output_layer(model)(hidden[at])
    hook.remove()
    assert head_rows == [at.sum().item()] and logits.shape == (at.sum().item(), vocab)
    loss, accuracy = prm.prm_loss(logits[None], ids[at][None], labels[at][None], placeholder, reward_ids)

    reference = load(checkpoints[name])
    terms, right = [], []
    for s, y in zip(seqs, hard):
        full = reference(s[None]).logits[0].double()
        for t in (s == placeholder).nonzero().flatten().tolist():
            two = torch.log_softmax(full[t, reward_ids], -1)
            k = reward_ids.index(y[t].item())
            terms.append(-two[k])
            right.append(two.argmax().item() == k)
    want = torch.stack(terms).mean()
    assert abs(loss.item() - want.item()) < 1e-10 and accuracy.item() == pytest.approx(sum(right) / len(right))
    same_grads(model, loss, reference, want)


@pytest.mark.parametrize("family", ["granite", "cohere", "gemma2"])
def test_output_layer_keeps_a_family_s_logit_scaling_and_softcap(family):
    import transformers

    size = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2)
    config = {"granite": lambda: transformers.GraniteConfig(**size, logits_scaling=4.0),
              "cohere": lambda: transformers.CohereConfig(**size, logit_scale=0.25),
              "gemma2": lambda: transformers.Gemma2Config(**size, head_dim=8, final_logit_softcapping=3.0)}[family]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).double()
    ids = torch.randint(97, (2, 7))
    common.forward_hidden(model, dict(input_ids=ids))  # the first call checks output_layer against the model
    hidden, out = common.forward_hidden(model, dict(input_ids=ids))
    assert out.logits.numel() == 0  # the forward made no logits
    want = model(input_ids=ids).logits
    got = common.output_layer(model)(hidden)
    assert (got - want).abs().max().item() < 1e-12 and (got - model.lm_head(hidden)).abs().max().item() > 1e-3
    assert math.isfinite(got.sum().item())


ZERO3_RANKS = '''
import sys
import torch
sys.path.insert(0, sys.argv[1])
import common
import sft
import deepspeed
from transformers import AutoModelForCausalLM

deepspeed.init_distributed("gloo")
rank = torch.distributed.get_rank()
model = AutoModelForCausalLM.from_pretrained(sys.argv[2])
if sys.argv[3] == "frozen":  # the output layer (tied: the embedding too) frozen, as LoRA leaves it
    model.get_output_embeddings().weight.requires_grad_(False)
reference = AutoModelForCausalLM.from_pretrained(sys.argv[2])
engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                  config={"train_micro_batch_size_per_gpu": 1, "optimizer": {
                                      "type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
                                      # every parameter partitioned, even ones this small
                                      "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
assert hasattr(engine.module.get_output_embeddings().weight, "ds_id")  # partitioned
common.LOGPROB_CHUNK = 2
reductions, reduce_max = [], common.all_reduce_max
common.all_reduce_max = lambda values: reductions.append(1) or reduce_max(values)
for step in range(2):  # rank 0: 3 tokens (2 chunks); rank 1: 9 tokens (5 chunks), then the other way round
    n = 4 + 6 * (rank ^ step)
    ids = torch.arange(5, 5 + n)[None]
    hidden, _ = common.forward_hidden(engine, dict(input_ids=ids))
    logp, _ = common.token_logprobs(engine, hidden[0, :-1], ids[0, 1:])
    loss = sft.token_nll_sum(engine, hidden[0, :-1], ids[0, 1:])
    if step == 0:  # the weights the reference has
        with torch.no_grad():
            want = torch.log_softmax(reference(ids).logits[0, :-1], -1)[torch.arange(n - 1), ids[0, 1:]]
        torch.testing.assert_close(logp, want, atol=1e-5, rtol=0)
        torch.testing.assert_close(loss, -want.sum(), atol=1e-4, rtol=0)
    engine.backward(loss - logp.sum())
    engine.step()
if sys.argv[3] == "trained":  # SFT-like steps whose token counts change (the same on both ranks): 1 to 5 chunks
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as Coordinator
    invalidations, invalidate = [], Coordinator._invalidate_trace
    Coordinator._invalidate_trace = lambda self: invalidations.append(1) or invalidate(self)
    for step, n in enumerate((4, 9, 4, 11, 3, 7)):
        if step == 1:  # step 0 changed the kind of step (one loss call, not two): DeepSpeed records anew, rightly
            invalidations.clear()
        ids = torch.arange(5, 5 + n)[None]
        hidden, _ = common.forward_hidden(engine, dict(input_ids=ids))
        engine.backward(sft.token_nll_sum(engine, hidden[0, :-1], ids[0, 1:]))
        engine.step()
    print(f"rank {rank}: {len(invalidations)} trace invalidations", flush=True)
print(f"rank {rank}: {len(reductions)} chunk-count reductions", flush=True)
print(f"rank {rank}: ok", flush=True)
'''


@pytest.mark.parametrize("head", ["trained", "frozen"])
def test_zero3_ranks_with_different_chunk_counts_stay_in_step(toy_world, tmp_path, head):
    """Under ZeRO-3 every call of the output layer gathers it by a collective: ranks with different numbers of
    chunks (here 2 and 5) must still make as many calls, forward and backward, or the run hangs. A frozen output
    layer (LoRA) is read from a gathered copy (backward's recompute would find the partitioned one released), with
    no collective a chunk: no padding, no chunk count to agree on. Steps whose token counts differ make as many
    output-layer calls as the most any step made before (5 chunks here), so DeepSpeed's recorded order of module
    calls, which it prefetches along, stays valid."""
    from conftest import ROOT, run_script

    script = tmp_path / "zero3_chunks.py"
    script.write_text(ZERO3_RANKS)
    proc = run_script(script, ROOT, toy_world / "model", head, nproc=2, timeout=240)
    assert proc.stdout.count(": ok") == 2
    if head == "trained":
        assert proc.stdout.count(": 0 trace invalidations") == 2, proc.stdout
    else:
        assert proc.stdout.count(": 0 chunk-count reductions") == 2, proc.stdout


def test_ranks_padding_empty_chunks_change_nothing(checkpoints, monkeypatch):
    """The ZeRO-3 path of common.chunked in one process: the output layer marked partitioned and the other ranks'
    chunk count faked two higher than this rank asks (its own, or the high-water mark: 2, then more empty chunks a
    call); log-probs, the entropy, SFT's loss and GKD's loss and gradients are those of the plain run, and finite."""
    monkeypatch.setattr(common, "LOGPROB_CHUNK", 3)
    model, teacher = load(checkpoints["toy"]), load(checkpoints["toy"])
    teacher.requires_grad_(False)
    pairs, pad = encode(checkpoints["toy"])
    vocab = model.config.vocab_size

    def run():
        logp, entropy, _ = common.response_logprobs(model, pairs, pad, False, with_entropy=True)
        gkd, _, _, _ = distill.gkd_loss(model, teacher, pairs, pad, False, vocab, 0.5, 1.0)
        hidden, _ = common.forward_hidden(model, dict(input_ids=torch.cat(pairs[0])[None]))
        nll = sft.token_nll_sum(model, hidden[0, :-1], torch.cat(pairs[0])[1:])
        return [logp, entropy, gkd, nll], grads(model, logp.sum() + entropy.sum() + gkd + nll)

    plain, plain_grads = run()
    calls = []
    monkeypatch.setattr(common, "all_reduce_max", lambda values: calls.append(values) or [v + 2 for v in values])
    model.get_output_embeddings().weight.ds_id = 0  # what ZeRO-3 puts on a partitioned parameter
    padded, padded_grads = run()
    assert len(calls) == 3  # log-probs, gkd, and SFT's loss (not fused: a partitioned weight), each padded
    for got, want in zip(padded + list(padded_grads), plain + list(plain_grads)):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_zero3_chunk_counts_kept_per_kind(checkpoints, monkeypatch):
    """Under ZeRO-3 a call runs as many output-layer chunks as the most its kind made before (DeepSpeed's recorded
    module order stays valid): training calls pad to the training count, and a no-grad pass over more tokens (a
    rollout's log-probs) keeps a count of its own instead of raising theirs."""
    monkeypatch.setattr(common, "LOGPROB_CHUNK", 2)
    monkeypatch.setattr(common, "all_reduce_max", lambda values: values)  # one rank
    model = load(checkpoints["toy"])
    head = model.get_output_embeddings()
    head.weight.ds_id = 0  # what ZeRO-3 puts on a partitioned parameter
    calls = []
    head.register_forward_hook(lambda module, args, out: calls.append(len(args[0])))
    hidden = torch.randn(9, model.config.hidden_size, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, model.config.vocab_size, (9,))

    def chunks(n, grad):
        calls.clear()
        with torch.set_grad_enabled(grad):
            common.token_logprobs(model, hidden[:n], tokens[:n])
        return calls[:]

    assert chunks(6, True) == [2, 2, 2]
    assert chunks(3, True) == [2, 1, 0]
    assert chunks(9, False) == [2, 2, 2, 2, 1]
    assert chunks(2, True) == [2, 0, 0]
    assert chunks(1, False) == [1, 0, 0, 0, 0]


def test_chunks_are_sized_by_the_vocabulary():
    """common.chunk_rows: 1,024 tokens a chunk up to a 32k vocabulary (the toy's runs unchanged), fewer past it so a
    chunk's logits stay within CHUNK_LOGITS, never under 128. A 152k-vocabulary output layer is called on chunks of
    220 rows, and the log-probs and sft's fused loss are float64's, values and gradients."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    assert [common.chunk_rows(v) for v in (101, 32000, 32768)] == [1024] * 3
    for vocab in (49152, 151936, 256000):
        rows = common.chunk_rows(vocab)
        assert 128 <= rows < 1024 and rows * vocab <= common.CHUNK_LOGITS < (rows + 1) * vocab
    assert common.chunk_rows(10**6) == 128
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=151936, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False))
    calls = []
    model.lm_head.register_forward_hook(lambda module, args, out: calls.append(len(args[0])))
    hidden, tokens = torch.randn(260, 16, requires_grad=True), torch.randint(151936, (260,))
    logp, _ = common.token_logprobs(model, hidden, tokens)
    assert calls == [220, 40]
    h64 = hidden.detach().double().requires_grad_()
    want = torch.log_softmax(h64 @ model.lm_head.weight.double().T, -1)[torch.arange(260), tokens]
    want_grad, = torch.autograd.grad(want.sum(), h64)
    torch.testing.assert_close(logp.double(), want.detach(), atol=1e-5, rtol=0)
    got_grad, = torch.autograd.grad(logp.sum(), hidden)
    torch.testing.assert_close(got_grad.double(), want_grad, atol=1e-5, rtol=0)
    nll = sft.token_nll_sum(model, hidden, tokens)
    assert "LinearNLL" in type(nll.grad_fn).__name__
    torch.testing.assert_close(nll.double(), -want.detach().sum(), atol=0, rtol=1e-6)
    got_grad, = torch.autograd.grad(nll, hidden)
    torch.testing.assert_close(got_grad.double(), -want_grad, atol=1e-5, rtol=0)
    with torch.no_grad():  # an eval: linear_nll's loss alone, no gradient taken
        torch.testing.assert_close(sft.token_nll_sum(model, hidden, tokens).double(), -want.detach().sum(), atol=0,
                                   rtol=1e-6)


def test_fused_nll_in_bf16_and_with_a_frozen_head(checkpoints):
    """LinearNLL as a GPU runs it (bf16 weights and hidden states; the softmax in fp32) against float64, and with the
    output layer frozen (LoRA) no weight gradient at all, the same hidden-state gradient."""
    model = load(checkpoints["toy"])
    head = model.get_output_embeddings().weight.detach()
    torch.manual_seed(0)
    hidden = torch.randn(50, head.size(1), dtype=torch.float64)
    tokens = torch.randint(head.size(0), (50,))
    want = -torch.log_softmax(hidden @ head.T, -1)[torch.arange(50), tokens].sum()
    want_h, = torch.autograd.grad(-torch.log_softmax((hidden.requires_grad_() @ head.T), -1)[torch.arange(50), tokens]
                                  .sum(), hidden)
    h16, w16 = hidden.detach().bfloat16().requires_grad_(), head.bfloat16().requires_grad_()
    loss = sft.LinearNLL.apply(h16, w16, tokens)
    loss.backward()
    assert loss.dtype == torch.float32 and abs(loss.item() - want.item()) < 1e-2 * abs(want.item())
    assert (h16.grad.double() - want_h).abs().max() < 2e-2 * want_h.abs().max() and w16.grad is not None
    frozen = head.clone().requires_grad_(False)
    h = hidden.detach().requires_grad_()
    sft.LinearNLL.apply(h, frozen, tokens).backward()
    assert frozen.grad is None
    torch.testing.assert_close(h.grad, want_h, atol=1e-10, rtol=0)


def test_a_logit_scaling_output_layer_does_not_know_stops_in_one_line(checkpoints):
    """A family scaling its logits in a way output_layer does not reproduce (here: output_layer told to divide by 4
    what the model does not): the first forward_hidden says so, rather than train on wrong log-probs."""
    model = load(checkpoints["toy"])
    model.config.logits_scaling = 4.0
    with pytest.raises(SystemExit, match=r"^error: .*its logits are not its output layer applied"):
        common.forward_hidden(model, dict(input_ids=torch.tensor([[1, 5, 6]])))
    del model.config.logits_scaling
    for _ in range(2):  # checked, then as every call after
        hidden, out = common.forward_hidden(model, dict(input_ids=torch.tensor([[1, 5, 6]])))
    assert hidden.shape[:2] == (1, 3) and out.logits.numel() == 0
