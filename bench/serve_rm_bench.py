"""serve_rm.py against OpenRLHF's serve_rm, on the same reward model, under the same closed-loop load.

    .venv/bin/python bench/serve_rm_bench.py [--seconds 8] [--levels 1 4 16 64]

1. OpenRLHF 0.11.2 (with peft and pylatexenc, pinned below) is installed with --no-deps into
   bench/.openrlhf (pip --target) and put on PYTHONPATH of their server process only: .venv stays exactly
   requirements.txt. Their modules import flash_attn (GPU only) for code the server never runs;
   bench/openrlhf_shim.py stubs it.
2. The reward model: a random-init Llama (hidden 512, 6 layers, 20.5M parameters) as a stock
   LlamaForSequenceClassification with the toy tokenizer; texts of ~256 tokens.
3. Both servers on 127.0.0.1 with bf16 weights (their only choice on CPU besides fp16), sdpa attention,
   max_len 512. For each level of concurrent clients (alternating which server goes first), each client
   sends a request of 1-8 texts, waits for the answer and sends the next, for --seconds.
4. Prints req/s, texts/s, p50 and p99 latency per server and level, and ours/theirs; writes
   bench/results/serve_rm.json. The machine is shared and noisy: compare within one run.
"""

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SIDE = HERE / ".openrlhf"
THEIRS = ["openrlhf==0.11.2", "peft==0.21.2", "pylatexenc==2.11"]


def install_theirs():
    if (SIDE / "openrlhf").is_dir():
        return
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(SIDE), *THEIRS],
                   check=True)


