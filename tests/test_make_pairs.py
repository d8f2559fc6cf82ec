"""make_pairs.py: preference pairs from a policy's own samples. The choice of best and worst within a prompt's
samples; end to end on the toy policy, judged by the toy rule (every chosen answer is the sum, every rejected one is
not, both are answers the policy gives) and by a reward model (each score is the stock classifier's on the text)."""
import json

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

import make_pairs
from conftest import ROOT, run_main, run_script


def test_best_and_worst():
    assert make_pairs.best_and_worst([0.0, 1.0, 0.5, 1.0], list("abcd"), [True] * 4) == (1, 0)  # first of equals
    assert make_pairs.best_and_worst([1.0, 1.0], list("ab"), [True, True]) is None  # nothing to prefer
    assert make_pairs.best_and_worst([0.0, 1.0], list("aa"), [True, True]) is None  # the same text
    assert make_pairs.best_and_worst([0.0, 1.0, 2.0], list("abc"), [True, True, False]) == (1, 0)  # c did not stop
    assert make_pairs.best_and_worst([0.0, 1.0], list("ab"), [False, True]) is None


def test_all_pairs():
    scores, texts = [1.0, 0.0, 0.0, 1.0, 0.5, 0.0], ["a", "b", "c", "a", "d", "b"]
    assert make_pairs.all_pairs(scores, texts, [True] * 6) == [(0, 1), (0, 2), (0, 4), (4, 1), (4, 2)]  # a, d > b, c
    assert make_pairs.all_pairs(scores, texts, [False] + [True] * 5) == [(3, 1), (4, 1), (3, 2), (4, 2), (3, 4)]
    assert make_pairs.all_pairs([1.0, 1.0, 0.0], ["a", "b", "c"], [True, True, False]) == []  # equal scores
    assert make_pairs.all_pairs([1.0, 0.0], ["a", "a"], [True, True]) == []  # one text


@pytest.mark.parametrize("engine,every", [("hf", False), ("vllm", False), ("hf", True)])
def test_rule_judged_pairs_are_right_against_wrong(policy, toy_world, tmp_path, engine, every):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(open(toy_world / "prompts_train.jsonl").readlines()[:64]))
    out = tmp_path / "pairs.jsonl"
    proc = run_script("make_pairs.py", "--pretrain", policy, "--dataset", prompts, "--label_key", "label",
                      "--remote_rm_url", ROOT / "toy.py", "--n_samples_per_prompt", 8, "--generate_max_len", 6,
                      "--prompt_max_len", 16, "--temperature", 1.2, "--save_path", out,
                      *(["--vllm"] if engine == "vllm" else []), *(["--pairs", "all"] if every else []))
    pairs = [json.loads(line) for line in open(out)]
    labels = {r["input"]: r["label"] for r in map(json.loads, open(prompts))}
    assert 5 <= len(pairs) <= (64 * 7 if every else 64) and f"wrote {len(pairs)} pairs" in proc.stderr
    inputs = [p["input"] for p in pairs]
    if every:  # the right sum against each distinct wrong answer: more pairs than prompts, none twice
        assert len(set(inputs)) < len(pairs) and len({(p["input"], p["rejected"]) for p in pairs}) == len(pairs)
    else:
        assert len(set(inputs)) == len(pairs)
    for p in pairs:
        a, b = p["input"][:2], p["input"][3:5]
        assert p["chosen"].strip() == str(int(a) + int(b)) == labels[p["input"]]  # the judge's verdict, checked
        assert p["rejected"].strip() != labels[p["input"]]
        assert (p["chosen_score"], p["rejected_score"]) == (1.0, 0.0)


def test_an_unreachable_judge_stops_after_the_retries_it_was_given(policy, toy_world, tmp_path):
    """--remote_rm_timeout/--remote_rm_retries/--remote_rm_retry_wait as in the RL scripts: a closed port is tried
    twice, then the run stops in one line naming the flags' values."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(open(toy_world / "prompts_train.jsonl").readlines()[:4]))
    proc = run_main("make_pairs.py", "--pretrain", policy, "--dataset", prompts, "--remote_rm_url",
                    "http://127.0.0.1:9/get_reward", "--remote_rm_timeout", 5, "--remote_rm_retries", 1,
                    "--remote_rm_retry_wait", 0.5, "--generate_max_len", 4, "--save_path", tmp_path / "pairs.jsonl",
                    check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith("error: reward server http://127.0.0.1:9/get_reward failed 2 times in ")
    assert "(--remote_rm_retries 1, --remote_rm_retry_wait 0.5); last error: " in errors[0]
    assert not (tmp_path / "pairs.jsonl").exists()


@torch.no_grad()
def test_reward_model_scores_are_the_stock_classifier_s(policy, toy_world, tmp_path):
    rm_dir = tmp_path / "rm"
    model = AutoModelForSequenceClassification.from_pretrained(toy_world / "model", num_labels=1)
    torch.manual_seed(0)
    torch.nn.init.normal_(model.score.weight, std=1.0)  # scores of order 1, distinct
    model.save_pretrained(rm_dir)
    AutoTokenizer.from_pretrained(policy).save_pretrained(rm_dir)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(open(toy_world / "prompts_train.jsonl").readlines()[:16]))
    out = tmp_path / "pairs.jsonl"
    run_main("make_pairs.py", "--pretrain", policy, "--dataset", prompts, "--reward_pretrain", rm_dir,
             "--generate_max_len", 6, "--save_path", out)
    pairs = [json.loads(line) for line in open(out)]
    assert len(pairs) >= 8
    tok = AutoTokenizer.from_pretrained(policy)
    rm = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    for p in pairs:
        assert p["chosen_score"] > p["rejected_score"]
        for key in ("chosen", "rejected"):  # the text as rm.py trains on it: prompt + completion + EOS
            ids = tok(p["input"] + p[key] + tok.eos_token, return_tensors="pt")["input_ids"]
            assert rm(ids).logits[0, 0].item() == pytest.approx(p[f"{key}_score"], abs=1e-4)
