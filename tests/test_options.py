"""The options users expect from every script (OpenRLHF's names), each against an independent reference:
LoRA (trainable share from the closed form, merged model = adapter model, a LoRA reward model merged and
loaded by the stock classifier), dataset mixing proportions, learning-rate schedules against their closed
forms (read back from the TensorBoard event file), wandb offline, the MoE router loss against Hugging Face's
own loss, the RL extras, and every option listed in --help where it applies and refused where it does not."""
import glob
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, MixtralConfig, MixtralForCausalLM

import common
import dpo
import grpo
import sft
from conftest import ROOT, results, run_main, run_script, script_args, stock_accuracy
from test_e2e import stock_rm_eval, stock_sft_eval

SCRIPTS = ("sft.py", "rm.py", "prm.py", "ppo.py", "grpo.py", "dpo.py", "online_dpo.py", "distill.py")
EVERYWHERE = ["--lora_rank", "--lora_alpha", "--lora_dropout", "--target_modules", "--load_in_4bit", "--dataset",
              "--dataset_probs", "--eval_dataset", "--max_samples", "--max_eval_samples", "--tokenizer_chat_template",
              "--learning_rate", "--adam_betas", "--l2", "--lr_scheduler", "--lr_warmup_ratio", "--max_norm",
              "--max_epochs", "--overlap_comm", "--use_liger_kernel", "--torch_compile", "--logging_steps",
              "--eval_steps", "--save_steps", "--use_tensorboard", "--use_wandb"]
ONLY = {"--pretrain_mode": ("sft.py",),
        "--aux_loss_coef": ("sft.py", "prm.py", "ppo.py", "grpo.py", "dpo.py", "online_dpo.py"),
        **{o: ("ppo.py", "grpo.py") for o in ("--eval_n_samples_per_prompt", "--eval_temperature",
                                              "--no_advantage_std_norm", "--entropy_loss_coef", "--rollout_correction",
                                              "--rollout_correction_bounds", "--async_steps", "--partial_rollout")},
        **{o: ("ppo.py", "grpo.py", "online_dpo.py", "distill.py")
           for o in ("--enable_prefix_caching", "--enforce_eager", "--log_samples")},
        **{o: ("grpo.py",) for o in ("--policy_loss_type", "--importance_sampling_level", "--delta", "--tau_pos",
                                     "--tau_neg", "--kl_ratio_weighted")}}


IMPORT_PROBE = """
import json, os, sys, warnings
import torch, transformers
from transformers import AttentionInterface
env, filters, level = dict(os.environ), list(warnings.filters), transformers.logging.get_verbosity()
import common, rollout, grpo, ppo, sft, rm, prm, serve_rm, dpo, online_dpo, distill, make_pairs
print(json.dumps({"env": sorted(k for k in set(env) | set(os.environ) if env.get(k) != os.environ.get(k)),
                  "filters": warnings.filters == filters, "verbosity": transformers.logging.get_verbosity() == level,
                  "packed_sdpa": "packed_sdpa" in AttentionInterface._global_mapping}))
"""


def test_importing_the_scripts_only_defines_things():
    """A notebook may import grpo.policy_loss: importing common and the scripts sets no environment variable
    (but DeepSpeed's accelerator, which must precede its import, and what DeepSpeed's import sets itself),
    adds no warning filter, leaves transformers' verbosity, and registers no attention implementation."""
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    proc = subprocess.run([sys.executable, "-c", IMPORT_PROBE], capture_output=True, text=True, cwd=ROOT, env=env,
                          check=True)
    probe = json.loads(proc.stdout.strip().splitlines()[-1])
    deepspeed_own = {"PYTORCH_NVML_BASED_CUDA_CHECK"}  # set by `import deepspeed` itself
    assert set(probe["env"]) - deepspeed_own <= {"DS_ACCELERATOR"}  # set only where there is no CUDA
    assert probe["filters"] and probe["verbosity"] and not probe["packed_sdpa"]


def test_help_lists_every_option_where_it_applies():
    for script in SCRIPTS:
        out = run_main(script, "--help").stdout
        listed = {word.rstrip(",") for word in out.split() if word.startswith("--")}
        for option in EVERYWHERE:
            assert option in listed, f"{script} --help lacks {option}"
        for option, scripts in ONLY.items():
            assert (option in listed) == (script in scripts), f"{script} --help and {option}"