def build_model(path):
    """20.5M-parameter Llama classifier, random init, toy tokenizer (saved once)."""
    if (path / "config.json").exists():
        return
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    sys.path.insert(0, str(ROOT))
    import toy

    tok = AutoTokenizer.from_pretrained(toy.ensure_toy_world() / "model")
    config = LlamaConfig(vocab_size=len(tok), hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=1024, num_labels=1,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config)
    print(f"reward model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
    model.save_pretrained(path)
    tok.save_pretrained(path)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(name, model, log, extra=()):
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if name == "ours":
        cmd = [sys.executable, str(ROOT / "serve_rm.py"), "--reward_pretrain", str(model), "--bf16",
               "--max_len", "512", "--port", str(port), *extra]
    else:
        env["PYTHONPATH"] = str(SIDE)
        cmd = [sys.executable, str(HERE / "openrlhf_shim.py"), "--reward.model_name_or_path", str(model),
               "--ds.param_dtype", "bf16", "--ds.attn_implementation", "sdpa", "--data.max_len", "512",
               "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/get_reward"
    deadline = time.time() + 300
    while time.time() < deadline:  # ready when it scores a text (theirs has no /health)
        try:
            if httpx.post(url, json={"query": ["1+1=2"]}, timeout=30).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"{name} server exited; see {log.name}")
        time.sleep(0.5)
    raise SystemExit(f"{name} server did not start; see {log.name}")


def text(rng):
    """~256 characters (= tokens here) of arithmetic-looking text."""
    parts = []
    while sum(map(len, parts)) < rng.randint(200, 300):
        a, b = rng.randrange(100), rng.randrange(100)
        parts.append(f"{a:02d}+{b:02d}={a + b} ")
    return "".join(parts)


async def closed_loop(url, clients, seconds, seed):
    """`clients` tasks, each: send 1-8 texts, wait, repeat until the time is up. -> stats."""
    latencies, texts = [], 0

    async def client(i, http):
        nonlocal texts
        rng = random.Random(seed * 1000 + i)
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            batch = [text(rng) for _ in range(rng.randint(1, 8))]
            t = time.perf_counter()
            r = await http.post(url, json={"query": batch, "prompts": [""] * len(batch)}, timeout=300)
            r.raise_for_status()
            latencies.append(time.perf_counter() - t)
            texts += len(batch)

    start = time.perf_counter()
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=clients)) as http:
        await asyncio.gather(*[client(i, http) for i in range(clients)])
    wall = time.perf_counter() - start
    latencies.sort()
    return {"req_s": len(latencies) / wall, "texts_s": texts / wall, "p50_ms": 1000 * latencies[len(latencies) // 2],
            "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
            "requests": len(latencies)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=8.0, help="per server and level")
    p.add_argument("--levels", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--ours_args", default="", help="extra serve_rm.py flags, e.g. '--max_batch_tokens 4096'")
    args = p.parse_args()
    install_theirs()
    model = HERE / ".cache" / "rm_20m"
    build_model(model)
    (HERE / "results").mkdir(exist_ok=True)
    servers = {}
    try:
        for name in ("ours", "theirs"):
            servers[name] = start(name, model, open(HERE / "results" / f"serve_rm_{name}.log", "w"),
                                  args.ours_args.split() if name == "ours" else ())
        same = [text(random.Random(7)) for _ in range(4)]
        rewards = {n: httpx.post(u, json={"query": same}, timeout=60).json()["rewards"] for n, (_, u) in servers.items()}
        results = {"levels": {}, "reward_gap_same_texts": max(abs(a - b) for a, b in zip(*rewards.values()))}
        # the two directions of compatibility: our RL scripts' client against their server, and the
        # payload their trainer sends (query/prompts/labels, pad and eos around the texts) against ours
        sys.path.insert(0, str(ROOT))
        import grpo

        got = grpo.reward_client(servers["theirs"][1])(same, [""] * 4, [None] * 4)["rewards"]
        assert max(abs(a - b) for a, b in zip(got.tolist(), rewards["theirs"])) < 1e-3, "our client vs theirs"
        padded = ["<pad><pad>" + t + "</s><pad>" for t in same]
        r = httpx.post(servers["ours"][1], json={"query": padded, "prompts": [""] * 4, "labels": [None] * 4}).json()
        assert max(abs(a - b) for a, b in zip(r["scores"], rewards["ours"])) < 1e-3, "their payload vs ours"
        for k, clients in enumerate(args.levels):
            order = ["ours", "theirs"] if k % 2 == 0 else ["theirs", "ours"]  # drift hits both alike
            level = {}
            for name in order:
                asyncio.run(closed_loop(servers[name][1], clients, 1.0, seed=99))  # warm-up
                level[name] = asyncio.run(closed_loop(servers[name][1], clients, args.seconds, seed=k))
            results["levels"][clients] = level
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=60)
    print(f"\nserve_rm: ours vs OpenRLHF 0.11.2, 20.5M-param RM, bf16, ~256-token texts, 1-8 per request, "
          f"{os.cpu_count()} CPU cores, {args.seconds:g} s per point")
    print(f"{'clients':>7} | {'ours req/s':>10} {'texts/s':>8} {'p50 ms':>7} {'p99 ms':>7} | "
          f"{'theirs req/s':>12} {'texts/s':>8} {'p50 ms':>7} {'p99 ms':>7} | {'texts/s ratio':>13} {'p99 ratio':>9}")
    for clients, level in results["levels"].items():
        o, t = level["ours"], level["theirs"]
        level["ratio_texts_s"], level["ratio_p99"] = o["texts_s"] / t["texts_s"], o["p99_ms"] / t["p99_ms"]
        print(f"{clients:>7} | {o['req_s']:>10.2f} {o['texts_s']:>8.1f} {o['p50_ms']:>7.0f} {o['p99_ms']:>7.0f} | "
              f"{t['req_s']:>12.2f} {t['texts_s']:>8.1f} {t['p50_ms']:>7.0f} {t['p99_ms']:>7.0f} | "
              f"{level['ratio_texts_s']:>13.2f} {level['ratio_p99']:>9.2f}")
    print(f"max |reward ours - theirs| on 4 identical texts: {results['reward_gap_same_texts']:.3g} "
          "(they tokenize without BOS; same model otherwise)")
    (HERE / "results" / "serve_rm.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
