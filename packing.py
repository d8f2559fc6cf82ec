"""--packing_samples without flash-attn: a micro-batch as one row, sequences concatenated with position_ids restarting
at 0 (pack_groups lays a group's prompt out once, its responses branching off it), and the attention that keeps them
apart (packed_sdpa: torch's varlen flash kernel on a CUDA GPU, one sdpa call per piece elsewhere). common.load_model
registers it and common.response_inputs packs with it only when the flag is given; importing this module only defines
things."""

import functools
import inspect
import itertools

import torch
import transformers
from torch.nn.attention.bias import causal_lower_right
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask


def packed_inputs(model, batch, share_prompts, device):
    """common.response_inputs with --packing_samples: one packed row (pack_groups). Shared prompts need packed_sdpa;
    flash-attn's varlen kernel knows whole sequences only."""
    attention = getattr(model, "module", model).config._attn_implementation
    ids, pos, cols = pack_groups(batch, share_prompts=share_prompts and attention == "packed_sdpa")
    inputs = dict(input_ids=ids.to(device), position_ids=pos.to(device), use_cache=False)
    return inputs, (torch.zeros(len(cols), dtype=torch.long, device=device), cols.to(device))


def pack_groups(batch, share_prompts):
    """(prompt, response) pairs -> one packed row (ids, position_ids) and the row positions whose outputs
    predict the response tokens, all pairs in order. With share_prompts, pairs with the same prompt (a group)
    are laid out together with one copy of it: the first response follows the prompt, every other one
    restarts its positions at len(prompt), which packed_sdpa reads as "attends to the prompt, then causally
    to itself". Same logits as packing every pair whole; the prompt's FLOPs are spent once per group."""
    groups = {}  # prompt -> the pairs that have it, in order of first appearance
    for i, (p, _) in enumerate(batch):
        groups.setdefault(tuple(p.tolist()) if share_prompts else i, []).append(i)
    ids, pos, cols, length = [], [], [None] * len(batch), 0
    for members in groups.values():
        prompt = batch[members[0]][0]
        ids.append(prompt)
        pos.append(torch.arange(len(prompt)))
        length += len(prompt)
        prompt_end = length - 1  # the prompt's last token predicts each response's first
        for i in members:
            r = batch[i][1]
            ids.append(r)
            pos.append(torch.arange(len(prompt), len(prompt) + len(r)))
            follows = torch.arange(length, length + max(len(r) - 1, 0))  # each token predicts the next
            cols[i] = torch.cat([torch.tensor([prompt_end]), follows])[:len(r)]
            length += len(r)
    return torch.cat(ids)[None], torch.cat(pos)[None], torch.cat(cols)


_pieces = [None, None]  # the last position_ids packed_sdpa saw, and its pieces (and varlen plan, once asked for)


def packed_pieces(position_ids):
    """A packed row's pieces: where each starts, its first position, its length, and which piece it branches off
    (its own index for a sequence). Every layer of a forward gets the same position_ids tensor: computed once per
    forward, not once per layer (each is a host sync)."""
    if _pieces[0] is not position_ids:
        pos = position_ids[0]
        cuts = torch.cat([pos.new_zeros(1), (pos[1:] != pos[:-1] + 1).nonzero().flatten() + 1])
        cuts, starts = torch.stack([cuts, pos[cuts]]).tolist()
        lengths, bases = [e - s for s, e in zip(cuts, cuts[1:] + [len(pos)])], []
        for i, (cut, p) in enumerate(zip(cuts, starts)):
            base = i if p == 0 else bases[-1] if bases else None
            if base is None:
                raise ValueError(f"packed row: positions start at {p} at token {cut}, with no sequence before it")
            if p > lengths[base]:
                raise ValueError(f"packed row: positions jump to {p} at token {cut}, but the sequence before it "
                                 f"starts with {lengths[base]} unbranched tokens")
            bases.append(base)
        _pieces[:] = position_ids, {"cuts": cuts, "starts": starts, "lengths": lengths, "bases": bases}
    return _pieces[1]


