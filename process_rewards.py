"""Process rewards: a step-by-step judge's scores as dense rewards in grpo.py and ppo.py (--process_rewards), and a
process reward model (prm.py's output) as a reward source at all (--reward_pretrain runs/prm). Imported only then.

The step contract. A completion's steps are the pieces of its text (completion_text: decoded, the special tokens'
text removed; prm.py and serve_rm.py hold the same function, so a judge must know the policy's special
tokens, as a PRM trained from the policy does) between occurrences of --step_separator (default a newline), empty or
blank pieces not counted; a completion in which the separator never occurs (or with no text at all) is one step. A
placeholder the policy wrote is text like any other here (a judge drops it before adding its own). A step ends at the
completion token whose text completes the separator after it (byte-level BPE may merge the separator with its
neighbours: the token that holds its last character), the last step at the completion's last token (its EOS, or the
token where --generate_max_len cut it). Steps that end in the same token (a step shorter than a token) count as one
there, with the last one's score.

A reward source gives one score per step next to the per-sample reward:
    {"rewards": [...], "step_rewards": [[score of step 1, step 2, ...], ...]}
from a reward_func file (your code) or a /get_reward server (serve_rm.py --rm_type prm sends them); or a local
prm.py model (--reward_pretrain) scores them: the completion gets the PRM's placeholder after each step, as prm.py's
data has it ("07+45=52 ки\\n52+08=60 ки"), and the step score is P(good) at each placeholder (step_probabilities,
prm.py's scorer; serve_rm.py has it too). Scores travel in the reward's named result as step_rewards ([N, R] each
step's score on the token that ends it) and step_ends ([N, R] bool).

What the scripts do with them: ppo.py puts each step's score on the token that ends it (Math-Shepherd), grpo.py
normalizes them per group (grpo.process_advantages, DeepSeekMath). The source's per-sample rewards are logged (and
drive --dynamic_filtering); an outcome reward to train on besides the steps comes from a second source: a rule or
server (--remote_rm_url) next to a local PRM (--reward_pretrain).
"""

import math

import torch
from transformers import AutoModelForCausalLM

import common
from common import fail


# The step contract's pieces: copies of prm.py's (tests compare them), so that the trainer, a local PRM judge, prm.py
# and serve_rm.py read the same steps.
REDUCE = {"min": min, "last": lambda s: s[-1], "mean": lambda s: sum(s) / len(s)}  # --prm_reduce: steps -> one reward


def steps_of(text, separator):
    """The steps of a solution's text: its pieces between separators, blank pieces not counted, at least one (the
    whole text). -> (the indices of the step pieces, the pieces)."""
    pieces = text.split(separator)
    steps = [i for i, p in enumerate(pieces) if p.strip()]
    return steps or [len(pieces) - 1], pieces


def completion_text(text, tokenizer):
    """What the step contract reads of a completion: its text decoded with the special tokens kept (as a /get_reward
    query carries it), every special token's text removed. A BOS or EOS the policy wrote inside a completion, its
    stop token and pads are no step: the trainer (step_ends), a local PRM judge and serve_rm.py all read the steps
    of this text, so they count the same steps."""
    specials = set(tokenizer.all_special_tokens) | {t.content for t in tokenizer.added_tokens_decoder.values()
                                                    if t.special}
    for token in sorted(specials, key=len, reverse=True):  # "<|im_end|>" before a shorter token inside it
        text = text.replace(token, "")
    return text


def with_placeholders(text, separator, placeholder):
    """A solution written as prm.py's data has it: the placeholder after every step ("07+45=52 ки\n..."). One the
    text holds already (a policy may write it) is dropped, as it would read as one more step end; the steps are
    still those of the text as written."""
    steps, pieces = steps_of(text, separator)
    pieces = [p.replace(placeholder, "") for p in pieces]
    for i in steps:
        pieces[i] = pieces[i].rstrip() + " " + placeholder
    return separator.join(pieces)


def step_ends(response, tokenizer, separator):
    """The index of the token ending each step of one completion (response: its token ids, [R]), by the contract
    above. The text of the first k tokens is a prefix of the whole text, so the separators it holds only grow with k:
    each separator's token is found by bisection, about log2(R) decodes a step."""
    decode = lambda k: completion_text(tokenizer.decode(response[:k]), tokenizer)  # noqa: E731
    steps, _ = steps_of(decode(len(response)), separator)
    ends, lo = [], 0
    for i in steps[:-1]:  # piece i ends at separator i + 1
        hi = len(response)
        while lo < hi:  # the fewest tokens whose text holds i + 1 separators
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if decode(mid).count(separator) < i + 1 else (lo, mid)
        ends.append(lo - 1)
    ends.append(len(response) - 1)  # the last step ends with the completion
    return ends


