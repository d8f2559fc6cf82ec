"""PRM data: every label sits on its step's placeholder token (one token, even when the tokenizer had
to learn it), in padded and packed batches; truncation keeps whole steps; packed and padded batches
give the same loss."""
import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

import common
import prm
from conftest import script_args

REWARD = ["+", "-"]


def prm_args(**kw):
    return script_args(**{"label_key": "label", "placeholder_token": "ки", "max_len": 64, **kw})


def sample(placeholder, labels, lengths=(3, 6, 2)):
    """Steps of different lengths, each followed by the placeholder."""
    steps = [f"{i}" * n for i, n in enumerate(lengths, start=1)]
    return {"input": "Q: 1+1\n" + "\n".join(f"{s} {placeholder}" for s in steps[:len(labels)]), "label": labels}


@pytest.mark.parametrize("placeholder", ["ки", "<step>"])  # one token already / six characters, added
def test_labels_sit_exactly_on_the_placeholders(tokenizer, placeholder):
    tok = copy.deepcopy(tokenizer)
    placeholder_id, reward_ids = prm.setup_tokens(tok, placeholder, REWARD)
    assert tok(f"a {placeholder}b", add_special_tokens=False)["input_ids"][2] == placeholder_id
    args = prm_args(placeholder_token=placeholder)
    record = sample(placeholder, ["+", "+", "-"])
    ids, labels, truncated = prm.tokenize_sample(record, "x", tok, placeholder_id, REWARD, reward_ids, args)
    assert not truncated
    # independently of token ids: the text up to each labelled position ends with the k-th placeholder
    text = record["input"]
    ends = [i + len(placeholder) for i in range(len(text)) if text.startswith(placeholder, i)]
    labelled = (labels != -100).nonzero().flatten().tolist()
    assert [len(tok.decode(ids[:p + 1], skip_special_tokens=True)) for p in labelled] == ends
    assert labels[labelled].tolist() == [reward_ids[0], reward_ids[0], reward_ids[1]]


def test_soft_labels_and_packing_keep_labels_on_placeholders(tokenizer):
    placeholder_id, reward_ids = prm.setup_tokens(tokenizer, "ки", REWARD)
    args = prm_args()
    records = [sample("ки", [0.875, 0.25, 0.0]), sample("ки", [1.0], (5,)), sample("ки", [0.5, 0.75], (1, 9))]
    data = [prm.tokenize_sample(r, "x", tokenizer, placeholder_id, REWARD, reward_ids, args) for r in records]
    for packing in (False, True):
        ids, _, _ = common.batch_sequences([d[0] for d in data], tokenizer.pad_token_id, packing)
        labels, _, _ = common.batch_sequences([d[1] for d in data], -100, packing)
        assert labels.dtype == torch.float32
        assert torch.equal(labels != -100, ids == placeholder_id)
        assert labels[ids == placeholder_id].tolist() == [x for r in records for x in r["label"]]


def test_truncation_keeps_whole_steps_or_drops_the_sample(tokenizer):
    placeholder_id, reward_ids = prm.setup_tokens(tokenizer, "ки", REWARD)
    record = sample("ки", ["+", "-", "-"], (3, 6, 2))
    full, _, _ = prm.tokenize_sample(record, "x", tokenizer, placeholder_id, REWARD, reward_ids, prm_args())
    second = (full == placeholder_id).nonzero().flatten()[1].item()
    for max_len in (second + 1, len(full) - 1):  # the second placeholder fits exactly / the third is cut
        ids, labels, truncated = prm.tokenize_sample(record, "x", tokenizer, placeholder_id, REWARD, reward_ids,
                                                     prm_args(max_len=max_len))
        assert truncated and len(ids) == second + 1 and torch.equal(ids, full[:second + 1])
        assert labels[ids == placeholder_id].tolist() == [reward_ids[0], reward_ids[1]]
    first = (full == placeholder_id).nonzero().flatten()[0].item()
    assert prm.tokenize_sample(record, "x", tokenizer, placeholder_id, REWARD, reward_ids,
                               prm_args(max_len=first)) is None


@torch.no_grad()
def test_loss_packed_equals_padded(toy_world, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(toy_world / "model").eval()
    placeholder_id, reward_ids = prm.setup_tokens(tokenizer, "ки", REWARD)
    records = [sample("ки", ["+", "-", "-"]), sample("ки", ["-"], (4,)), sample("ки", ["+", "+"], (7, 1))]
    data = [prm.tokenize_sample(r, "x", tokenizer, placeholder_id, REWARD, reward_ids, prm_args()) for r in records]
    losses = []
    for packing in (False, True):
        ids, mask, pos = common.batch_sequences([d[0] for d in data], tokenizer.pad_token_id, packing)
        labels, _, _ = common.batch_sequences([d[1] for d in data], -100, packing)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
        losses.append(prm.prm_loss(logits, ids, labels, placeholder_id, reward_ids))
    assert abs(losses[0][0].item() - losses[1][0].item()) < 1e-5 and losses[0][1].item() == losses[1][1].item()