def varlen_plan(position_ids):
    """torch's varlen kernel's view of a packed row: cumulative query and key lengths, the longest of each, and
    the key rows to gather (None when no piece branches): a branch's keys are its sequence's first p tokens, then
    its own. Once per forward, as packed_pieces."""
    pieces = packed_pieces(position_ids)
    if "plan" not in pieces:
        cuts, starts, lengths, bases = (pieces[k] for k in ("cuts", "starts", "lengths", "bases"))
        keys = [p + n for p, n in zip(starts, lengths)]
        gather = None
        if any(starts):
            gather = torch.tensor([j for c, p, n, b in zip(cuts, starts, lengths, bases)
                                   for j in (*range(cuts[b], cuts[b] + p), *range(c, c + n))],
                                  device=position_ids.device)
        cu = [torch.tensor([0, *itertools.accumulate(x)], dtype=torch.int32, device=position_ids.device)
              for x in (lengths, keys)]
        pieces["plan"] = (cu[0], cu[1], max(lengths), max(keys), gather)
    return pieces["plan"]


def varlen_kernel(query, value, dropout, kwargs):
    """torch's own FlashAttention-2 varlen kernel (torch.nn.attention.varlen, in the CUDA wheel: nothing to install)
    where it applies: CUDA (not ROCm: untried there) with compute capability >= 8.0, bf16/fp16, one head_dim for
    queries and keys (values may be narrower: DeepSeek's MLA), a multiple of 8 up to 256, no dropout, softcap or
    attention sinks, a torch that takes window_size (2.11+). Else None, and packed_sdpa loops over the pieces."""
    if query.is_cuda and torch.version.hip is None and query.dtype in (torch.bfloat16, torch.float16) \
            and value.size(-1) <= query.size(-1) <= 256 and query.size(-1) % 8 == 0 and not dropout \
            and kwargs.get("softcap") is None and kwargs.get("s_aux") is None:
        return torch_varlen(query.device.index)
    return None


@functools.cache
def torch_varlen(device_index):
    return varlen_attn() if torch.cuda.get_device_capability(device_index)[0] >= 8 else None


def varlen_attn():
    """This torch's varlen_attn, if it takes window_size (2.11+; 2.10's had is_causal, older torch none)."""
    try:
        from torch.nn.attention.varlen import varlen_attn as kernel
    except ImportError:
        return None
    return kernel if "window_size" in inspect.signature(kernel).parameters else None