def step_tensors(scores, ends, shape):
    """Per-step scores (a list per sample) at their end tokens -> ([N, R] scores, [N, R] bool step ends)."""
    values, mask = torch.zeros(shape), torch.zeros(shape, dtype=torch.bool)
    for i, (s, e) in enumerate(zip(scores, ends)):
        values[i, e] = torch.tensor(s, dtype=torch.float32)  # a repeated end keeps the last score
        mask[i, e] = True
    return values, mask


def check_step_counts(step_lists, ends, source, separator):
    """One score per step found, or one line naming the first completion where the counts differ."""
    for i, (s, e) in enumerate(zip(step_lists, ends)):
        if len(s) != len(e):
            fail(f"{source}: step_rewards[{i}] has {len(s)} scores but completion {i} has {len(e)} steps "
                 f"(pieces between {separator!r} separators, special tokens' text removed: a judge must know the "
                 "policy's special tokens; see process_rewards.py)")


def check_step_lists(steps, n, source):
    """A reply's step_rewards (as the script's reward call kept them: None when the reply had none) -> n lists of
    finite floats, or one line saying what is wrong."""
    if steps is None:
        fail(f"{source}: --process_rewards needs step_rewards (one list of step scores per query) and the "
             "reply has none")
    if not isinstance(steps, (list, tuple)) or len(steps) != n:
        fail(f"{source}: step_rewards must be {n} lists of step scores, one per query")
    lists = []
    for i, s in enumerate(steps):
        try:
            lists.append(torch.tensor(s, dtype=torch.float32).flatten().tolist())
        except (TypeError, ValueError, RuntimeError):
            fail(f"{source}: step_rewards[{i}] is not a list of numbers: {str(s)[:80]!r}")
        if not all(map(math.isfinite, lists[-1])):
            fail(f"{source}: step_rewards[{i}] holds NaN or infinity")
    return lists


def check_saved(config, tokenizer, path):
    """A saved PRM as a judge: its config names the placeholder and the two reward tokens (prm.py writes them; a
    config with only their ids gets their text from the tokenizer), and its tokenizer still makes each of them one
    token; else one line saying what is wrong."""
    if getattr(config, "placeholder_token_id", None) is None:
        fail(f"{path} has no placeholder_token_id in its config: not a prm.py model")
    if len(config.reward_token_ids) != 2 or len(set(config.reward_token_ids)) != 2:
        fail(f"{path}: reward_token_ids {config.reward_token_ids} must be two distinct tokens (good, bad)")
    if getattr(config, "placeholder_token", None) is None:  # a config with the ids alone: the tokens' own text
        config.placeholder_token = tokenizer.decode([config.placeholder_token_id])
    if getattr(config, "reward_tokens", None) is None:
        config.reward_tokens = [tokenizer.decode([i]) for i in config.reward_token_ids]
    for token, want in [(config.placeholder_token, config.placeholder_token_id),
                        *zip(config.reward_tokens, config.reward_token_ids)]:
        ids = tokenizer(token, add_special_tokens=False)["input_ids"]
        if ids != [want] and tokenizer.convert_tokens_to_ids(token) != want:  # (sentencepiece: a lone "▁+")
            fail(f"{path}: {token!r} encodes to {ids} in its tokenizer, not to the one token {want} its config "
                 "names (a PRM reads its judgement at one token)")


def load_prm(args, cfg, offload):
    """The local PRM (frozen) and its tokenizer, with its placeholder and reward tokens checked one token each."""
    tokenizer = common.load_tokenizer(args.reward_pretrain, args)
    model = common.load_frozen(args.reward_pretrain, args, tokenizer, cfg, offload, model_class=AutoModelForCausalLM)
    check_saved(model.config, tokenizer, args.reward_pretrain)
    return model, tokenizer


