"""Merge a LoRA adapter (what the scripts save with --lora_rank) into its base model: a full Hugging Face
directory that stock from_pretrained classes load, for serving, vLLM or the next stage.

    python merge_lora.py --model_path runs/sft_start --lora_path runs/sft_lora --output_path runs/sft_merged
    python merge_lora.py --model_path runs/sft --lora_path runs/rm_lora --output_path runs/rm_merged --is_rm

--model_path must be the model the adapter was trained from. A reward model (--is_rm) keeps its trained
`score` head and the reward mean/std that rm.py stored.
"""

import argparse
import json
import warnings
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

import common


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.error = common.fail  # one line, not the usage block
    p.add_argument("--model_path", required=True, help="the base model the adapter was trained on")
    p.add_argument("--lora_path", required=True, help="the directory a script saved with --lora_rank")
    p.add_argument("--output_path", required=True)
    p.add_argument("--is_rm", action="store_true", help="a reward model or critic (sequence classifier)")
    p.add_argument("--bf16", action="store_true", help="write bfloat16 weights (the merge itself is in float32)")
    p.add_argument("--trust_remote_code", action="store_true")
    common.quiet_libraries()
    args = p.parse_args()
    adapter_config = Path(args.lora_path) / "adapter_config.json"
    if not adapter_config.is_file():
        common.fail(f"{args.lora_path} holds no LoRA adapter (adapter_config.json is missing)")
    has_head = "score" in (json.loads(adapter_config.read_text()).get("modules_to_save") or [])
    if has_head != args.is_rm:
        common.fail(f"{args.lora_path} was trained as a {'reward model' if has_head else 'causal LM'}: "
                    f"{'add' if has_head else 'drop'} --is_rm")
    from peft import PeftModel

    # The base loads as training loaded it (added tokens included), in float32 so the merge adds exactly.
    load_args = argparse.Namespace(bf16=False, flash_attn=False, load_in_4bit=False,
                                   trust_remote_code=args.trust_remote_code)
    tokenizer = common.load_tokenizer(args.lora_path, load_args)  # saved with the adapter
    kwargs = dict(model_class=AutoModelForSequenceClassification, num_labels=1, new_head=True) if args.is_rm else \
        dict(model_class=AutoModelForCausalLM)
    base = common.load_model(args.model_path, load_args, tokenizer, trainable=False, **kwargs)
    with warnings.catch_warnings():  # peft 0.21 reads transformers 5's deprecated alias; nothing of ours to change
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        model = PeftModel.from_pretrained(base, args.lora_path).merge_and_unload()
    extra_file = Path(args.lora_path) / "extra_config.json"  # rm.py's reward mean/std
    extra = json.loads(extra_file.read_text()) if extra_file.is_file() else {}
    if args.bf16:
        model = model.to(torch.bfloat16)
    common.write_hf_dir(model, tokenizer, args.output_path, extra_config=extra)
    common.console.print(f"merged {args.lora_path} into {args.model_path}: saved to {args.output_path}")


if __name__ == "__main__":
    main()