@pytest.mark.parametrize("script, flags, message", [
    ("rm.py", ["--pretrain_mode"], "unrecognized arguments: --pretrain_mode"),
    ("rm.py", ["--aux_loss_coef", 0.1], "unrecognized arguments: --aux_loss_coef"),
    ("sft.py", ["--eval_temperature", 1.0], "unrecognized arguments: --eval_temperature"),
    ("grpo.py", ["--enable_prefix_caching"], "--enable_prefix_caching is a vLLM option: add --vllm or --ray"),
    ("ppo.py", ["--remote_rm_url", ROOT / "toy.py", "--eval_n_samples_per_prompt", 4], "needs --eval_temperature > 0"),
    ("sft.py", ["--pretrain_mode", "--apply_chat_template"], "does not combine with --apply_chat_template"),
    ("sft.py", ["--load_in_4bit"], "it trains only with LoRA adapters (--lora_rank)"),
    ("rm.py", ["--load_in_4bit", "--lora_rank", 8], "needs bitsandbytes on a CUDA GPU, and this machine has none"),
    ("prm.py", ["--use_liger_kernel"],
     "--use_liger_kernel: this machine lacks the liger-kernel package, Triton, a CUDA GPU"),
    ("sft.py", ["--torch_compile", "--zero_stage", 3], "--torch_compile does not combine with --zero_stage 3"),
    ("sft.py", ["--ds_tensor_parallel_size", 2], "unrecognized arguments: --ds_tensor_parallel_size"),
    ("ppo.py", ["--no-colocate"], "unrecognized arguments: --no-colocate"),
    ("rm.py", ["--adam_offload"], "--adam_offload moves the optimizer state to the CPU through ZeRO"),
    ("sft.py", ["--flash_attn"], "--flash_attn runs in bf16 only: add --bf16"),
    ("grpo.py", ["--load_in_4bit", "--lora_rank", 8, "--vllm"], "--load_in_4bit with --vllm/--ray"),
    ("grpo.py", ["--enforce_eager"], "--enforce_eager is a vLLM option: add --vllm or --ray"),
    ("grpo.py", ["--vllm", "--vllm_tensor_parallel_size", 2], "--vllm_tensor_parallel_size 2 must divide the 1 "
                                                              "processes (each 2 share an engine)"),
    ("grpo.py", ["--vllm", "--vllm_gpu_memory_utilization", 2],
     "argument --vllm_gpu_memory_utilization: 2 is outside (0, 1]"),
    ("ppo.py", ["--remote_rm_url", ROOT / "toy.py", "--ray", "--vllm_tensor_parallel_size", 2],
     "--ray engines have one GPU each (--vllm_tensor_parallel_size 1)"),
    ("sft.py", ["--aux_loss_coef", 0.1], "--aux_loss_coef: llama is not a mixture-of-experts model"),
    ("sft.py", ["--lora_rank", 4, "--target_modules", "nope_proj"], "--target_modules nope_proj: "),
    ("rm.py", ["--dataset_probs", "0.5,0.5"], "--dataset_probs has 2 weights for 1 datasets"),
    ("sft.py", ["--dataset_probs", "0.5,x"], "expected comma-separated numbers"),
    ("grpo.py", ["--rollout_correction", "token-mask"], "--rollout_correction token-mask corrects for a vLLM "
                                                        "engine's sampling: add --vllm or --ray"),
    ("ppo.py", ["--remote_rm_url", ROOT / "toy.py", "--vllm", "--rollout_correction_bounds", 1.2, 2],
     "--rollout_correction_bounds 1.2 2.0: need 0 <= LO <= 1 <= HI"),
    ("grpo.py", ["--vllm", "--rollout_correction", "none", "--rollout_correction_bounds", 0, 2],
     "--rollout_correction_bounds without a rollout correction"),
    ("grpo.py", ["--policy_loss_type", "cispo", "--dual_clip", 3], "--dual_clip and --delta cap the ppo surrogate"),
    ("grpo.py", ["--delta", 1.1, "--eps_clip_high", 0.28], "--delta 1.1 must be > 1 + --eps_clip_high (1.28)"),
    ("grpo.py", ["--kl_ratio_weighted"], "--kl_ratio_weighted weights the KL loss: add --use_kl_loss"),
    ("grpo.py", ["--policy_loss_type", "sapo", "--tau_neg", 0], "argument --tau_neg: 0 is outside [1e-06, 1e+06]"),
    ("grpo.py", ["--tau_pos", 2], "--tau_pos and --tau_neg are SAPO's: add --policy_loss_type sapo"),
    ("grpo.py", ["--vllm", "--async_steps", 1], "--async_steps needs --ray: the next batch is generated while"),
    ("ppo.py", ["--remote_rm_url", ROOT / "toy.py", "--ray", "--partial_rollout"],
     "--partial_rollout continues samples across weight syncs while"),
    ("grpo.py", ["--ray", "--async_steps", 1, "--partial_rollout", "--agent_func_path", ROOT / "toy_agent.py"],
     "--partial_rollout samples one completion per request"),
    ("grpo.py", ["--ray", "--async_steps", 1, "--dynamic_filtering"],
     "--dynamic_filtering draws batches until a step is full"),
    ("ppo.py", ["--remote_rm_url", ROOT / "toy.py", "--ray", "--async_steps", -1],
     "argument --async_steps: -1 is outside [0, inf)"),
    ("sft.py", ["--multiturn"],
     "--multiturn renders each conversation with the chat template: add --apply_chat_template"),
])
def test_option_refused_with_a_clear_error(toy_world, tmp_path, script, flags, message):
    if "CUDA" in message and torch.cuda.is_available():
        pytest.skip("the CPU-only refusal")
    before = set(sys.modules)
    proc = run_main(script, *flags, "--save_path", tmp_path / "out", check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not {"vllm", "ray"} & (set(sys.modules) - before)  # told before either loads (seconds)


def test_liger_kernel_names_only_what_is_missing(monkeypatch):
    """With the package and Triton made to look installed, --use_liger_kernel's one line names the GPU alone."""
    import importlib.util

    import speedups

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: find("json" if name in ("liger_kernel", "triton")
                                                                         else name))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as stop:
        speedups.use_liger_kernel(None)
    assert str(stop.value).startswith("error: --use_liger_kernel: this machine lacks a CUDA GPU (")


def lora_params(config, rank):
    """Closed form of what LoRA adds to every linear layer of a Llama block: rank * (in + out) each."""
    h, inter, head = config.hidden_size, config.intermediate_size, config.hidden_size // config.num_attention_heads
    q, kv = config.num_attention_heads * head, config.num_key_value_heads * head
    shapes = [(h, q), (h, kv), (h, kv), (q, h), (h, inter), (h, inter), (inter, h)]
    return config.num_hidden_layers * sum(rank * (i + o) for i, o in shapes)


def tb_scalars(directory, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)}


def lr_closed_form(name, step, total, warmup, peak, min_rate=0.1):
    """The learning rate after `step` optimizer steps, written out from the schedules' definitions."""
    if step < warmup:
        return peak * step / warmup
    progress = (step - warmup) / (total - warmup)
    if name == "linear":
        return peak * max(0.0, 1 - progress)
    if name == "constant_with_warmup":
        return peak
    if name == "cosine_with_min_lr":
        return peak * (min_rate + (1 - min_rate) * 0.5 * (1 + math.cos(math.pi * progress)))
    raise ValueError(name)


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_run_says_which_defaults_it_took_and_why(toy_world, tmp_path, script):
    """One line: the column of the script's DEFAULTS table it took (the toy world's without --dataset, a real run's
    with one, even a toy world file), and the values, those given on the command line left out."""
    module = __import__(script[:-3])
    line = lambda proc: [x for x in proc.stderr.splitlines() if x.startswith("defaults: ")]  # noqa: E731
    toy = line(run_main(script, "--pretrain", tmp_path / "none", "--learning_rate", 0.5, cwd=tmp_path, check=False))
    real = line(run_main(script, "--pretrain", tmp_path / "none", "--dataset", toy_world / "steps_train.jsonl",
                         cwd=tmp_path, check=False))
    assert len(toy) == 1 and toy[0].startswith("defaults: the toy world's (no --dataset given; a flag you give wins): ")
    assert len(real) == 1 and real[0].startswith("defaults: a real run's (--dataset given")
    toy_pairs, real_pairs = ({*zip(x.split(), x.split()[1:])} for x in (toy[0], real[0]))  # (--flag, value)
    for flag, (real_value, toy_value) in module.DEFAULTS.items():
        if flag == "learning_rate":
            assert "--learning_rate" not in toy[0] and ("--learning_rate", str(real_value)) in real_pairs
        elif isinstance(toy_value, (int, float)):
            assert (f"--{flag}", str(toy_value)) in toy_pairs  # (paths are the session's toy world's)
        if real_value is not None and flag != "dataset":
            assert (f"--{flag}", str(real_value)) in real_pairs


@pytest.mark.parametrize("script", SCRIPTS)
def test_max_eval_samples_cuts_the_eval_data_alone(toy_world, tmp_path, script, monkeypatch):
    """--max_eval_samples 7: a script reads the first 7 records of its eval data, and its training data whole (the
    toy world's defaults; the run is stopped once both are read)."""
    load, read = common.load_records, []

    def spy(source, *args, **kwargs):
        got = load(source, *args, **kwargs)
        read.append((Path(source).name, got[0] if kwargs.get("with_locations") else got))
        if len(read) == 2:
            raise SystemExit("read")
        return got

    monkeypatch.setattr(common, "load_records", spy)
    judge = {"ppo.py": ["--remote_rm_url", ROOT / "toy.py"], "online_dpo.py": ["--remote_rm_url", ROOT / "toy.py"],
             "distill.py": ["--teacher_pretrain", toy_world / "model"]}.get(script, [])
    proc = run_main(script, *judge, "--max_eval_samples", 7, "--save_path", tmp_path / "out", check=False)
    assert proc.returncode == 1 and proc.stderr.rstrip().endswith("read"), proc.stderr[-2000:]
    (train_name, train), (eval_name, evals) = read
    toy = __import__(script[:-3]).DEFAULTS
    assert (train_name, eval_name) == (Path(toy["dataset"][1]).name, Path(toy["eval_dataset"][1]).name)
    assert len(train) == len(load(toy_world / train_name, max_samples=toy["max_samples"][1]
                                  if "max_samples" in toy else None)) > 7
    assert evals == load(toy_world / eval_name)[:7]


