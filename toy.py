"""The toy world: a tiny random-init Llama, a character tokenizer and arithmetic datasets, built locally.

Every script trains on it when run with no arguments, so the whole pipeline runs on a laptop CPU
with nothing downloaded. The task is two-digit addition ("07+45=" -> "52"): small enough that SFT
learns it in a minute on 2 cores, hard enough that RL has something left to improve. Process reward
models get running sums solved step by step ("07+45+08" -> "07+45=52", "52+08=60"): a policy is first
fine-tuned to write such solutions (steps_*), and the PRM, started from it, learns to judge them (prm_*).
A PRM trained from the random-init model stays near the majority class: checking a copied number from
binary labels alone is out of its reach in minutes, which is why PRMs start from a capable LM.

    python toy.py            # builds ./toy_world (idempotent) and prints what is there

Layout of toy_world/:
    model/                      tokenizer + LlamaForCausalLM, random init (save_pretrained)
    model_half/                 the same with half the layers (2): a smaller student for distill.py
    sft_{train,test}.jsonl      {"input": "07+45=", "output": "52"}
    sft_sloppy_train.jsonl      the same sums as a careless labeller writes them: one with a carry four times, three
                                times with the carry forgotten ("42") and once right (the RL stages' start: `sloppy`)
    pref_{train,test}.jsonl     {"input": "07+45=", "chosen": "52", "rejected": "53"}
    steps_{train,test}.jsonl    {"input": "07+45+08\n", "output": "07+45=52\n52+08=60"}  (running sums, step by step)
    steps_prompts_{train,test}.jsonl {"input": "07+45+08\n", "label": "60"}  (their RL prompts: the final total)
    prm_{train,test}.jsonl      {"input": "07+45+08\n07+45=52 ки\n25+08=33 ки", "label": ["+", "-"]}
    prompts_{train,test}.jsonl  {"input": "07+45=", "label": "52"}       (RL prompts; reward_func below scores them)
    tool_{train,test}.jsonl     {"input": "07+x=", "label": "45"}        (the tool task's prompts: toy_agent.py knows x)
    tool_sft_{train,test}.jsonl {"input": "07+x=", "output": "?"} or a guess ("31"), and
                                {"input": "07+x=?</s>\n07+45=", "output": "52"}  (its first and second turns)
    plain_chat.jinja            a chat template writing the turns' contents one after another, each reply closed by
                                EOS: the tool task's format, for toy_chat_agent.py (--agent_server)
"""

import fcntl
import json
import os
import random
import re
import shutil
import string
import sys
import tempfile
from pathlib import Path

TOY_DIR = Path(__file__).resolve().parent / "toy_world"  # (unless $TOY_WORLD_DIR says, read when a world is wanted)
VERSION = "9"  # bump when the generator changes, so stale worlds get rebuilt (9: sft_sloppy_train.jsonl)
PLACEHOLDER = "ки"  # step marker for PRM data (Math-Shepherd's), one token in the toy tokenizer
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]  # the tokenizer's special tokens, in vocabulary order
N_TEST = 500  # held-out prompts; the other 9,500 of the 10,000 "ab+cd=" prompts are for training

# A chat template for --apply_chat_template. Plain "Q:"/"A:" turns keep it readable at character level.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}S:{{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}Q:{{ m['content'] }}\n"
    "{% else %}A:{{ m['content'] }}{{ eos_token }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
)
# toy_world/plain_chat.jinja: no markup, so chat messages render as the tool task's plain turns ("07+x=?</s>\n07+45=")
PLAIN_CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['content'] }}"
                       "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}")


