"""Process rewards (--process_rewards, process_rewards.py): where steps end in a completion's tokens on byte-level,
sentencepiece and character vocabularies, DeepSeekMath's process advantages against a float64 loop, the step
contract's one-line errors, a local PRM's step scores, serve_rm.py's placeholders, and grpo.py / ppo.py training on
step scores end to end (the advantages and per-token rewards they were given, recomputed from the completions)."""
import math
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

import families
import grpo
import ppo
import prm
import process_rewards
import serve_rm
from conftest import run_main, run_script

F64 = dict(dtype=torch.float64)


# ------------------------------------------------------------------------------------------ step ends
TEXTS = [  # (completion text, separator)
    ("Step 1: 12+34=46\nStep 2: 46+5=51\nStep 3: done", "\n"),
    ("12+34=46\n\n46+5=51 \n\n51+0=51", "\n\n"),
    ("12+34=46\n\n\n46+5=51\n", "\n"),  # blank pieces are not steps; a trailing separator ends none
    ("12+34=46 ки 46+5=51 ки done", "ки"),  # a two-byte-per-letter separator on byte-level vocabularies
    ("the answer is 42", "\n"),  # no separator: one step, the whole completion
]


def expected_ends(text, separator, offsets):
    """The token holding the last character of the separator after each non-blank piece, from the tokenizer's own
    character offsets (an independent route: no decoding); the last step at the last token (the EOS after them)."""
    ends, at = [], 0
    for piece in text.split(separator):
        at += len(piece) + len(separator)
        if piece.strip():
            ends.append(next((k for k, (s, e) in enumerate(offsets) if s <= at - 1 < e), None))
    return ends[:-1] + [len(offsets)]


@pytest.mark.parametrize("family", ["qwen25_instruct", "llama3_instruct", "mistral", "gpt2"])
def test_step_ends_on_real_vocabularies(family):
    tok = families.build_tokenizer(family)
    merged = []
    for text, separator in TEXTS:
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        response = torch.tensor(enc["input_ids"] + [tok.eos_token_id])
        want = expected_ends(text, separator, enc["offset_mapping"])
        assert process_rewards.step_ends(response, tok, separator) == want, (family, text)
        merged += [tok.decode(response[e]) for e in want[:-1] if tok.decode(response[e]) != separator]
    assert merged  # the vocabulary merges a separator with its neighbours (" ки", "\nStep"): else this tests less


def test_step_ends_char_vocabulary_and_a_cut_completion(tokenizer):
    # the toy tokenizer: one token a character, so the ends are the newlines' positions
    response = torch.tensor(tokenizer("07+45=52\n52+08=60\n60+1", add_special_tokens=False)["input_ids"])
    assert process_rewards.step_ends(response, tokenizer, "\n") == [8, 17, len(response) - 1]  # cut: no EOS


# ------------------------------------------------------------------------------------ the advantages
def naive_process_advantages(step_scores, ends, lengths, group_size, eps=1e-6):
    """DeepSeekMath 4.1.3, one sample and one token at a time in float64."""
    out = []
    for g in range(0, len(step_scores), group_size):
        group = [s for scores in step_scores[g:g + group_size] for s in scores]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((s - mean) ** 2 for s in group) / max(len(group) - 1, 1))
        for i in range(g, g + group_size):
            norm = [(s - mean) / (std + eps) for s in step_scores[i]]
            out.append([sum(r for r, e in zip(norm, ends[i]) if e >= t) for t in range(lengths[i])])
    return out


def test_process_advantages_against_a_float64_loop():
    torch.manual_seed(0)
    # group 1: 3, 1 and 2 steps (the second cut by the length limit: its one step ends at its last token);
    # group 2: every step scores the same -> all advantages 0
    ends = [[2, 5, 7], [4], [1, 6], [3, 5], [0, 2, 4], [6]]
    lengths = [8, 5, 7, 6, 5, 7]
    scores = [torch.rand(len(e), **F64).tolist() for e in ends[:3]] + [[0.7] * len(e) for e in ends[3:]]
    T = max(lengths)
    values, mask = torch.zeros(6, T, **F64), torch.zeros(6, T, dtype=torch.bool)
    for i, (e, r) in enumerate(zip(ends, scores)):
        values[i, e], mask[i, e] = torch.tensor(r, **F64), True
    assert process_rewards.step_tensors(scores, ends, (6, T))[1].equal(mask)
    got = grpo.process_advantages(values, mask, 3)
    want = naive_process_advantages(scores, ends, lengths, 3)
    for i in range(6):
        assert got[i, :lengths[i]].tolist() == pytest.approx(want[i], abs=1e-9)
        assert (got[i, lengths[i]:] == 0).all()
    assert got[3:].abs().max() < 1e-9  # (a rounding error of the mean over eps)
    with pytest.raises(ValueError, match="groups of 4"):
        grpo.process_advantages(values, mask, 4)