def test_lora_sft_trains_merges_and_follows_its_schedule(policy, toy_world, tmp_path):
    """Two processes, ZeRO-3: the adapters are partitioned too, and gathered when saved."""
    tb = tmp_path / "tb"
    proc = run_script("sft.py", "--pretrain", policy, "--lora_rank", 16, "--lora_alpha", 32, "--learning_rate", 3e-3,
                      "--max_samples", 6400, "--max_epochs", 1, "--lr_warmup_ratio", 0.1, "--eval_generate_samples", 0,
                      "--zero_stage", 3, "--micro_train_batch_size", 32, "--logging_steps", 1, "--use_tensorboard", tb,
                      "--save_path", tmp_path / "lora", nproc=2)
    config = AutoConfig.from_pretrained(policy)
    total = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(policy).parameters())
    trained = lora_params(config, 16)
    assert f"training {trained:,} of {total + trained:,} parameters" in proc.stderr
    # only the adapter is saved
    assert not (tmp_path / "lora" / "model.safetensors").exists()
    assert sum(t.numel() for t in load_file(tmp_path / "lora" / "adapter_model.safetensors").values()) == trained

    # the loss falls: the adapter model's eval loss is below the base policy's (both computed by stock classes)
    res = results(tmp_path / "lora")
    assert res["eval_loss"] < stock_sft_eval(policy, toy_world) - 0.05

    # the schedule: warm-up then cosine to 10%, at every step, read back from the event file
    steps = 6400 // 64
    lr, loss = tb_scalars(tb, "train/lr"), tb_scalars(tb, "train/loss")
    assert sorted(lr) == sorted(loss) == list(range(1, steps + 1))
    for step, value in lr.items():
        assert value == pytest.approx(lr_closed_form("cosine_with_min_lr", step, steps, int(0.1 * steps), 3e-3), rel=1e-6)
    assert tb_scalars(tb, "eval/loss")[steps] == pytest.approx(res["eval_loss"], rel=1e-6)

    # merged: a full model the stock class loads, with the adapter model's logits (transformers loads the
    # adapter directory itself, base and adapter) and its eval loss
    run_main("merge_lora.py", "--model_path", policy, "--lora_path", tmp_path / "lora", "--output_path",
             tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    adapter = AutoModelForCausalLM.from_pretrained(tmp_path / "lora").eval()
    ids = torch.randint(3, config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapter(ids).logits, atol=1e-5, rtol=1e-5)  # fp32 rounding
        assert (merged(ids).logits - AutoModelForCausalLM.from_pretrained(policy)(ids).logits).abs().max() > 1e-3
    assert stock_sft_eval(tmp_path / "merged", toy_world) == pytest.approx(res["eval_loss"], rel=1e-4)


def test_lora_reward_model_merges_into_a_stock_classifier(policy, toy_world, tmp_path):
    run_main("rm.py", "--pretrain", policy, "--lora_rank", 8, "--learning_rate", 1e-3, "--max_samples", 512,
             "--train_batch_size", 32, "--max_epochs", 1, "--save_path", tmp_path / "rm")
    head = [k for k in load_file(tmp_path / "rm" / "adapter_model.safetensors") if "score" in k]
    assert len(head) == 1  # the whole score head is trained and saved beside the adapters
    proc = run_main("merge_lora.py", "--model_path", policy, "--lora_path", tmp_path / "rm", "--output_path",
                    tmp_path / "bad", check=False)
    assert proc.returncode != 0 and "trained as a reward model: add --is_rm" in proc.stderr
    run_main("merge_lora.py", "--model_path", policy, "--lora_path", tmp_path / "rm", "--output_path",
             tmp_path / "merged", "--is_rm")
    # the stock classifier on the merged directory scores the eval pairs as rm.py's adapter model did
    res = results(tmp_path / "rm")
    acc, mean, std, model = stock_rm_eval(tmp_path / "merged", toy_world)
    assert acc == pytest.approx(res["eval_acc"], abs=1e-9)
    assert mean == pytest.approx(res["eval_reward_mean"], rel=1e-4, abs=1e-5)
    assert std == pytest.approx(res["eval_reward_std"], rel=1e-4)
    assert (model.config.mean, model.config.std) == (res["eval_reward_mean"], res["eval_reward_std"])


def test_dataset_mixing_follows_the_probabilities(tmp_path):
    paths = []
    for name, n in (("a", 300), ("b", 200), ("c", 50)):
        paths.append(tmp_path / f"{name}.jsonl")
        paths[-1].write_text("".join(json.dumps({"input": f"{name}{i}"}) + "\n" for i in range(n)))
    source = ",".join(map(str, paths))
    records, where = common.load_records(source, required_keys=["input"], max_samples=10000,
                                         with_locations=True, probs=[0.5, 0.3, 0.2], seed=1)
    assert len(records) == 10000
    for name, p in zip("abc", (0.5, 0.3, 0.2)):
        drawn = [r["input"] for r in records if r["input"][0] == name]
        assert abs(len(drawn) / 10000 - p) <= 0.02
        n = {"a": 300, "b": 200, "c": 50}[name]
        assert len(set(drawn[:n])) == n  # each source is gone through whole before any record repeats
    assert all(w.startswith(str(tmp_path)) and ": line " in w for w in where)  # errors still name file and line
    # without weights the sources are concatenated; --max_samples still caps the total
    plain = common.load_records(source, max_samples=400)
    assert [r["input"] for r in plain] == [f"a{i}" for i in range(300)] + [f"b{i}" for i in range(100)]
    # the mix is the same on every call with the same seed (every rank builds the same list)
    again = common.load_records(source, max_samples=10000, probs=[0.5, 0.3, 0.2], seed=1)
    assert again == records


@pytest.mark.parametrize("schedule", ["linear", "constant_with_warmup"])
def test_schedules_and_wandb_offline(toy_world, tmp_path, schedule):
    tb = tmp_path / "tb"
    env = dict(WANDB_MODE="offline", WANDB_DIR=str(tmp_path), WANDB_SILENT="true")
    os.environ.update(env)  # run_script passes the environment on
    try:
        run_script("sft.py", "--max_samples", 640, "--max_epochs", 2, "--lr_scheduler", schedule,
                   "--lr_warmup_ratio", 0.25, "--learning_rate", 1e-3, "--use_tensorboard", tb, "--use_wandb",
                   "--eval_generate_samples", 0, "--save_path", tmp_path / "sft")
    finally:
        for k in env:
            os.environ.pop(k)
    lr = tb_scalars(tb, "train/lr")
    assert sorted(lr) == list(range(1, 21))
    for step, value in lr.items():
        assert value == pytest.approx(lr_closed_form(schedule, step, 20, 5, 1e-3), rel=1e-6, abs=1e-12)
    # wandb wrote an offline run, no account, holding the metrics (protobuf keeps the names as bytes)
    run_file = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(run_file) == 1
    data = open(run_file[0], "rb").read()
    assert b"train/loss" in data and b"train/lr" in data and b"eval/loss" in data


def test_moe_router_loss_matches_hugging_face(toy_world, tokenizer, tmp_path):
    """--aux_loss_coef on a tiny Mixtral: the first logged loss equals Hugging Face's own loss for the same
    batch (its cross-entropy plus router_aux_loss_coef times its load-balancing loss), before any update."""
    config = MixtralConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=64, router_aux_loss_coef=0.5, pad_token_id=tokenizer.pad_token_id,
                           bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    MixtralForCausalLM(config).save_pretrained(tmp_path / "moe")
    tokenizer.save_pretrained(tmp_path / "moe")
    tb = tmp_path / "tb"
    run_main("sft.py", "--pretrain", tmp_path / "moe", "--aux_loss_coef", 0.5, "--max_samples", 64,
             "--train_batch_size", 64, "--micro_train_batch_size", 64, "--max_epochs", 1, "--eval_generate_samples",
             0, "--use_tensorboard", tb, "--save_path", tmp_path / "out")
    args = script_args(max_len=32, output_key="output", multiturn=False, pretrain_mode=False)
    records = [json.loads(line) for line in open(toy_world / "sft_train.jsonl")][:64]
    data = [sft.tokenize_sample(r, tokenizer, args) for r in records]
    ids, mask, _ = common.batch_sequences([d[0] for d in data], tokenizer.pad_token_id, False)
    labels, _, _ = common.batch_sequences([d[1] for d in data], -100, False)
    model = MixtralForCausalLM.from_pretrained(tmp_path / "moe").eval()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True)
    assert out.aux_loss > 0
    assert tb_scalars(tb, "train/loss")[1] == pytest.approx(out.loss.item(), rel=1e-5)

    # grpo.py adds it to the policy loss: the same first rollout (same seed, same model) with and without
    # it differs by coef * aux, where 0 < aux <= num_experts (fractions of top-k picks times mean router
    # probabilities, summed over experts)
    first = []
    for coef in (0.5, 0.0):
        run_main("grpo.py", "--pretrain", tmp_path / "moe", "--aux_loss_coef", coef, "--max_samples", 16,
                 "--rollout_batch_size", 8, "--n_samples_per_prompt", 2, "--train_batch_size", 16,
                 "--micro_train_batch_size", 16, "--eval_dataset", "", "--use_tensorboard", tmp_path / f"tb{coef}",
                 "--save_path", tmp_path / f"g{coef}")
        first.append(tb_scalars(tmp_path / f"tb{coef}", "train/policy_loss")[1])
    assert 0 < (first[0] - first[1]) / 0.5 <= config.num_local_experts

    # dpo.py: the router loss of the first step's forward (chosen and rejected of its 16 pairs, padded) is Hugging
    # Face's for the same sequences
    run_main("dpo.py", "--pretrain", tmp_path / "moe", "--aux_loss_coef", 0.5, "--max_samples", 16,
             "--train_batch_size", 16, "--micro_train_batch_size", 16, "--eval_dataset", "",
             "--use_tensorboard", tmp_path / "tb_dpo", "--save_path", tmp_path / "d")
    args = script_args(input_key="input", chosen_key="chosen", rejected_key="rejected")
    pairs = [dpo.tokenize_pair(json.loads(line), tokenizer, args, "")
             for line in open(toy_world / "pref_train.jsonl").readlines()[:16]]
    ids, mask, _ = common.batch_sequences([torch.cat([p, c]) for p, c, _ in pairs] +
                                          [torch.cat([p, r]) for p, _, r in pairs], tokenizer.pad_token_id, False)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    assert tb_scalars(tmp_path / "tb_dpo", "train/aux_loss")[1] == pytest.approx(out.aux_loss.item(), rel=1e-5)


