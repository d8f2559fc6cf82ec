"""Stand-ins for the checkpoints people actually use, built offline: each family's special-token layout, its
official chat template and a generation_config.json with the sampling fields it ships, over a small byte-level
(or sentencepiece-style) BPE vocabulary trained here and a tiny random model of the family's architecture.

    qwen25_instruct  no BOS, eos <|im_end|>, pad <|endoftext|>, ChatML; samples at T 0.7, top_k 20, top_p 0.8,
                     repetition_penalty 1.05, stops at [<|im_end|>, <|endoftext|>]   (Qwen2ForCausalLM)
    qwen25_base      the same vocabulary and template, eos = pad = <|endoftext|>; greedy, max_new_tokens 2048
    llama3_instruct  BOS <|begin_of_text|>, eos <|eot_id|>, no pad; Llama 3's template; T 0.6, top_p 0.9,
                     stops at [<|end_of_text|>, <|eot_id|>]                             (LlamaForCausalLM)
    mistral          Llama-2/Mistral: sentencepiece-style "▁" words, BOS <s>, eos </s>, unk, no pad;
                     Mistral-Instruct's [INST] template; Llama-2-chat's T 0.6, top_p 0.9 (LlamaForCausalLM)
    gpt2             bos = eos = unk = <|endoftext|>, no pad, no chat template; top_k 50, no_repeat_ngram 3
                                                                                     (GPTNeoXForCausalLM)
The layouts and configs are what matter; the vocabularies are tiny, so these models know nothing."""
import json
import string
from pathlib import Path

QWEN_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim "
    "+ '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+")
LLAMA3_SPLIT = QWEN_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")

FAMILIES = ["qwen25_instruct", "qwen25_base", "llama3_instruct", "mistral", "gpt2"]


def corpus():
    """Text the vocabularies are trained on: sums, steps with Math-Shepherd's placeholder, chat words."""
    lines = []
    for a in range(0, 100, 3):
        for b in range(0, 100, 7):
            lines += [f"{a:02d}+{b:02d}={a + b}", f"Step 1: {a}+{b}={a + b} ки\nStep 2: done ки",
                      f"{a}+{b}={a + b}ки {a} ки{b}"]
    lines += ["You are Qwen, created by Alibaba Cloud. You are a helpful assistant.", "system user assistant",
              "Sure: 42. Hi there, what is the sum? The answer is + or - and nothing else.",
              " ".join(string.printable.strip()), "".join(string.printable.strip())] * 20
    return lines


def build_tokenizer(family):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if family == "mistral":
        specials = ["<unk>", "<s>", "</s>"]
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
        trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=specials)
    else:
        specials = {"qwen25_instruct": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                    "llama3_instruct": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                        "<|end_header_id|>", "<|eot_id|>"],
                    "gpt2": ["<|endoftext|>"]}[family.replace("qwen25_base", "qwen25_instruct")]
        tok = Tokenizer(models.BPE())
        split = {"qwen25_instruct": QWEN_SPLIT, "qwen25_base": QWEN_SPLIT, "llama3_instruct": LLAMA3_SPLIT}.get(family)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False) if split is None else \
            pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        tok.normalizer = normalizers.NFC() if split else None
        trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=specials,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    if family in ("llama3_instruct", "mistral"):  # these prepend their BOS
        bos = specials[1] if family == "mistral" else specials[0]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    layout = {
        "qwen25_instruct": dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"),
        "qwen25_base": dict(eos_token="<|endoftext|>", pad_token="<|endoftext|>"),
        "llama3_instruct": dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"),
        "mistral": dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>"),
        "gpt2": dict(bos_token="<|endoftext|>", eos_token="<|endoftext|>", unk_token="<|endoftext|>"),
    }[family]
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=4096, **layout)
    hf.chat_template = {"qwen25_instruct": QWEN_TEMPLATE, "qwen25_base": QWEN_TEMPLATE,
                        "llama3_instruct": LLAMA3_TEMPLATE, "mistral": MISTRAL_TEMPLATE}.get(family)
    return hf


def generation_config(family, tok):
    """The sampling fields each family's generation_config.json ships."""
    t = tok.convert_tokens_to_ids
    return {
        "qwen25_instruct": dict(bos_token_id=t("<|endoftext|>"), do_sample=True, eos_token_id=[t("<|im_end|>"),
                                t("<|endoftext|>")], pad_token_id=t("<|endoftext|>"), repetition_penalty=1.05,
                                temperature=0.7, top_p=0.8, top_k=20),
        "qwen25_base": dict(bos_token_id=t("<|endoftext|>"), do_sample=False, eos_token_id=t("<|endoftext|>"),
                            max_new_tokens=2048),
        "llama3_instruct": dict(bos_token_id=t("<|begin_of_text|>"), do_sample=True, temperature=0.6, top_p=0.9,
                                eos_token_id=[t("<|end_of_text|>"), t("<|eot_id|>")]),
        "mistral": dict(bos_token_id=t("<s>"), eos_token_id=t("</s>"), do_sample=True, temperature=0.6, top_p=0.9,
                        max_length=4096),
        "gpt2": dict(bos_token_id=t("<|endoftext|>"), eos_token_id=t("<|endoftext|>"), do_sample=True, top_k=50,
                     no_repeat_ngram_size=3),
    }[family]


def build_model(family, tok, seed=0):
    """A tiny random model of the family's architecture: hidden 64, two heads of 32 (vLLM on CPU needs >= 32)."""
    import torch
    from transformers import (GenerationConfig, GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM,
                              Qwen2Config, Qwen2ForCausalLM)

    torch.manual_seed(seed)
    size = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=2, max_position_embeddings=512)
    specials = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if family.startswith("qwen"):
        model = Qwen2ForCausalLM(Qwen2Config(**size, num_key_value_heads=1, tie_word_embeddings=True, **specials))
    elif family == "gpt2":
        model = GPTNeoXForCausalLM(GPTNeoXConfig(**size, tie_word_embeddings=False, **specials))
    else:
        model = LlamaForCausalLM(LlamaConfig(**size, num_key_value_heads=2, tie_word_embeddings=False, **specials))
    model.generation_config = GenerationConfig(**generation_config(family, tok))
    return model


def build(family, root):
    """The family's checkpoint directory (tokenizer, model, generation_config.json) and small datasets."""
    import random

    root = Path(root)
    tok = build_tokenizer(family)
    tok.save_pretrained(root / "model")
    build_model(family, tok).save_pretrained(root / "model")
    rng = random.Random(0)
    pairs = [(rng.randrange(100), rng.randrange(100)) for _ in range(64)]
    records = {
        "sft": [{"input": f"{a}+{b}=", "output": str(a + b)} for a, b in pairs],
        "prefs": [{"input": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)} for a, b in pairs],
        # Math-Shepherd's raw form: the label is the input with each placeholder replaced by its reward token
        "prm": [{"input": f"{a}+{b}+1\nStep 1: {a}+{b}={a + b} ки\nStep 2: {a + b}+1={a + b + k} ки",
                 "label": f"{a}+{b}+1\nStep 1: {a}+{b}={a + b} +\nStep 2: {a + b}+1={a + b + k} {'+-'[k - 1]}"}
                for (a, b), k in zip(pairs, [1, 2] * 32)],
        "prompts": [{"input": f"{a}+{b}=", "label": str(a + b)} for a, b in pairs],
    }
    for name, rows in records.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return root