def packed_varlen(kernel, query, key, value, position_ids, scaling, window):
    """A packed row's attention in one call of a kernel with flash's varlen contract: [T, H, D] inputs, causal
    aligned to the bottom right, window (left, right) keys around the diagonal. GQA through enable_gqa (torch 2.12+),
    else by repeating the key/value heads. -> [1, T, H, D]."""
    cu_q, cu_k, max_q, max_k, gather = varlen_plan(position_ids)
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))  # [1, H, T, D] -> [T, H, D]
    width = v.size(-1)  # the kernel takes one head_dim: narrower values (MLA) get zero columns, their outputs cut off
    if width < q.size(-1):
        v = torch.nn.functional.pad(v, (0, q.size(-1) - width))
    if gather is not None:
        k, v = k[gather], v[gather]
    extra = {}
    if k.size(1) != q.size(1):
        if takes_gqa(kernel):
            extra["enable_gqa"] = True
        else:
            k, v = (x.repeat_interleave(q.size(1) // x.size(1), 1) for x in (k, v))
    # transformers' sliding_window W: a query sees itself and the W - 1 keys before it
    out = kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale=scaling,
                 window_size=(-1, 0) if window is None else (window - 1, 0), **extra)
    return out[None, ..., :width]


@functools.cache
def takes_gqa(kernel):
    return "enable_gqa" in inspect.signature(kernel).parameters


def packed_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, position_ids=None, **kwargs):
    """Attention for --packing_samples without flash-attn. On a GPU, one call per layer of torch's own varlen
    flash kernel (varlen_kernel); elsewhere one sdpa call per piece of a packed row. Plain sdpa would attend over
    the whole row through a block-diagonal mask, spending most of its FLOPs on pairs of tokens from different
    sequences.
    - A sequence starts where position_ids restart at 0 and attends causally within itself.
    - A branch starts where they jump back to some p > 0: it continues the first p tokens of its sequence
      instead of the tokens just before it, so it attends to those p and causally to itself. grpo.py packs a
      group this way: the prompt once, each further response branching off it.
    - With a sliding window (Mistral, Gemma's local layers) a query sees only the last `window` keys.
    Anything that is not a packed row (padded batches, generation) goes to sdpa."""
    if position_ids is None and attention_mask is None and query.size(0) == 1 and query.size(2) == key.size(2):
        position_ids = torch.arange(query.size(2), device=query.device)[None]  # one sequence: a packed row of one
    if position_ids is None or query.size(0) != 1 or query.size(2) != key.size(2):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    window = kwargs.get("sliding_window")
    pieces = packed_pieces(position_ids)  # checks the row
    kernel = varlen_kernel(query, value, dropout, kwargs)
    if kernel is not None:
        return packed_varlen(kernel, query, key, value, position_ids, scaling, window), None

    def causal(q_len, k_len):
        """Query i sees keys up to k_len - q_len + i: causal, aligned to the bottom right (flash kernels on
        GPU, GQA too); with the window only the last `window` of them (transformers' sliding_window_overlay)."""
        if window is None or k_len <= window:
            return causal_lower_right(q_len, k_len)
        i = torch.arange(k_len - q_len, k_len, device=query.device)[:, None]
        j = torch.arange(k_len, device=query.device)[None]
        return (j <= i) & (j > i - window)

    sdpa = functools.partial(torch.nn.functional.scaled_dot_product_attention, dropout_p=dropout, scale=scaling,
                             enable_gqa=key.size(1) != query.size(1))
    lengths = pieces["lengths"]
    # split, not slices: a slice's backward writes a zero tensor the size of the whole row, once per piece
    keys, values, outs = key.split(lengths, 2), value.split(lengths, 2), []
    for p, base, q, k, v in zip(pieces["starts"], pieces["bases"], query.split(lengths, 2), keys, values):
        if p == 0:
            outs.append(sdpa(q, k, v, is_causal=True) if window is None or q.size(2) <= window else
                        sdpa(q, k, v, attn_mask=causal(q.size(2), q.size(2))))
            continue
        prefix_k, prefix_v = (x[base] if p == x[base].size(2) else x[base][:, :, :p] for x in (keys, values))
        outs.append(sdpa(q, torch.cat([prefix_k, k], 2), torch.cat([prefix_v, v], 2),
                         attn_mask=causal(q.size(2), p + q.size(2))))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def packed_sdpa_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, attention_mask=None, **kwargs):
    """The mask packed_sdpa is given. A causal row without padding or cache (a packed row, or one sequence)
    gets none: packed_sdpa reads the pieces from position_ids, and plain sdpa is causal without a mask.
    Building transformers' block-diagonal [1, 1, T, T] mask for it would cost T^2 (1 GiB at 32k tokens, kept
    alive by gradient checkpointing) for nothing. Anything else gets sdpa's mask."""
    if batch_size == 1 and attention_mask is None and q_length == kv_length and q_offset == kv_offset == 0:
        return None
    return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask=attention_mask, **kwargs)


def register_packed_sdpa():
    """Make attn_implementation="packed_sdpa" loadable (load_model does it for --packing_samples) -> its name."""
    transformers.AttentionInterface.register("packed_sdpa", packed_sdpa)
    AttentionMaskInterface.register("packed_sdpa", packed_sdpa_mask)
    return "packed_sdpa"