def test_token_advantages_take_per_token_advantages():
    adv = torch.tensor([[1.0, 0.5, 0.5], [2.0, 2.0, 0.0]], **F64)
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.5, 9.0]], **F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    got = grpo.token_advantages(adv, kl, mask, 1.0)
    # row 1: a - (0.6, 0.5, 0.3); row 2: a - (1.0, 0.5, -), padding 0
    assert got.flatten().tolist() == pytest.approx([0.4, 0.0, 0.2, 1.0, 1.5, 0.0])


# ------------------------------------------------------------------------------------- the contract
def test_step_lists_errors_in_one_line():
    """A reply's step_rewards, as a script's reward call keeps them (raw), checked by the plug-in."""
    assert process_rewards.check_step_lists([[1, 0.5], [0]], 2, "src") == [[1.0, 0.5], [0.0]]
    kept = grpo.check_rewards({"rewards": [1.0, 0.0], "step_rewards": [[1, 0.5], [0]]}, 2, "src")
    assert kept["step_rewards"] == [[1, 0.5], [0]] and kept["rewards"].tolist() == [1.0, 0.0]
    for steps, message in [(None, "reply has none"), ([[1.0]], "must be 2 lists"),
                           ([[1.0], "x"], r"step_rewards\[1\] is not"), ([[1.0], [float("nan")]], "NaN")]:
        with pytest.raises(SystemExit, match=message):
            process_rewards.check_step_lists(steps, 2, "src")
    with pytest.raises(SystemExit, match=r"step_rewards\[1\] has 1 scores but completion 1 has 2 steps"):
        process_rewards.check_step_counts([[1.0], [1.0]], [[3], [2, 5]], "src", "\n")


def test_placeholders_as_prm_data_has_them():
    assert prm.with_placeholders("07+45=52\n52+08=60", "\n", "ки") == "07+45=52 ки\n52+08=60 ки"
    assert prm.with_placeholders("07+45=52 \n\n52+08=60\n", "\n", "ки") == "07+45=52 ки\n\n52+08=60 ки\n"
    assert prm.with_placeholders("no steps here", "\n\n", "ки") == "no steps here ки"
    # one the policy wrote is dropped (it would read as a step end), the steps kept
    assert prm.with_placeholders("1+2=3 ки\nки\n3+3=6", "\n", "ки") == "1+2=3 ки\n ки\n3+3=6 ки"