def test_no_advantage_std_norm_only_centers():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(24, generator=g, dtype=torch.float64)
    adv = grpo.group_advantages(rewards, 6, "group_norm", std_norm=False)
    for k in range(4):
        group = rewards[6 * k:6 * k + 6].tolist()
        for i, r in enumerate(group):
            assert adv[6 * k + i].item() == pytest.approx(r - sum(group) / 6, abs=1e-12)
    x = torch.randn(5, 7, generator=g)
    mask = torch.rand(5, 7, generator=g) > 0.3
    kept = [v for v, m in zip(x.flatten().tolist(), mask.flatten().tolist()) if m]
    centered = common.masked_whiten(x, mask, std_norm=False)
    for v, m, c in zip(x.flatten().tolist(), mask.flatten().tolist(), centered.flatten().tolist()):
        assert c == pytest.approx(v - sum(kept) / len(kept) if m else 0.0, abs=1e-6)


@pytest.mark.parametrize("share_prompts", [True, False], ids=["grpo", "ppo"])
def test_entropy_bonus_has_a_gradient(policy, share_prompts):
    """--entropy_loss_coef: the entropy common.response_logprobs returns (laid out as grpo.py and ppo.py ask)
    equals -sum p log p of the softmax (float64 loop), and carries a gradient, so the bonus changes the update."""
    tok = AutoTokenizer.from_pretrained(policy)
    model = AutoModelForCausalLM.from_pretrained(policy)
    batch = [(torch.tensor(tok("12+34=")["input_ids"]), torch.tensor([5, 7, 9])),
             (torch.tensor(tok("7+8=")["input_ids"]), torch.tensor([4, 2]))]
    _, entropy, _ = common.response_logprobs(model, batch, tok.pad_token_id, False, 0.7, with_entropy=True,
                                             share_prompts=share_prompts)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    assert entropy.requires_grad
    common.masked_mean(entropy, mask).backward()
    assert sum(p.grad.abs().sum().item() for p in model.parameters() if p.grad is not None) > 0
    with torch.no_grad():
        for i, (p, r) in enumerate(batch):
            logits = model(torch.cat([p, r])[None]).logits[0].double() / 0.7
            for t in range(len(r)):
                probs = torch.softmax(logits[len(p) - 1 + t], -1)
                assert entropy[i, t].item() == pytest.approx(-(probs * probs.log()).sum().item(), rel=1e-4, abs=1e-6)


RL_STEP = ["--max_samples", 64, "--rollout_batch_size", 16, "--train_batch_size", 16, "--micro_train_batch_size", 8,
           "--logging_steps", 1]