def reward_fn(args, tokenizer, cfg, client, offload=False):
    """The reward with step scores: f(pairs, labels) -> {"rewards" [N], "scores" [N], "logs" {name: [N]}}, and with
    --process_rewards "step_rewards" [N, R] (each step's score on the token ending it) and "step_ends" [N, R] bool, R
    the longest response. pairs: (prompt ids, response ids) as sampled; `client`: the script's reward call on
    --remote_rm_url, f(pairs, labels) -> its named result (with the reply's raw "step_rewards"), or None. Sources: a
    local PRM (--reward_pretrain: per-sample reward the steps' --prm_reduce, min by default) with or without
    --remote_rm_url (then that is the outcome reward), or --remote_rm_url alone sending step_rewards."""
    judge = load_prm(args, cfg, offload) if args.reward_pretrain else None
    # (make_pairs.py has none of these flags: a PRM judges its samples by the min over newline-separated steps)
    process, warned = getattr(args, "process_rewards", False), []
    separator, reduce = getattr(args, "step_separator", "\n"), REDUCE[getattr(args, "prm_reduce", "min")]
    source = args.reward_pretrain or args.remote_rm_url

    def score(pairs, labels):
        ends = [step_ends(r, tokenizer, separator) for _, r in pairs]
        if judge:
            step_lists = prm_step_scores(*judge, pairs, tokenizer, separator, args.micro_rollout_batch_size, offload
                                         and args.zero_stage != 3)
            reduced = torch.tensor([reduce(s) for s in step_lists])
            out = {"rewards": reduced, "scores": reduced, "logs": {}}
            if client:  # the outcome reward beside the steps
                outcome = client(pairs, labels)
                out = {**outcome, "logs": {**outcome["logs"], "prm_reward": reduced}}
                out.pop("step_rewards", None)
        else:
            out = client(pairs, labels)
            step_lists = check_step_lists(out.pop("step_rewards", None), len(pairs), source)
        check_step_counts(step_lists, ends, source, separator)
        if process and not warned and all(len(e) == 1 for e in ends) and len(ends) > 1:
            warned.append(True)  # likely a separator the policy does not write (one warning a run)
            common.console.print(f"--process_rewards: no completion of this batch has a {separator!r} separator: "
                                 "each is one step (--step_separator)", markup=False)
        out["logs"] = {**out["logs"], "steps": torch.tensor([float(len(e)) for e in ends])}
        if process:
            width = max(len(r) for _, r in pairs)
            out["step_rewards"], out["step_ends"] = step_tensors(step_lists, ends, (len(pairs), width))
        return out
    return score


@torch.no_grad()
def step_probabilities(model, seqs, pad_id):
    """A saved PRM's judgement of token sequences (1-D tensors, one padded forward): for each, the probability of
    the first reward token (good) at every placeholder, as prm.py's prm_loss trained it. The same scorer as
    prm.py's (tests compare them)."""
    cfg, device = model.config, next(model.parameters()).device
    ids = torch.nn.utils.rnn.pad_sequence(list(seqs), batch_first=True, padding_value=pad_id).to(device)  # [B, T]
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(s) for s in seqs], batch_first=True).to(device)
    hidden, _ = common.forward_hidden(model, dict(input_ids=ids, attention_mask=mask))
    at = (ids == cfg.placeholder_token_id) & mask.bool()  # the judged positions: logits there only, not [B, T, V]
    probs = torch.softmax(common.output_layer(model)(hidden[at])[:, cfg.reward_token_ids].float(), -1)[:, 0]
    return [p.tolist() for p in probs.split(at.sum(-1).tolist())]


def prm_step_scores(model, prm_tokenizer, pairs, tokenizer, separator, chunk_size, offloaded):
    """The PRM's P(good) of every step: the prompt's tokens as sampled, then the completion's text with the
    placeholder after each step, tokenized by the PRM's tokenizer as prm.py tokenizes its data."""
    seqs = []
    for prompt, response in pairs:
        text = with_placeholders(completion_text(tokenizer.decode(response), tokenizer), separator,
                                 model.config.placeholder_token)
        ids = prm_tokenizer(text, add_special_tokens=False)["input_ids"]
        seqs.append(torch.cat([prompt, torch.tensor(ids, dtype=prompt.dtype)]))
    with common.on_accelerator(model, offloaded) as m:
        return [s for i in range(0, len(seqs), chunk_size)
                for s in step_probabilities(m, seqs[i:i + chunk_size], prm_tokenizer.pad_token_id)]
