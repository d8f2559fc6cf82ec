"""Packing and last-token scoring: packed, left-padded and right-padded layouts give what each
sequence gives alone, and our reward equals stock AutoModelForSequenceClassification's."""
import copy
import functools
import sys
import types

import pytest
import torch
from packaging.version import Version
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

import common
import packing
import rm
import sft
from conftest import script_args

LENGTHS = [3, 7, 1, 12, 5, 9]


def toy_args(**kw):
    return script_args(**{"output_key": "output", "multiturn": False, "pretrain_mode": False, "chosen_key": "chosen",
                          "rejected_key": "rejected", **kw})


@pytest.fixture(scope="module")
def sequences(tokenizer):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(4, len(tokenizer), (n,), generator=g) for n in LENGTHS]


@pytest.fixture(scope="module")
def reward_model(toy_world, tokenizer):
    model = AutoModelForSequenceClassification.from_pretrained(toy_world / "model", num_labels=1).eval()
    torch.nn.init.normal_(model.score.weight, std=1.0)  # rewards of order 1, so differences show
    model.config.pad_token_id = tokenizer.pad_token_id
    return model


@torch.no_grad()
def test_packed_and_padded_logits_equal_each_sequence_alone(toy_world, sequences, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(toy_world / "model").eval()
    alone = [model(input_ids=s[None]).logits[0] for s in sequences]
    ids, mask, pos = common.batch_sequences(sequences, tokenizer.pad_token_id, packing=True)
    assert mask is None and ids.shape == (1, sum(LENGTHS))
    packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
    ids, mask, pos = common.batch_sequences(sequences, tokenizer.pad_token_id, packing=False)
    padded = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
    offset = 0
    for i, s in enumerate(sequences):
        torch.testing.assert_close(packed[offset:offset + len(s)], alone[i], atol=1e-5, rtol=0)
        torch.testing.assert_close(padded[i, :len(s)], alone[i], atol=1e-5, rtol=0)
        offset += len(s)


def twin_models(toy_world, kv_heads, sliding_window=None):
    """The same random weights with the stock eager attention and with packing.packed_sdpa; with a sliding
    window the toy's Llama becomes a Mistral (same weights' shapes, attention limited to the last keys)."""
    from transformers import AutoConfig, MistralConfig

    config = AutoConfig.from_pretrained(toy_world / "model", num_key_value_heads=kv_heads or 4)
    if sliding_window:
        config = MistralConfig(**{k: v for k, v in config.to_dict().items() if k != "model_type"},
                               sliding_window=sliding_window)
    return twins(config)


def mla_twins(tokenizer):
    """twin_models for a small DeepSeek-V3: its multi-head latent attention has values narrower than the queries
    and keys (16 against 24 here), and with YaRN its softmax scale is not 1/sqrt(head_dim): a kernel left to its
    default scale would differ."""
    from transformers import DeepseekV3Config

    yarn = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1}
    config = DeepseekV3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16,
                              qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=2,
                              max_position_embeddings=512, rope_parameters=yarn)
    return twins(config)