def test_grpo_lora_with_vllm(policy, eval_file, tmp_path):
    """The vLLM engine gets the merged weights after every update (gathered from ZeRO-3 partitions): its
    greedy eval completions of the last policy equal HF's on the merged model, reloaded by the stock class."""
    run_script("grpo.py", *RL_STEP, "--n_samples_per_prompt", 4, "--train_batch_size", 32, "--pretrain", policy,
               "--eval_dataset", eval_file, "--vllm", "--zero_stage", 3, "--enable_prefix_caching", "--lora_rank", 8,
               "--learning_rate", 1e-3, "--no_advantage_std_norm", "--entropy_loss_coef", 0.01,
               "--save_path", tmp_path / "g")
    run_main("merge_lora.py", "--model_path", policy, "--lora_path", tmp_path / "g", "--output_path", tmp_path / "m")
    res = results(tmp_path / "g")
    assert res["eval_accuracy"] == stock_accuracy(tmp_path / "m", eval_file)
    assert res["eval_accuracy_before"] == stock_accuracy(policy, eval_file)
    before = AutoModelForCausalLM.from_pretrained(policy).state_dict()
    after = AutoModelForCausalLM.from_pretrained(tmp_path / "m").state_dict()
    assert max((after[k] - before[k]).abs().max().item() for k in before) > 1e-4


def test_ppo_lora_actor_and_critic_with_pass_at_k(policy, eval_file, tmp_path):
    """LoRA on the actor and the critic (whose score head trains whole and is saved); eval samples 4
    completions per prompt: pass@4 (a prompt solved by any of them) lies between the mean accuracy and
    4 times it."""
    run_main("ppo.py", *RL_STEP, "--pretrain", policy, "--remote_rm_url", ROOT / "toy.py", "--eval_dataset",
             eval_file, "--lora_rank", 8, "--learning_rate", 1e-3, "--critic_learning_rate", 1e-3,
             "--save_value_network", "--eval_n_samples_per_prompt", 4, "--eval_temperature", 1.0,
             "--save_path", tmp_path / "p")
    res = results(tmp_path / "p")
    for when in ("_before", ""):
        acc, best = res[f"eval_accuracy{when}"], res[f"eval_pass@4{when}"]
        assert 0 < acc <= best <= min(1.0, 4 * acc)
    assert len([k for k in load_file(tmp_path / "p_critic" / "adapter_model.safetensors") if "score" in k]) == 1
    run_main("merge_lora.py", "--model_path", policy, "--lora_path", tmp_path / "p_critic", "--output_path",
             tmp_path / "critic", "--is_rm")
    from transformers import AutoModelForSequenceClassification
    critic = AutoModelForSequenceClassification.from_pretrained(tmp_path / "critic")
    assert critic.score.weight.shape == (1, critic.config.hidden_size)


def test_tokenizer_chat_template_replaces_the_tokenizers(toy_world, tmp_path):
    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    messages = [{"role": "user", "content": "1+1="}]
    for given in (template, str(tmp_path / "t.jinja")):  # the text itself, or a file holding it
        tok = common.load_tokenizer(toy_world / "model", script_args(tokenizer_chat_template=given))
        assert tok.apply_chat_template(messages, tokenize=False) == "[user]1+1="
    stock = common.load_tokenizer(toy_world / "model", script_args())
    assert stock.apply_chat_template(messages, tokenize=False) != "[user]1+1="


def test_bf16_on_a_cpu_that_emulates_it_warns_once_with_its_cost(monkeypatch, capsys, tmp_path):
    """--bf16 on a CPU without bf16 matmul instructions (AVX2 only: ~100x slower than fp32) gets one warning line
    from every script (common.parse_args, speedups.warn_if_slow_bf16) and from serve_rm, with the measured cost; bf16
    stays on, as asked."""
    import argparse

    import speedups
    import serve_rm

    cpuinfo = tmp_path / "cpuinfo"
    for flags, native in [("flags\t\t: fpu sse2 avx avx2 fma", False), ("flags\t\t: avx2 avx512f avx512_bf16", True),
                          ("flags\t\t: avx2 amx_bf16 amx_tile", True), ("Features\t: fp asimd bf16 i8mm", True)]:
        cpuinfo.write_text(f"processor\t: 0\n{flags}\n")
        assert speedups.cpu_has_native_bf16(cpuinfo) is native

    def warnings(native, argv, entry):
        monkeypatch.setattr(speedups, "cpu_has_native_bf16", lambda: native)
        monkeypatch.setattr(sys, "argv", ["x", *argv])
        capsys.readouterr()
        entry()
        return [line for line in capsys.readouterr().err.splitlines() if "bf16" in line]

    monkeypatch.setattr(serve_rm.uvicorn, "run", lambda *a, **k: None)  # main() up to the server start
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU case, on a GPU machine too
    script = ["--pretrain", "m", "--dataset", "d.jsonl", "--save_path", str(tmp_path / "out")]
    entries = {"scripts": (script, lambda: common.parse_args(sft.add_training_args(argparse.ArgumentParser()), {})),
               "serve_rm": (["--reward_pretrain", "m"], serve_rm.main)}
    for name, (argv, entry) in entries.items():
        lines = warnings(False, argv + ["--bf16"], entry)
        assert len(lines) == 1 and "GFLOP/s" in lines[0] and "drop --bf16 to run in fp32" in lines[0], (name, lines)
        assert warnings(True, argv + ["--bf16"], entry) == [] and warnings(False, argv, entry) == [], name


OFFLOAD_PROBE = """
import json, sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]
import common, deepspeed, sft, torch
from conftest import script_args
from transformers import AutoTokenizer

partitions = []  # where each zero.Init that from_pretrained opens stores the partitions: the accelerator (local,
init = deepspeed.zero.Init.__init__  # a torch.device) or the offload device named in the config
deepspeed.zero.Init.__init__ = lambda self, *a, **kw: init(self, *a, **kw) or partitions.append(
    "local" if isinstance(self.remote_device, torch.device) else f"offload:{self.remote_device}")
args = script_args(zero_stage=3, train_batch_size=1, micro_train_batch_size=1)
common.init_distributed(args)
out = {}
for offload in (False, True):
    model = common.load_frozen(sys.argv[2], args, AutoTokenizer.from_pretrained(sys.argv[2]), sft.ds_config(args),
                               offload=offload)
    out[str(offload)] = partitions[:]
    partitions.clear()
print(json.dumps(out))
"""