def fake_prm(toy_world, tmp_path):
    """The toy model saved as a prm.py output would be (placeholder "ки", reward tokens "+" "-"): random weights,
    a judge all the same."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(toy_world / "model")
    model = AutoModelForCausalLM.from_pretrained(toy_world / "model")
    model.config.update(dict(placeholder_token="ки", placeholder_token_id=tok.convert_tokens_to_ids("ки"),
                             reward_tokens=["+", "-"], reward_token_ids=tok.convert_tokens_to_ids(["+", "-"])))
    model.save_pretrained(tmp_path / "prm")
    tok.save_pretrained(tmp_path / "prm")
    return tmp_path / "prm", model, tok


def test_local_prm_scores_each_step_as_prm_py_would(toy_world, tmp_path):
    from conftest import script_args

    path, model, tok = fake_prm(toy_world, tmp_path)
    prompt = torch.tensor(tok("07+45+08\n")["input_ids"])  # <s> and the problem, as sampled
    response = torch.tensor(tok("07+45=52\n52+08=60</s>", add_special_tokens=False)["input_ids"])
    args = script_args(reward_pretrain=str(path), remote_rm_url=None, process_rewards=True, step_separator="\n",
                       prm_reduce="min", micro_rollout_batch_size=8)
    out = process_rewards.reward_fn(args, tok, None, None)([(prompt, response)], ["60"])
    rewards, logs = out["rewards"], out["logs"]
    # the text prm.py trains on, scored by the stock class one text at a time
    want = prm.score_steps(model.eval(), tok, "07+45+08\n07+45=52 ки\n52+08=60 ки")
    values, ends = out["step_rewards"], out["step_ends"]
    assert ends[0].nonzero().flatten().tolist() == [8, len(response) - 1]
    assert values[0, ends[0]].tolist() == pytest.approx(want, abs=1e-6)
    assert rewards.tolist() == pytest.approx([min(want)], abs=1e-6) and logs["steps"].tolist() == [2.0]


def test_step_rewards_over_http_from_serve_rm(toy_world, tmp_path):
    """serve_rm.py --rm_type prm as the step source (--remote_rm_url): the RL client sends the queries as it always
    does (prompt + completion, special tokens kept, no placeholders) and gets the same step scores as the local PRM;
    its plain reading (check_rewards, what OpenRLHF's client reads too) still works on the reply."""
    from test_serve_rm import Server
    from conftest import script_args

    path, model, tok = fake_prm(toy_world, tmp_path)
    completions = ["07+45=52\n52+08=60</s>", "10+20=31</s>",
                   # what a weak policy writes: a BOS inside, a placeholder of its own (alone on a line too), a
                   # separator right before EOS, a completion cut at the length limit (no EOS), nothing but EOS
                   "07+45=52\n<s></s>", "07+45=52 ки\n52+08=60</s>", "07+45=52\nки</s>", "07+45=52\n</s>",
                   "07+45=52\n52+0", "</s>"]
    steps = [2, 1, 1, 2, 2, 1, 2, 1]  # the contract's count, by hand
    prompts = [torch.tensor(tok(p)["input_ids"]) for p in ["07+45+08\n", "10+20\n"] + ["07+45+08\n"] * 6]
    responses = [torch.tensor(tok(r, add_special_tokens=False)["input_ids"]) for r in completions]
    assert [(r == tok.bos_token_id).sum().item() for r in responses[2:4]] == [1, 0]  # "<s>" is the BOS token
    pairs, labels = list(zip(prompts, responses)), [None] * len(prompts)
    local = script_args(reward_pretrain=str(path), remote_rm_url=None, process_rewards=True, step_separator="\n",
                        prm_reduce="min", micro_rollout_batch_size=8)
    want = process_rewards.reward_fn(local, tok, None, None)(pairs, labels)["step_rewards"]
    server = Server("--reward_pretrain", path, "--rm_type", "prm")
    try:
        url = server.url + "/get_reward"
        remote = script_args(**dict(vars(local), reward_pretrain=None, remote_rm_url=url))
        # grpo.py's reward call, one request a query (joined after), as the script hands it to the plug-in
        client = grpo.reward_client(url, batch_size=1, timeout=60.0, retries=0, retry_wait=0.0)
        out = process_rewards.reward_fn(remote, tok, None, lambda p, l: grpo.client_rewards(client, p, l, tok))(
            pairs, labels)
        plain = grpo.client_rewards(grpo.reward_client(url), pairs, labels, tok)
    finally:
        server.close()
    # where each step ends, by hand (one token a character here; "ки", "<s>", "</s>" one token each)
    ends = [[8, 17], [8], [10], [10, 19], [8, 10], [9], [8, 12], [0]]
    assert [row.nonzero().flatten().tolist() for row in out["step_ends"]] == ends
    assert [len(e) for e in ends] == steps
    assert out["step_rewards"].flatten().tolist() == pytest.approx(want.flatten().tolist(), abs=1e-5)
    assert out["logs"]["steps"].tolist() == steps
    assert out["rewards"].tolist() == pytest.approx([min(want[i][out["step_ends"][i]]).item() for i in range(8)],
                                                    abs=1e-5)
    assert plain["rewards"].tolist() == pytest.approx(out["rewards"].tolist(), abs=1e-6)


def test_bad_judges_and_sources_stop_in_one_line(toy_world, tmp_path, tokenizer):
    from conftest import script_args

    path, model, tok = fake_prm(toy_world, tmp_path)
    prm.check_saved(model.config, tok, path)  # a good one passes
    good_ids = model.config.reward_token_ids
    model.config.reward_token_ids = [good_ids[0]] * 2
    with pytest.raises(SystemExit, match="two distinct tokens"):
        prm.check_saved(model.config, tok, path)
    model.config.reward_token_ids = good_ids
    model.config.update(dict(placeholder_token="step", placeholder_token_id=5))
    with pytest.raises(SystemExit, match=r"'step' encodes to \[\d+, \d+, \d+, \d+\] in its tokenizer, not to the one "
                                         "token 5"):
        prm.check_saved(model.config, tok, path)
    with pytest.raises(SystemExit, match="not a prm.py model"):
        prm.check_saved(AutoModelForCausalLM.from_pretrained(toy_world / "model").config, tok, "m")
    rl = dict(remote_rm_url=None, agent_func_path=None, agent_server=None, process_rewards=True)
    with pytest.raises(SystemExit, match="is not a prm.py model"):  # a sequence classifier has no steps
        grpo.check_one_reward(script_args(**rl, reward_pretrain=str(toy_world / "model")))
    with pytest.raises(SystemExit, match="scored by the agent"):
        grpo.check_one_reward(script_args(**dict(rl, agent_func_path="toy_agent.py"), reward_pretrain=None))
    grpo.check_one_reward(script_args(**dict(rl, remote_rm_url="toy.py"), reward_pretrain=str(path)))  # both: ok
    with pytest.raises(SystemExit, match="exactly one reward"):  # ... but not without --process_rewards
        grpo.check_one_reward(script_args(**dict(rl, remote_rm_url="toy.py", process_rewards=False),
                                          reward_pretrain=str(path)))


def test_serve_rm_inserts_placeholders_into_completions(tokenizer):
    q, p = "<s>07+45+08\n07+45=52\n52+08=60</s>", "<s>07+45+08\n"
    assert serve_rm.prm_query(q, p, tokenizer, "ки", "\n") == p + "07+45=52 ки\n52+08=60 ки"
    assert serve_rm.prm_query("a ки\nb ки", None, tokenizer, "ки", "\n") == "a ки\nb ки"  # prm.py's form, as sent
    # a trainer's query: special tokens inside the completion are no step, a placeholder the policy wrote is dropped
    assert serve_rm.prm_query(p + "07+45=52\n<s></s><pad>", p, tokenizer, "ки", "\n") == p + "07+45=52 ки\n"
    assert serve_rm.prm_query(p + "1 ки\n2</s>", p, tokenizer, "ки", "\n") == p + "1 ки\n2 ки"


# --------------------------------------------------------------------------------- end to end, in RL
STEP_REWARD = '''
import re


def reward_func(queries, prompts, labels):
    """A step is right (1) when its line is a+b=c with c the sum, else 0; the outcome: all steps right."""
    steps = []
    for q, p in zip(queries, prompts):
        text = re.sub("<s>|</s>|<pad>", "", q[len(p):])
        pieces = [x for x in text.split("\\n") if x.strip()] or [text]
        steps.append([float(bool(m) and int(m[1]) + int(m[2]) == int(m[3]))
                      for m in (re.fullmatch(r"\\s*(\\d+)\\+(\\d+)=(\\d+)\\s*", x) for x in pieces)])
    return {"rewards": [min(s) for s in steps], "step_rewards": steps}
'''


def rule_steps(text):
    """The test's own reading of a completion (toy: one token a character): each step's end token and score."""
    ends, scores, at = [], [], 0
    lines = text.split("\n")
    for i, line in enumerate(lines):
        at += len(line) + (i < len(lines) - 1)
        if line.strip():
            m = re.fullmatch(r"\s*(\d+)\+(\d+)=(\d+)\s*", line)
            ends.append(at - 1)
            scores.append(float(bool(m) and int(m[1]) + int(m[2]) == int(m[3])))
    return ends or [0], scores or [0.0]


@pytest.fixture(scope="module")
def steps_policy(toy_world, tmp_path_factory):
    """A policy that writes running sums step by step, some steps wrong (a short SFT on the steps data)."""
    out = tmp_path_factory.mktemp("steps") / "sft_steps"
    run_script("sft.py", "--dataset", toy_world / "steps_train.jsonl", "--max_epochs", 1, "--learning_rate", "1e-3",
               "--train_batch_size", 64, "--micro_train_batch_size", 64, "--max_len", 64, "--eval_generate_samples", 0,
               "--save_path", out)
    return out


class Seen:
    """Wraps a script's score (the rollouts it scores) and one function of its step 2 (what it was given)."""

    def __init__(self, monkeypatch, module, name):
        self.batches, self.given = [], []
        score, fn = module.score, getattr(module, name)
        monkeypatch.setattr(module, "score", lambda batch, *a: self.batches.append(batch) or score(batch, *a))
        monkeypatch.setattr(module, name, lambda x, *a, **kw: self.given.append(x.clone()) or fn(x, *a, **kw))

    def steps(self, tokenizer):
        """The test's own reading of the rollout: per sample its step ends (the last at the last token), the rule's
        step scores, the length, and the text of each step."""
        out = []
        for response, length in zip(self.batches[0].responses, self.batches[0].lengths.tolist()):
            # toy: a token is a character, or a special token (no text; sampled mid-completion at temperature 1)
            chars = [tokenizer.decode(t, skip_special_tokens=True) for t in response[:length]]
            token_of = [k for k, c in enumerate(chars) for _ in c]  # the token of each character
            ends, scores = rule_steps("".join(chars))
            out.append(([token_of[e] for e in ends[:-1]] + [length - 1], scores, length, "".join(chars)))
        return out


RL = ["--dataset", "steps_prompts_train.jsonl", "--label_key", "label", "--process_rewards", "--max_samples", 8,
      "--rollout_batch_size", 8, "--n_samples_per_prompt", 4, "--train_batch_size", 32, "--micro_train_batch_size",
      32, "--micro_rollout_batch_size", 32, "--generate_max_len", 40, "--prompt_max_len", 32, "--temperature", 1.0]


def rl_flags(toy_world):
    return [toy_world / f if f == "steps_prompts_train.jsonl" else f for f in RL]


def test_grpo_trains_on_deepseekmath_process_advantages(steps_policy, toy_world, tmp_path, monkeypatch, tokenizer):
    reward = tmp_path / "steps_reward.py"
    reward.write_text(STEP_REWARD)
    seen = Seen(monkeypatch, grpo, "token_advantages")
    run_main("grpo.py", "--pretrain", steps_policy, *rl_flags(toy_world), "--remote_rm_url", reward,
             "--save_path", tmp_path / "out")
    steps = seen.steps(tokenizer)
    assert sum(len(e) > 1 for e, *_ in steps) >= 8  # multi-step completions ...
    assert 0 < sum(s for _, scores, *_ in steps for s in scores) < sum(len(scores) for _, scores, *_ in steps)
    want = naive_process_advantages([s for _, s, *_ in steps], [e for e, *_ in steps], [n for *_, n, _ in steps], 4)
    (got,) = seen.given
    for i, w in enumerate(want):
        assert got[i, :len(w)].tolist() == pytest.approx(w, abs=1e-5), steps[i][3]


def test_ppo_puts_each_step_score_on_its_last_token(steps_policy, toy_world, tmp_path, monkeypatch, tokenizer):
    """A local PRM judges the steps (its P(good) at each placeholder, recomputed with prm.score_steps on the text
    prm.py would train on), the toy rule gives the outcome at the last token; no KL: those are all the rewards."""
    judge, model, _ = fake_prm(toy_world, tmp_path)
    seen = Seen(monkeypatch, ppo, "compute_gae")
    run_main("ppo.py", "--pretrain", steps_policy, *rl_flags(toy_world), "--reward_pretrain", judge,
             "--remote_rm_url", grpo.TOY_REWARD, "--init_kl_coef", 0, "--critic_pretrain", steps_policy,
             "--save_path", tmp_path / "out")
    (rewards,) = seen.given
    model.eval()
    for i, (ends, _, length, text) in enumerate(seen.steps(tokenizer)):
        record = seen.batches[0].records[i]
        judged = prm.score_steps(model, tokenizer, record["text"] + prm.with_placeholders(text, "\n", "ки"))
        answer = text.strip().rsplit("=", 1)[-1]
        want = torch.zeros(length, **F64)
        want[ends] = torch.tensor(judged, **F64)
        want[length - 1] += float(answer == record["label"])
        assert rewards[i, :length].tolist() == pytest.approx(want.tolist(), abs=1e-5), text