def build_tokenizer():
    """Character-level tokenizer over printable ASCII, with <s>, </s>, <pad> (distinct from eos), <unk>."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    vocab = {t: i for i, t in enumerate(SPECIALS + chars + [PLACEHOLDER])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one char, one token
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    tok.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
        model_max_length=512,
    )
    hf.add_tokens([PLACEHOLDER])  # matched before pre-tokenization, so the two letters stay one token
    hf.chat_template = CHAT_TEMPLATE
    return hf


def build_model(tokenizer, seed=0, layers=4):
    """~0.85M-parameter Llama: hidden 128, 4 layers, 4 heads, tied embeddings (calibrated in STACK.md)."""
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    if not torch.cuda.is_available():  # save_pretrained imports DeepSpeed: its CPU accelerator, named (as in common.py)
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # rather than guessed with a warning
    transformers.logging.disable_progress_bar()  # no "Writing model shards" bar for a 4 MB file
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=512, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def wrong_sum(a, b, rng):
    """A plausible wrong answer: an off-by-one, a dropped or doubled carry, or swapped digits."""
    s = a + b
    candidates = {s + 1, s - 1, s + 10, s - 10, s + 2, s - 2, int(str(s)[::-1])}
    candidates.discard(s)
    return str(rng.choice(sorted(c for c in candidates if c >= 0)))


def misread(n, rng):
    """A plausible slip when copying a two-digit number: swapped digits or one digit off by one."""
    tens, ones = divmod(n, 10)
    candidates = {ones * 10 + tens, n + 1, n - 1, n + 10, n - 10}
    return rng.choice(sorted(c for c in candidates if 0 <= c <= 99 and c != n))


def running_sum_terms(rng):
    """2-4 steps of two-digit terms whose running total stays below 90, leaving room for a slip."""
    n_steps, final = rng.randint(2, 4), rng.randint(10, 89)
    cuts = sorted(rng.randint(0, final) for _ in range(n_steps))
    return [b - a for a, b in zip([0] + cuts, cuts + [final])]


def steps_example(terms):
    """A running-sum problem and its step-by-step solution, one step per line, every number two digits."""
    lines, total = [], terms[0]
    for t in terms[1:]:
        lines.append(f"{total:02d}+{t:02d}={total + t:02d}")
        total += t
    return {"input": "+".join(f"{t:02d}" for t in terms) + "\n", "output": "\n".join(lines)}


def prm_example(terms, rng):
    """A running-sum solution with a placeholder after every step. With prob 1/2 a step after the first
    starts from a misread carried total (`misread`) and the error carries on to the end; every line's
    own sum is right. Labels are "+" up to the wrong step and "-" from it on (Math-Shepherd style).
    Wrong sums are not used: started from the steps policy, the toy PRM learns to spot misread totals
    (100% of held-out steps after 6 epochs) but stayed near the majority class with wrong sums mixed in."""
    n_steps, final = len(terms) - 1, sum(terms)
    first_error = rng.randrange(1, n_steps) if rng.random() < 0.5 else None
    lines, labels, total = [], [], terms[0]
    for i, t in enumerate(terms[1:]):
        if i == first_error:
            right, total = total, 100
            while total + final - right > 99:  # the rest of the solution must stay in two digits
                total = misread(right, rng)
        lines.append(f"{total:02d}+{t:02d}={total + t:02d} {PLACEHOLDER}")
        labels.append("-" if first_error is not None and i >= first_error else "+")
        total += t
    return {"input": "+".join(f"{t:02d}" for t in terms) + "\n" + "\n".join(lines), "label": labels}


def build_datasets(rng):
    pairs = [(a, b) for a in range(100) for b in range(100)]
    rng.shuffle(pairs)
    splits = {"train": pairs[N_TEST:], "test": pairs[:N_TEST]}
    data = {}
    for split, ps in splits.items():
        prompts = [(f"{a:02d}+{b:02d}=", str(a + b), a, b) for a, b in ps]
        data[f"sft_{split}"] = [{"input": p, "output": s} for p, s, _, _ in prompts]
        if split == "train":
            data["sft_sloppy_train"] = [r for p, _, a, b in prompts for r in sloppy(p, a, b)]
        data[f"pref_{split}"] = [
            {"input": p, "chosen": s, "rejected": wrong_sum(a, b, rng)} for p, s, a, b in prompts
        ]
        data[f"prompts_{split}"] = [{"input": p, "label": s} for p, s, _, _ in prompts]
        # the PRM judges solutions to the policy's own problems (as Math-Shepherd's rollouts do); the
        # held-out problems are new to both
        problems = [running_sum_terms(rng) for _ in range(len(ps))]
        data[f"steps_{split}"] = [steps_example(terms) for terms in problems]
        data[f"prm_{split}"] = [prm_example(terms, rng) for terms in problems]
        data[f"steps_prompts_{split}"] = [{"input": steps_example(terms)["input"], "label": f"{sum(terms):02d}"}
                                          for terms in problems]
    tool = random.Random(1)  # a stream of its own: the datasets above stay as they were
    for split, ps in splits.items():
        data[f"tool_{split}"] = [{"input": f"{a:02d}+x=", "label": f"{b:02d}"} for a, b in ps]
        data[f"tool_sft_{split}"] = [r for a, b in ps for r in tool_sft_examples(a, b, tool)]
    return data


def sloppy(prompt, a, b):
    """A careless labeller's answers to one sum, for the RL stages' start (demo.py's SFT start): a sum with a carry
    ("07+45=") four times, three with the carry forgotten ("42") and once right; any other once, right. SFT to its
    plateau imitates the labeller: greedy forgets every carry, so held-out exact match is about the share of sums
    without one (57.6% of the 500) at any seed or rounding, while sampling writes the right sum a quarter of the time:
    what RL, rewarded by the true rule, has to find and make the policy's first choice."""
    if a % 10 + b % 10 < 10:
        return [{"input": prompt, "output": str(a + b)}]
    return [{"input": prompt, "output": str(out)} for out in (a + b - 10, a + b, a + b - 10, a + b - 10)]


def tool_sft_examples(a, b, rng, ask=0.3):
    """The tool task's SFT data (toy_agent.py is the environment): "07+x=" hides its second operand. The first
    action asks ("?") with probability `ask`, else guesses a sum; and what follows the environment's answer is the
    sum. A policy trained on this asks sometimes and guesses mostly: RL is to find out that asking pays."""
    first = "?" if rng.random() < ask else str(a + rng.randrange(100))
    return [{"input": f"{a:02d}+x=", "output": first},
            {"input": f"{a:02d}+x=?</s>\n{a:02d}+{b:02d}=", "output": str(a + b)}]


def reward_func(queries, prompts, labels):
    """The toy task's rule reward, grpo.py's default --remote_rm_url (so this file doubles as an example
    reward function): 1.0 when the completion's answer is the label (the sum), else 0.0, also logged as
    accuracy. The answer is the whole completion for an addition ("07+45=" -> "52"), and for a running sum (its
    prompt ends in a newline) the number after the last "=" (the outcome; the steps before it are not checked).
    queries are prompt + completion as the policy saw them, special tokens included ("<s>12+34=46</s>"):
    the completion is what follows the prompt, read without them."""
    completions = [re.sub("|".join(map(re.escape, SPECIALS)), "", q[len(p):]).strip() for q, p in zip(queries, prompts)]
    answers = [c.rsplit("=", 1)[-1] if p.endswith("\n") else c for c, p in zip(completions, prompts)]
    correct = [float(a == str(label)) for a, label in zip(answers, labels)]
    return {"rewards": correct, "scores": correct, "extra_logs": {"accuracy": correct}}


def is_current(path):
    return (path / "VERSION").is_file() and (path / "VERSION").read_text() == VERSION


def ensure_toy_world(path=None):
    """Build the toy world at `path` (default: $TOY_WORLD_DIR as it is now, else ./toy_world beside this file) unless an
    up-to-date one is there; return the path.
    Concurrent callers (every rank of every node that shares the directory) take turns on a lock file beside it: the
    first builds (in a temporary directory, renamed into place, so a crash leaves no half world), the others find it
    built. Without the lock a caller could remove a stale world just as another renamed the fresh one in."""
    path = Path(path or os.environ.get("TOY_WORLD_DIR", TOY_DIR))
    if is_current(path):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if is_current(path):  # built while this caller waited
            return path
        tmp = Path(tempfile.mkdtemp(prefix=".toy_world-", dir=path.parent))
        tmp.chmod(0o755)
        tokenizer = build_tokenizer()
        for name, layers in (("model", 4), ("model_half", 2)):
            tokenizer.save_pretrained(tmp / name)
            build_model(tokenizer, layers=layers).save_pretrained(tmp / name)
        for name, records in build_datasets(random.Random(0)).items():
            with open(tmp / f"{name}.jsonl", "w") as f:
                f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        (tmp / "plain_chat.jinja").write_text(PLAIN_CHAT_TEMPLATE)
        (tmp / "VERSION").write_text(VERSION)
        umask = os.umask(0)
        os.umask(umask)
        for f in tmp.rglob("*"):  # the usual modes: save_pretrained writes its weights 0600
            if f.is_file():
                f.chmod(0o666 & ~umask)
        if path.exists() and not is_current(path):
            shutil.rmtree(path, ignore_errors=True)  # a stale or half-written world
        try:
            os.rename(tmp, path)
        except OSError:  # built meanwhile by a process the lock does not reach (flock local to a node on some NFS)
            shutil.rmtree(tmp, ignore_errors=True)
    return path


if __name__ == "__main__":
    root = ensure_toy_world(sys.argv[1] if len(sys.argv) > 1 else None)
    for f in sorted(root.glob("*.jsonl")):
        print(f"{f.name:24s} {sum(1 for _ in open(f)):6d} records   e.g. {open(f).readline().strip()}")
    print(f"model/ at {root / 'model'}")