def test_ref_reward_offload_reaches_from_pretrained_under_zero3(policy):
    """--ref_reward_offload under ZeRO-3: the offload setting is in the config from_pretrained partitions
    with, so the frozen models' partitions are stored on the CPU from the start (DeepSpeed does not move
    partitioned weights later); without it they stay on the accelerator (here the CPU itself)."""
    proc = subprocess.run([sys.executable, "-c", OFFLOAD_PROBE, str(ROOT), str(policy)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    where = json.loads(proc.stdout.strip().splitlines()[-1])
    assert where == {"False": ["local"], "True": ["offload:cpu"]}


# -------------------------------------------------------------------------------- extreme values inside a range
# An in-range extreme either works or is refused where it is parsed; none crashes after loading (issue 64, item 7:
# `--eps_clip_high 1e308` was a traceback from torch's clamp a minute into a run). Every number flag of every script
# below is either fed to the function it feeds at both ends of its range (1e308 or 10**18 where the range is open
# upward, the first number past an open end), which must give finite numbers, or is listed in EXTREME_SAFE with what
# it feeds (only counted, compared or sliced). A new number flag fails test_every_number_flag_works_at_its_extremes
# until it is put in one or the other.
EXTREME_SCRIPTS = ("sft", "rm", "prm", "dpo", "grpo", "ppo", "online_dpo", "distill", "make_pairs")  # serve_rm.py and
# agent_server.py are their own (tests/test_serve_rm.py, tests/test_agent_server.py)
EXTREME_SAFE = {
    "max_samples": "caps the records read (a slice)",
    "max_eval_samples": "caps the eval records read (a slice)",
    "max_len": "truncates or drops sequences (slices and comparisons)",
    "prompt_max_len": "drops longer prompts (a comparison)",
    "micro_train_batch_size": "a slice; must divide --train_batch_size (ds_config says so in one line)",
    "train_batch_size": "a slice; more than the samples is refused in one line",
    "rollout_batch_size": "a slice; more than the prompts is refused in one line",
    "micro_rollout_batch_size": "a chunk of a rollout (a slice)",
    "logging_steps": "step % N", "save_steps": "step % N", "eval_steps": "step % N", "max_ckpt_num": "a comparison",
    "eval_generate_samples": "a slice of the eval set", "log_samples": "a slice of a batch",
    "freezing_actor_steps": "a comparison with the step", "max_turns": "a comparison with an episode's turns",
    "async_steps": "a semaphore's count (--ray)", "remote_rm_batch_size": "range()'s step over the queries",
    "lmbda": "compared with random.random()", "dynamic_filtering_reward_range": "compared with float64 group means",
    "vllm_num_engines": "a device count: more than the GPUs is refused in one line (--ray)",
    "vllm_tensor_parallel_size": "a device count: must divide the processes (checked in one line)",
    "vllm_gpu_memory_utilization": "vLLM's share of the GPU, (0, 1], handed to vLLM as it is",
    "n_samples_per_prompt": "how many samples a rollout holds: at most 65536 per prompt",
    "eval_n_samples_per_prompt": "how many samples an eval holds: at most 65536 per prompt",
}


def number_flags(script):
    """(action, kind, lo, hi, lo_open, hi_open) of each common.ranged flag of a script, its parser taken where the
    script would parse its command line (as test_bad_input's check of the defaults does); nothing runs after."""
    import argparse
    import importlib

    class Parsed(Exception):
        pass

    def stop(parser, *_):
        raise Parsed(parser)

    saved = common.parse_args, common.quiet_libraries, argparse.ArgumentParser.parse_args, sys.argv
    common.parse_args, common.quiet_libraries, argparse.ArgumentParser.parse_args = stop, lambda: None, stop
    sys.argv = [f"{script}.py"]
    try:
        module = importlib.import_module(script)
        getattr(module, "parse_args", module.main)()
    except Parsed as p:
        parser = p.args[0]
    finally:
        common.parse_args, common.quiet_libraries, argparse.ArgumentParser.parse_args, sys.argv = saved
    out = []
    for action in parser._actions:
        assert action.type not in (int, float) or action.choices or action.dest == "local_rank", \
            f"{script}.py {action.option_strings[0]}: a number flag without common.ranged"  # (the launcher's own)
        cells = dict(zip(getattr(action.type, "__code__", None) and action.type.__code__.co_freevars or (),
                         (c.cell_contents for c in getattr(action.type, "__closure__", None) or ())))
        if "kind" in cells:
            out.append((action, cells["kind"], cells["lo"], cells["hi"], cells["lo_open"], cells["hi_open"]))
    return module, out


def extreme_ends(kind, lo, hi, lo_open, hi_open):
    """The first and last values a range takes: 1e308 / 10**18 for an infinite end, one step in from an open one."""
    big = 10**18 if kind is int else 1e308
    step = (lambda x, to: x + (1 if to > x else -1)) if kind is int else math.nextafter
    first = -big if lo == -math.inf else step(lo, math.inf) if lo_open else lo
    last = big if hi == math.inf else step(hi, -math.inf) if hi_open else hi
    return kind(first), kind(last)


def finite(*tensors):
    for t in tensors:
        assert torch.isfinite(torch.as_tensor(t)).all(), t


def policy_inputs():
    """Log-probs (a leaf) with ratios e^-3 .. e^3 to the old ones, advantages > 0, < 0 and 0, a padded mask."""
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 6, generator=g) * 3
    logprobs = (old + torch.randn(4, 6, generator=g)).clamp(-20, 0).requires_grad_()
    advantages = torch.tensor([[1.5], [-2.0], [0.0], [-0.5]]).expand(4, 6)
    mask = torch.ones(4, 6)
    mask[1, 4:] = 0
    return logprobs, old, advantages, mask


def loss_and_grad(fn):
    """fn(logprobs, old, advantages, mask) -> a loss: finite, and so its gradient."""
    logprobs, old, advantages, mask = policy_inputs()
    loss = fn(logprobs, old, advantages, mask)
    loss.backward()
    finite(loss, logprobs.grad)


def surrogate(m, **kw):
    """A script's policy_loss (grpo.py's, ppo.py's) with these keywords: finite, and its gradient."""
    loss_and_grad(lambda lp, old, a, mask: m.policy_loss(lp, old, a, mask, **kw))


def rollout_stub(rewards, lengths, stopped):
    from types import SimpleNamespace

    return SimpleNamespace(lengths=torch.tensor(lengths), stopped=torch.tensor(stopped)), \
        lambda batch: {"rewards": torch.tensor(rewards), "scores": torch.tensor(rewards), "logs": {}}


def grpo_score(m, **flags):
    """score's rewards (the penalties applied) -> group advantages and the update's loss: all finite."""
    args = script_args(**{"non_stop_penalty": None, "overlong_buffer_len": 0, "overlong_penalty_factor": 1.0,
                          "generate_max_len": 8, **flags})
    batch, reward_fn = rollout_stub([1.0, 0.0, 0.5, -1.0], [8, 3, 8, 5], [False, True, False, True])
    rewards = m.score(batch, reward_fn, args)["rewards"]
    for estimator in m.ESTIMATORS:
        advantages = m.group_advantages(rewards, 4, estimator)
        finite(rewards, advantages, common.masked_whiten(advantages[:, None].expand(4, 3), torch.ones(4, 3)))


def ppo_score(m, **flags):
    """score's rewards (penalty, then the clip) through the KL reward and GAE: all finite."""
    args = script_args(**{"non_stop_penalty": None, "reward_clip_range": (-10.0, 10.0), **flags})
    batch, reward_fn = rollout_stub([1.0, 0.0, 0.5, -1.0], [8, 3, 8, 5], [False, True, False, True])
    rewards = m.score(batch, reward_fn, args)["rewards"]
    token_rewards = m.kl_penalized_rewards(rewards, torch.rand(4, 8), torch.ones(4, 8), 0.01)
    advantages, returns = m.compute_gae(token_rewards, torch.randn(4, 8), torch.ones(4, 8), 1.0, 0.95)
    finite(rewards, advantages, returns, m.value_loss(torch.randn(4, 8), torch.randn(4, 8), returns, torch.ones(4, 8)))


def kl_penalty(m, kl_coef):
    """--init_kl_coef: ppo.py's per-token KL reward through GAE; grpo.py's in the advantages, and in the loss
    (--use_kl_loss): finite."""
    kl, mask = torch.rand(4, 6), torch.ones(4, 6)
    if hasattr(m, "kl_penalized_rewards"):
        finite(*m.compute_gae(m.kl_penalized_rewards(torch.rand(4), kl, mask, kl_coef), torch.randn(4, 6), mask, 1, 1))
    else:
        finite(m.token_advantages(torch.randn(4), kl, mask, kl_coef))
        surrogate(m, ref_logprobs=-torch.rand(4, 6), kl_coef=kl_coef)


def weight(x):
    """A loss weight: x times a loss term up to 1e4 in magnitude, and its gradient squared (AdamW's second moment),
    stay finite in float32."""
    term = torch.tensor([1e4, -1e4, 0.5], requires_grad=True)
    (x * term).sum().backward()
    finite(x * term.detach(), term.grad ** 2)


def optimizer_steps(**flags):
    """The training scripts' optimizer and schedule (setup_deepspeed's: fused AdamW, transformers' schedule of
    num_training_steps; DeepSpeed's clipping at --max_norm), three steps: finite weights and learning rates."""
    import transformers

    a = script_args(**flags)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=a.learning_rate, betas=a.adam_betas, weight_decay=a.l2,
                                  fused=True)
    total = flags.get("total_steps", 3)
    scheduler = transformers.get_scheduler(a.lr_scheduler, optimizer, int(a.lr_warmup_ratio * total), total,
                                           scheduler_specific_kwargs={"min_lr_rate": 0.1})
    for _ in range(3):
        model(torch.randn(2, 4)).square().sum().backward()
        if a.max_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.max_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    finite(*model.parameters(), scheduler.get_last_lr()[0])