def twins(config):
    """Random weights (seed 0) of `config` with the stock eager attention, and the same weights with packed_sdpa."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    packing.register_packed_sdpa()
    packed_model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="packed_sdpa")
    packed_model.load_state_dict(model.state_dict())
    return model, packed_model


def assert_packed_row_equals_alone(model, packed_model, pieces, prefixes):
    """A packed row of `pieces` (tokens, first position) gives, piece by piece, the logits of its prefix then
    the piece run alone by the eager model, and the same gradients."""
    ids = torch.cat([t for t, _ in pieces])[None]
    pos = torch.cat([torch.arange(p, p + len(t)) for t, p in pieces])[None]
    packed = packed_model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
    packed.square().mean().backward()
    alone, offset = 0.0, 0
    for (t, _), prefix in zip(pieces, prefixes):
        logits = model(input_ids=torch.cat([prefix, t])[None]).logits[0, len(prefix):]
        torch.testing.assert_close(packed[offset:offset + len(t)], logits, atol=1e-5, rtol=0)
        alone = alone + logits.square().sum() / packed.numel()
        offset += len(t)
    alone.backward()
    grads = dict(packed_model.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("kv_heads", [None, 2])
def test_packed_sdpa_attends_within_each_sequence(toy_world, sequences, tokenizer, kv_heads):
    """packing.packed_sdpa (what --packing_samples loads): one sdpa call per packed sequence gives each
    sequence's logits alone, and their gradients, also with grouped-query attention (2 key/value heads)."""
    model, packed_model = twin_models(toy_world, kv_heads)
    assert_packed_row_equals_alone(model, packed_model, [(s, 0) for s in sequences], [s[:0] for s in sequences])
    # not a packed row (a padded batch): plain sdpa with the mask
    ids, mask, pos = common.batch_sequences(sequences, tokenizer.pad_token_id, packing=False)
    with torch.no_grad():
        padded = packed_model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
        for i, s in enumerate(sequences):
            torch.testing.assert_close(padded[i, :len(s)], model(input_ids=s[None]).logits[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kv_heads", [None, 2])
def test_packed_sdpa_branches_attend_to_their_prefix(toy_world, sequences, kv_heads):
    """A branch (positions jumping back to p > 0) gives the logits of its sequence's first p tokens followed by
    the branch, run alone by the stock eager model, and the same gradients; a jump with too short a sequence
    before it to branch from is an error naming the token."""
    model, packed_model = twin_models(toy_world, kv_heads)
    a, b1, b2, c, c1 = sequences[3], sequences[0], sequences[1], sequences[4], sequences[5]
    # (tokens, first position): a; b1 after a's first 4 tokens; b2 after all 12 of a; c; c1 after c's first 2
    assert_packed_row_equals_alone(model, packed_model, [(a, 0), (b1, 4), (b2, 12), (c, 0), (c1, 2)],
                                   [a[:0], a[:4], a, c[:0], c[:2]])
    with pytest.raises(ValueError, match="positions jump to 5 at token 3, but the sequence before it starts with 3"):
        packed_model(input_ids=a[None, :6], position_ids=torch.tensor([[0, 1, 2, 5, 6, 7]]), use_cache=False)
    with pytest.raises(ValueError, match="positions start at 2 at token 0, with no sequence before it"):
        packed_model(input_ids=a[None, :3], position_ids=torch.tensor([[2, 3, 4]]), use_cache=False)


def test_packed_sdpa_keeps_a_sliding_window(toy_world, sequences):
    """With a sliding window of 4 (shorter than most pieces) packed sequences and branches still give the
    logits and gradients of each run alone by the stock eager attention, which applies the window."""
    model, packed_model = twin_models(toy_world, None, sliding_window=4)
    a, b1, b2, c = sequences[3], sequences[0], sequences[5], sequences[4]
    assert_packed_row_equals_alone(model, packed_model, [(a, 0), (b1, 4), (b2, 12), (c, 0)],
                                   [a[:0], a[:4], a, c[:0]])


def flash_varlen(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
    """FlashAttention's varlen contract, as torch.nn.attention.varlen.varlen_attn states it, in a naive loop:
    [T, H, D] inputs; sequence i's queries q[cu_seq_q[i]:cu_seq_q[i + 1]] attend to its keys
    k[cu_seq_k[i]:cu_seq_k[i + 1]]; query r (of q_len) may see key c (of k_len) when c - (r + k_len - q_len) lies in
    [-left, right] of window_size (-1: unbounded), so (-1, 0) is causal aligned to the bottom right; with enable_gqa
    each Hq / Hkv consecutive query heads share a key/value head, without it the head counts must be equal."""
    assert q.dim() == k.dim() == v.dim() == 3 and q.dtype == k.dtype == v.dtype
    assert q.size(-1) == k.size(-1) == v.size(-1), "varlen_attn: one head_dim for query, key and value"
    assert enable_gqa or k.size(1) == q.size(1), "varlen_attn: Hq != Hkv without enable_gqa"
    cu_q, cu_k = cu_seq_q.tolist(), cu_seq_k.tolist()
    assert cu_q[0] == cu_k[0] == 0 and cu_q[-1] == len(q) and cu_k[-1] == len(k) and len(cu_q) == len(cu_k)
    assert max_q == max(b - a for a, b in zip(cu_q, cu_q[1:])) and max_k == max(b - a for a, b in zip(cu_k, cu_k[1:]))
    left, right = window_size
    out = []
    for i in range(len(cu_q) - 1):
        qi, ki, vi = q[cu_q[i]:cu_q[i + 1]], k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]]
        ki, vi = (x.repeat_interleave(q.size(1) // k.size(1), 1) for x in (ki, vi))
        offset = torch.arange(len(ki))[None] - (torch.arange(len(qi))[:, None] + len(ki) - len(qi))
        seen = ((offset >= -left) | (left < 0)) & ((offset <= right) | (right < 0))
        scores = torch.einsum("qhd,khd->hqk", qi, ki) * (scale or q.size(-1) ** -0.5)
        out.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(~seen, float("-inf")).softmax(-1), vi))
    return torch.cat(out)


def flash_varlen_211(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
    """torch 2.11's varlen_attn: the same contract, without enable_gqa."""
    return flash_varlen(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=window_size)


@pytest.mark.parametrize("kernel", [None, flash_varlen], ids=["loop", "varlen"])
def test_packed_sdpa_takes_deepseeks_latent_attention(tokenizer, sequences, monkeypatch, kernel):
    """DeepSeek-V3's multi-head latent attention gives values narrower than queries and keys (16 against 24 here):
    packed sequences and branches still give each one's logits and gradients alone (eager attention), in the loop
    and through the varlen kernel's stand-in, which takes one head_dim (the values get zero columns)."""
    model, packed_model = mla_twins(tokenizer)
    calls = []
    if kernel:
        monkeypatch.setattr(packing, "varlen_kernel", lambda query, value, dropout, kwargs: calls.append(1) or kernel)
    a, b1, c = sequences[3], sequences[0], sequences[4]
    assert_packed_row_equals_alone(model, packed_model, [(a, 0), (b1, 4), (c, 0)], [a[:0], a[:4], c[:0]])
    assert len(calls) == (model.config.num_hidden_layers if kernel else 0)


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("kv_heads, kernel", [(None, flash_varlen), (2, flash_varlen), (2, flash_varlen_211)],
                         ids=["mha", "gqa", "gqa-torch2.11"])
def test_packed_sdpa_on_the_varlen_kernel(toy_world, sequences, monkeypatch, window, kv_heads, kernel):
    """Where torch's varlen flash kernel applies (a CUDA GPU), packed_sdpa makes one call of it per layer. Here a
    float64 stand-in with the kernel's contract (flash_varlen) takes its place, so the real plan (cumulative
    lengths, the keys gathered for branches), window mapping, GQA handling and output layout run: sequences and
    branches, with and without a sliding window, give the logits and gradients of each run alone by the eager
    model, and those of the per-piece loop (packed_sdpa without the kernel)."""
    model, packed_model = twin_models(toy_world, kv_heads, sliding_window=window)
    model.double()
    packed_model.double()
    a, b1, b2, c, c1 = sequences[3], sequences[0], sequences[1], sequences[4], sequences[5]
    pieces, prefixes = [(a, 0), (b1, 4), (b2, 12), (c, 0), (c1, 2)], [a[:0], a[:4], a, c[:0], c[:2]]
    ids = torch.cat([t for t, _ in pieces])[None]
    pos = torch.cat([torch.arange(p, p + len(t)) for t, p in pieces])[None]
    loop = packed_model(input_ids=ids, position_ids=pos, use_cache=False).logits  # no kernel on a CPU: the loop
    loop.square().mean().backward()
    loop_grads = {n: p.grad.clone() for n, p in packed_model.named_parameters()}
    packed_model.zero_grad()
    calls = []

    @functools.wraps(kernel)  # its signature too: whether it takes enable_gqa
    def counted(*args, **kwargs):
        calls.append(kwargs["window_size"])
        return kernel(*args, **kwargs)
    monkeypatch.setattr(packing, "varlen_kernel", lambda query, value, dropout, kwargs: counted)
    # eager attention takes its softmax in float32 even in a float64 model: float32's tolerances against it
    assert_packed_row_equals_alone(model, packed_model, pieces, prefixes)
    assert calls == [(-1, 0) if window is None else (window - 1, 0)] * model.config.num_hidden_layers
    varlen = packed_model(input_ids=ids, position_ids=pos, use_cache=False).logits
    torch.testing.assert_close(varlen, loop, atol=1e-10, rtol=0)
    packed_model.zero_grad()
    varlen.square().mean().backward()
    for n, p in packed_model.named_parameters():
        torch.testing.assert_close(p.grad, loop_grads[n], atol=1e-10, rtol=1e-8)
    # no branch: the keys are the row itself, nothing gathered
    packed_model.zero_grad()
    model.zero_grad()
    assert_packed_row_equals_alone(model, packed_model, [(s, 0) for s in sequences], [s[:0] for s in sequences])


def test_an_older_torchs_varlen_kernel_is_left_alone(monkeypatch):
    """torch 2.10's varlen_attn took is_causal, not window_size; older ones had none: packed_sdpa then loops (no
    crash). 2.11's, without enable_gqa, is taken (GQA by repeating heads, tested above); so is this torch's."""
    kernel, version = packing.varlen_attn(), Version(torch.__version__)
    if not version.is_prerelease:  # this torch's own: window_size from 2.11, enable_gqa from 2.12 (read off the wheels);
        # a pre-release (NVIDIA's images ship 2.11.0a0+...) may have either signature
        assert (kernel is not None) == (version.release[:2] >= (2, 11))
        assert kernel is None or packing.takes_gqa(kernel) == (version.release[:2] >= (2, 12))
    for signature, taken in (("q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, is_causal=False", False),
                             ("q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)", True)):
        module = types.ModuleType("torch.nn.attention.varlen")
        exec(f"def varlen_attn({signature}): pass", module.__dict__)
        monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen", module)
        assert (packing.varlen_attn() is module.varlen_attn) == taken
    monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen", None)  # not in this torch: ImportError
    assert packing.varlen_attn() is None


def test_the_varlen_kernel_only_where_it_applies(monkeypatch):
    """The kernel's own limits (flash_api.cpp: CUDA, bf16/fp16, one head_dim for q, k and v, a multiple of 8 up to
    256; torch's wrapper: no dropout, softcap or sinks), asked of stand-in CUDA tensors: anything outside them loops.
    Values narrower than queries (DeepSeek's MLA: 128 against 192) are taken: packed_varlen pads them."""
    monkeypatch.setattr(packing, "torch_varlen", lambda index: "kernel")  # a GPU with compute capability 8+

    def gate(dtype=torch.bfloat16, d=128, dv=None, cuda=True, dropout=0.0, **kwargs):
        query = types.SimpleNamespace(is_cuda=cuda, dtype=dtype, device=torch.device("cuda", 0), size=lambda dim: d)
        return packing.varlen_kernel(query, types.SimpleNamespace(size=lambda dim: dv or d), dropout, kwargs)

    assert gate() == gate(torch.float16) == gate(d=8) == gate(d=256) == gate(d=192, dv=128) == "kernel"
    assert gate(sliding_window=4096) == "kernel"
    for refused in (gate(torch.float32), gate(cuda=False), gate(d=100), gate(d=264), gate(d=128, dv=192),
                    gate(dropout=0.1), gate(softcap=50.0), gate(s_aux=torch.zeros(4))):
        assert refused is None
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert gate() is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's varlen kernel runs on CUDA GPUs only")
@pytest.mark.parametrize("kv_heads, window", [(None, None), (2, None), (None, 4), (2, 4), ("mla", None)],
                         ids=["mha", "gqa", "window", "gqa-window", "deepseek-mla"])
def test_packed_sdpa_varlen_kernel_on_cuda(toy_world, tokenizer, sequences, monkeypatch, kv_heads, window):
    """The real kernel in bf16 (sequences, branches, GQA, a window, MLA's narrower values) against the per-piece
    loop in bf16, both measured against the float64 eager model: the kernel's error is no worse than the loop's,
    forward and backward. This is where the window's off-by-one is settled."""
    if packing.torch_varlen(torch.cuda.current_device()) is None:
        pytest.skip("torch's varlen kernel needs compute capability 8.0 and torch 2.11+")
    model, packed_model = mla_twins(tokenizer) if kv_heads == "mla" else \
        twin_models(toy_world, kv_heads, sliding_window=window)
    reference = model.double().cuda()
    a, b1, b2, c, c1 = (s.cuda() for s in (sequences[3], sequences[0], sequences[1], sequences[4], sequences[5]))
    pieces, prefixes = [(a, 0), (b1, 4), (b2, 12), (c, 0), (c1, 2)], [a[:0], a[:4], a, c[:0], c[:2]]
    ids = torch.cat([t for t, _ in pieces])[None]
    pos = torch.cat([torch.arange(p, p + len(t), device="cuda") for t, p in pieces])[None]
    expected = torch.cat([reference(input_ids=torch.cat([pre, t])[None]).logits[0, len(pre):]
                          for (t, _), pre in zip(pieces, prefixes)])
    expected.square().mean().backward()
    want = {n: p.grad for n, p in reference.named_parameters()}
    packed_model = packed_model.bfloat16().cuda()
    errors, calls = {}, []
    real = packing.varlen_kernel
    for name, kernel in (("loop", lambda *args: None),
                         ("varlen", lambda *args: calls.append(real(*args)) or calls[-1])):
        monkeypatch.setattr(packing, "varlen_kernel", kernel)
        packed_model.zero_grad()
        logits = packed_model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
        logits.float().square().mean().backward()
        grad = max(((p.grad.double() - want[n]).abs().max() / want[n].abs().max()).item()
                   for n, p in packed_model.named_parameters())
        errors[name] = ((logits.double() - expected).abs().max().item(), grad)
    assert calls and None not in calls  # every layer took the kernel
    for got, loop in zip(errors["varlen"], errors["loop"]):
        assert got <= 2 * loop + 1e-3, errors


@pytest.mark.parametrize("window", [None, 4])
def test_packed_rows_get_no_mask(toy_world, sequences, tokenizer, monkeypatch, window):
    """transformers would build a [1, 1, T, T] block-diagonal mask for every packed forward that packed_sdpa
    never reads: the mask function registered with it returns None for a packed row (and the logits are
    those of each sequence alone, also with a sliding window), but still sdpa's mask for a padded batch."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    model, packed_model = twin_models(toy_world, None, sliding_window=window)
    masks = []
    registered = ALL_MASK_ATTENTION_FUNCTIONS["packed_sdpa"]
    monkeypatch.setitem(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, "packed_sdpa",
                        lambda *a, **kw: masks.append(registered(*a, **kw)) or masks[-1])
    with torch.no_grad():
        ids, _, pos = common.batch_sequences(sequences, tokenizer.pad_token_id, packing=True)
        packed = packed_model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
        assert masks and all(m is None for m in masks)
        offset = 0
        for s in sequences:
            torch.testing.assert_close(packed[offset:offset + len(s)], model(input_ids=s[None]).logits[0],
                                       atol=1e-5, rtol=0)
            offset += len(s)
        masks.clear()
        ids, mask, pos = common.batch_sequences(sequences, tokenizer.pad_token_id, packing=False)
        packed_model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)
        assert masks and all(m is not None and m.shape == (len(sequences), 1, ids.size(1), ids.size(1))
                             for m in masks)


@torch.no_grad()
def test_sft_loss_packed_equals_padded(toy_world, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(toy_world / "model").eval()
    args = toy_args(max_len=64)
    records = [{"input": f"{a:02d}+{b:02d}=", "output": str(a + b)} for a, b in [(1, 2), (45, 67), (99, 99), (7, 80)]]
    samples = [sft.tokenize_sample(r, tokenizer, args) for r in records]
    losses = []
    for packed in (True, False):
        ids, mask, pos = common.batch_sequences([s[0] for s in samples], tokenizer.pad_token_id, packed)
        labels, _, _ = common.batch_sequences([s[1] for s in samples], -100, packed)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
        losses.append(sft.sft_loss(logits, labels))
    torch.testing.assert_close(losses[0], losses[1], atol=1e-5, rtol=0)


def test_sft_labels_cover_exactly_the_response(tokenizer):
    args = toy_args(max_len=64)
    ids, labels = sft.tokenize_sample({"input": "12+34=", "output": "46"}, tokenizer, args)
    assert tokenizer.decode(ids) == "<s>12+34=46</s>"
    trained = [int(t) for t, label in zip(ids, labels) if label != -100]
    assert trained == tokenizer("46", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert torch.equal(labels[-3:], ids[-3:]) and torch.all(labels[:-3] == -100)
    # chat template: the assistant turn through its stop token (eos) is trained on; the template's prompt
    # part and the "\n" it writes after the eos are not
    ids, labels = sft.tokenize_sample({"input": "12+34=", "output": "46"}, tokenizer, toy_args(
        max_len=64, apply_chat_template=True))
    assert tokenizer.decode(ids) == "<s>Q:12+34=\nA:46</s>\n"
    assert tokenizer.decode([t for t, label in zip(ids, labels) if label != -100]) == "46</s>"


def test_multiturn_trains_on_every_assistant_turn(tokenizer):
    conversation = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"},
                    {"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"}]
    ids, labels = sft.tokenize_sample({"input": conversation}, tokenizer, toy_args(
        max_len=64, apply_chat_template=True, multiturn=True))
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(conversation, tokenize=False)
    trained = "".join(tokenizer.decode([t]) if label != -100 else "|" for t, label in zip(ids.tolist(), labels.tolist()))
    assert [span for span in trained.split("|") if span] == ["2</s>", "4</s>"]


@torch.no_grad()
def test_reward_read_at_last_token_in_every_layout(reward_model, sequences, tokenizer):
    # reference: the stock HF classifier on each sequence alone (no padding: it reads the last token)
    expected = torch.stack([reward_model(input_ids=s[None]).logits[0, 0] for s in sequences])
    pad = tokenizer.pad_token_id
    right = rm.sequence_rewards(reward_model, *common.batch_sequences(sequences, pad, False))
    packed_ids, _, packed_pos = common.batch_sequences(sequences, pad, True)
    packed = rm.sequence_rewards(reward_model, packed_ids, None, packed_pos, [len(s) for s in sequences])
    T = max(LENGTHS)
    left_ids = torch.stack([torch.cat([torch.full((T - len(s),), pad), s]) for s in sequences])
    left_mask = (torch.arange(T)[None] >= torch.tensor([T - len(s) for s in sequences])[:, None]).long()
    left = rm.sequence_rewards(reward_model, left_ids, left_mask, (left_mask.cumsum(-1) - 1).clamp(min=0))
    for got in (right, packed, left):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    # the stock classifier on the right-padded batch finds the same tokens through the pad id
    ids, mask, _ = common.batch_sequences(sequences, pad, False)
    stock = reward_model(input_ids=ids, attention_mask=mask).logits[:, 0]
    torch.testing.assert_close(stock, expected, atol=1e-5, rtol=0)


def test_last_token_index_from_mask_and_lengths():
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 0, 0, 0]])
    assert rm.last_token_index(mask).tolist() == [2, 4, 4, 1]
    assert rm.last_token_index(seq_lens=[3, 1, 4]).tolist() == [2, 3, 7]


@torch.no_grad()
def test_truncated_response_still_ends_in_eos_and_is_scored_there(reward_model, tokenizer):
    args = toy_args(max_len=10)
    record = {"input": "12+34=", "chosen": "4" * 30, "rejected": "47"}
    long = rm.tokenize_response(record, "chosen", tokenizer, args)
    short = rm.tokenize_response(record, "rejected", tokenizer, args)
    assert len(long) == 10 and long[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(long) == "<s>12+34=44</s>"
    assert tokenizer.decode(short) == "<s>12+34=47</s>"
    chat = rm.tokenize_response(record, "rejected", tokenizer, toy_args(max_len=64, apply_chat_template=True))
    assert tokenizer.decode(chat) == "<s>Q:12+34=\nA:47</s>"
    seqs = [long, short, chat]
    for packed in (False, True):
        ids, mask, pos = common.batch_sequences(seqs, tokenizer.pad_token_id, packed)
        got = rm.sequence_rewards(reward_model, ids, mask, pos, [len(s) for s in seqs] if packed else None)
        expected = torch.stack([reward_model(input_ids=s[None]).logits[0, 0] for s in seqs])
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_pretrain_mode_trains_on_every_token(tokenizer):
    record = {"input": "12+34=", "output": "46"}
    ids, labels = sft.tokenize_sample(record, tokenizer, toy_args(max_len=32, pretrain_mode=True))
    assert tokenizer.decode(ids, skip_special_tokens=True) == "12+34=46"
    assert ids[-1] == tokenizer.eos_token_id
    assert torch.equal(ids, labels)  # the loss covers the prompt too
    plain, plain_labels = sft.tokenize_sample(record, tokenizer, toy_args(max_len=32))
    assert torch.equal(ids, plain) and (plain_labels == -100).sum() == len("12+34=") + 1  # bos + prompt masked