def lr_schedule(x):
    """--max_epochs or --num_episodes x: the schedule's length at least x steps."""
    optimizer_steps(total_steps=x * 100)


def tiny_llama(vocab_size=16, **config):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                        **config))


def lora_adapters(**flags):
    """lora.add_adapters on a tiny Llama (layers 8 and 16 wide), one AdamW step at --learning_rate 1e-3: a finite
    forward before and after. (--lora_rank 65536 on q_proj alone: the others would only repeat it, 8x slower.)"""
    import lora

    flags = {"lora_rank": 1, **flags, **({"target_modules": ["q_proj"]} if flags.get("lora_rank", 0) > 64 else {})}
    model = lora.add_adapters(tiny_llama(), script_args(**flags)).train()
    ids = torch.randint(0, 16, (2, 5))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3).step()
    finite(out.logits, model(input_ids=ids).logits)


def reward_server(m, **flags):
    """A reward server that refuses connections, at these timeouts and retries: the run stops in one line (the
    failing server named), not with another exception."""
    kw = {"timeout": 60.0, "retries": 0, "retry_wait": 0.0, "batch_size": 64, **flags}
    port = common.free_port()
    with pytest.raises(SystemExit, match=f"reward server http://127.0.0.1:{port}/get_reward failed"):
        m.remote_rewards(f"http://127.0.0.1:{port}/get_reward", ["q"], ["p"], [None], **kw)


def agent_timeout(x):
    """agents.call's asyncio.wait_for at --agent_timeout x: done, or a timeout (the episode's one-line error)."""
    import asyncio

    async def call():
        try:
            await asyncio.wait_for(asyncio.sleep(0.001), x)
        except (TimeoutError, asyncio.TimeoutError):
            pass

    asyncio.run(call())


def rollout_correction(bounds):
    import engines

    g = torch.Generator().manual_seed(1)
    old = -torch.rand(3, 5, generator=g) * 3
    engine = old + torch.randn(3, 5, generator=g) * 2
    for mode in engines.ROLLOUT_CORRECTIONS:
        finite(engines.rollout_correction_weights(old, engine, torch.ones(3, 5), mode, bounds)[0])


def dpo_losses(m, **kw):
    """Each loss type of a script's dpo_loss on log-prob sums up to 1e4 apart: finite loss and gradient."""
    chosen = torch.tensor([-20.0, -1e4, -3.0], requires_grad=True)
    for loss_type in m.LOSS_TYPES if not kw.get("label_smoothing") else ["sigmoid"]:
        loss, c, r = m.dpo_loss(chosen, torch.tensor([-25.0, -2.0, -3.0]), torch.tensor([-21.0, -5e3, -3.0]),
                                torch.tensor([-24.0, -1.0, -3.0]), loss_type=loss_type, **kw)
        chosen.grad = None
        loss.backward()
        finite(loss, c, r, chosen.grad)


def sampling(m, model, tokenizer, temperature=1.0, top_p=1.0):
    """A script's generate_hf and the log-probs at that temperature (what the update divides by it): finite. (Each
    script's copy samples alike: test_copies; so each value is checked with the first script's.)"""
    prompts = [torch.tensor(tokenizer(t)["input_ids"]) for t in ("12+34=", "7+8=")]
    responses = m.generate_hf(model, tokenizer, prompts, temperature, top_p, max_new_tokens=3)
    pairs = [(p, r if len(r) else torch.tensor([tokenizer.eos_token_id])) for p, r in zip(prompts, responses)]
    finite(common.response_logprobs(model, pairs, tokenizer.pad_token_id, False, temperature or 1.0)[0])


def extreme_checks(model, tokenizer):
    """{flag's dest: f(value, script module)}: the function the flag feeds, at that value; finite numbers or bust."""
    import distill
    import ppo

    return {
        "eps_clip_low": lambda x, m: surrogate(m, eps_clip_low=x),
        "eps_clip_high": lambda x, m: [surrogate(m, eps_clip_high=x, policy_loss_type=t) for t in ("ppo", "cispo")],
        "dual_clip": lambda x, m: surrogate(m, dual_clip=x),
        "delta": lambda x, m: surrogate(m, delta=x),
        "tau_pos": lambda x, m: surrogate(m, policy_loss_type="sapo", tau_pos=x),
        "tau_neg": lambda x, m: surrogate(m, policy_loss_type="sapo", tau_neg=x),
        "eps_clip": lambda x, m: surrogate(m, eps_clip=x) if m is ppo else loss_and_grad(
            lambda lp, old, a, mask: distill.sampled_kl_loss(lp, old, old - a, mask, eps_clip=x)),
        "value_clip": lambda x, m: loss_and_grad(lambda lp, old, a, mask: m.value_loss(lp, old, a, mask, value_clip=x)),
        "reward_clip_range": lambda x, m: ppo_score(m, reward_clip_range=x),
        "non_stop_penalty": lambda x, m: ppo_score(m, non_stop_penalty=x) if m is ppo else grpo_score(
            grpo, non_stop_penalty=x),  # (online_dpo.py's: the same torch.where, then pairs ranked by it)
        "overlong_penalty_factor": lambda x, m: grpo_score(m, overlong_buffer_len=7, overlong_penalty_factor=x),
        "overlong_buffer_len": lambda x, m: grpo_score(m, overlong_buffer_len=x, generate_max_len=x + 1),
        "init_kl_coef": lambda x, m: kl_penalty(m, x),
        "kl_target": lambda x, m: [finite(m.adaptive_kl_coef(0.05, kl, x, 10000, 64)) for kl in (0.0, 0.1, -1e-3, 1e3)],
        "kl_horizon": lambda x, m: [finite(m.adaptive_kl_coef(0.05, kl, 0.1, x, 64)) for kl in (0.0, 0.1, 1e3)],
        "gamma": lambda x, m: finite(*m.compute_gae(torch.randn(4, 6), torch.randn(4, 6), torch.ones(4, 6), x, 0.95)),
        "lambd": lambda x, m: finite(*m.compute_gae(torch.randn(4, 6), torch.randn(4, 6), torch.ones(4, 6), 1.0, x)),
        "entropy_loss_coef": lambda x, m: weight(x),
        "aux_loss_coef": lambda x, m: weight(x),
        "nll_loss_coef": lambda x, m: weight(x),
        "beta": lambda x, m: dpo_losses(m, beta=x) if m is not distill else finite(
            distill.generalized_jsd_loss(torch.randn(3, 7) * 10, torch.randn(3, 7) * 10, beta=x)),
        "label_smoothing": lambda x, m: dpo_losses(m, label_smoothing=x),
        "learning_rate": lambda x, m: optimizer_steps(learning_rate=x),
        "critic_learning_rate": lambda x, m: optimizer_steps(learning_rate=x),
        "l2": lambda x, m: optimizer_steps(learning_rate=1.0, l2=x),
        "adam_betas": lambda x, m: optimizer_steps(learning_rate=1.0, adam_betas=x),
        "max_norm": lambda x, m: optimizer_steps(max_norm=x),
        "lr_warmup_ratio": lambda x, m: optimizer_steps(lr_warmup_ratio=x),
        "max_epochs": lambda x, m: lr_schedule(x),
        "num_episodes": lambda x, m: lr_schedule(x),
        "generate_max_len": lambda x, m: surrogate(grpo, loss_agg_mode="seq-mean-token-sum-norm",
                                                        generate_max_len=x),
        "seed": lambda x, m: common.set_seed(x),
        "lora_rank": lambda x, m: x and lora_adapters(lora_rank=x),
        "lora_alpha": lambda x, m: lora_adapters(lora_alpha=x),
        "lora_dropout": lambda x, m: lora_adapters(lora_dropout=x),
        "temperature": lambda x, m: sampling(m, model, tokenizer, temperature=x),
        "eval_temperature": lambda x, m: sampling(m, model, tokenizer, temperature=x),
        "top_p": lambda x, m: sampling(m, model, tokenizer, top_p=x),
        "remote_rm_timeout": lambda x, m: reward_server(m, timeout=x),
        "remote_rm_retry_wait": lambda x, m: reward_server(m, retry_wait=x),
        "remote_rm_retries": lambda x, m: reward_server(m, retries=x),
        "agent_timeout": lambda x, m: agent_timeout(x),
        "rollout_correction_bounds": lambda x, m: rollout_correction(x),
    }


def test_every_number_flag_works_at_its_extremes(tokenizer):
    """Both ends of every number flag's range (nargs 2: both values at once, and each end for both), parsed as given
    on the command line, then fed to what the flag feeds: finite numbers, no exception; or the flag is in
    EXTREME_SAFE. Each check runs once for a value shared by several scripts' copies of a function they share.
    Sampling runs on a tiny Llama whose logits reach +-30, as a trained model's do."""
    model = tiny_llama(len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                       bos_token_id=tokenizer.bos_token_id).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30 / model(torch.tensor([[1, 2, 3]])).logits.abs().max())
    checks, done, unclassified = extreme_checks(model, tokenizer), set(), []
    for script in EXTREME_SCRIPTS:
        module, flags = number_flags(script)
        for action, kind, lo, hi, lo_open, hi_open in flags:
            first, last = extreme_ends(kind, lo, hi, lo_open, hi_open)
            assert action.type(repr(first)) == first and action.type(repr(last)) == last, action.dest
            values = [(first, last), (first, first), (last, last)] if action.nargs == 2 else [first, last]
            if action.dest in EXTREME_SAFE:
                continue
            if action.dest not in checks:
                unclassified.append(f"{script}.py {action.option_strings[0]}")
                continue
            own = module if action.dest in ("eps_clip", "dual_clip", "value_clip", "beta", "label_smoothing",
                                            "non_stop_penalty", "init_kl_coef", "remote_rm_timeout",
                                            "remote_rm_retry_wait", "remote_rm_retries") else None  # its own function
            shared = "temperature" if action.dest == "eval_temperature" else action.dest  # the same sampling
            for x in values:
                if action.dest == "rollout_correction_bounds" and not x[0] <= 1 <= x[1]:
                    continue  # refused in one line (engines.check_rollout_correction)
                if action.dest == "reward_clip_range" and x[0] > x[1]:
                    continue  # refused in one line (ppo.py: need LO <= HI)
                if (shared, own, x) not in done:
                    try:
                        checks[action.dest](x, module)
                    except BaseException as e:
                        raise AssertionError(f"{script}.py {action.option_strings[0]} {x}: {e!r}") from e
                    done.add((shared, own, x))
    assert not unclassified, f"number flags neither checked at their extremes nor EXTREME_SAFE: {unclassified}"


def test_eps_clip_high_1e308_is_no_clip(policy, tmp_path):
    """The issue's case: --eps_clip_high 1e308 is parsed, and is no upper clip: the surrogate of ratios far above
    1 + eps equals -min(ratio A, max(ratio, 1 - eps_low) A), finite, in float32 and float64; a short run (two steps,
    the second sampling from the first's update) with it and the other clips at their extremes ends normally."""
    for dtype in (torch.float32, torch.float64):
        ratio = torch.tensor([[0.5, 1.0, 3.0, 1e30]], dtype=dtype)
        advantages = torch.tensor([[1.0, -1.0, 2.0, -0.5]], dtype=dtype)
        for loss_type in ("ppo", "cispo"):
            logprobs = ratio.log().requires_grad_()
            loss = grpo.token_policy_loss(logprobs, torch.zeros_like(ratio), advantages, eps_clip_low=0.2,
                                          eps_clip_high=1e308, policy_loss_type=loss_type)
            expected = -torch.min(ratio * advantages, ratio.clamp(min=0.8) * advantages) if loss_type == "ppo" \
                else -ratio * advantages * ratio.log()
            assert torch.allclose(loss, expected) and torch.isfinite(loss).all()
            loss.sum().backward()
            finite(logprobs.grad)
    proc = run_main("grpo.py", "--pretrain", policy, "--max_samples", 32, "--rollout_batch_size", 16,
                    "--n_samples_per_prompt", 2, "--train_batch_size", 32, "--micro_train_batch_size", 32,
                    "--generate_max_len", 4, "--eval_dataset", "", "--eps_clip_high", "1e308",
                    "--eps_clip_low", "1e308", "--dual_clip", "1e308", "--non_stop_penalty", -1e6,
                    "--learning_rate", 1e-3, "--logging_steps", 1, "--save_path", tmp_path / "g")
    assert "Traceback" not in proc.stderr and results(tmp_path / "g")["steps"] == 2
