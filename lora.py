"""What --lora_rank and --load_in_4bit turn on (peft; bitsandbytes): LoRA adapters on a trained model, and QLoRA's
4-bit base under them. common.load_model calls in here only when one of the flags is given; merge_lora.py merges a
saved adapter into its base, and engines.merged_weights hands vLLM the merged weights. Importing this module only
defines things."""

import torch
import transformers

from common import fail


def check_options(args):
    """The flags that only make sense together (common.parse_args calls this when --load_in_4bit is given)."""
    if not args.lora_rank:
        fail("--load_in_4bit freezes the 4-bit base weights: it trains only with LoRA adapters (--lora_rank)")
    if args.zero_stage == 3:
        fail("--load_in_4bit cannot be partitioned by ZeRO-3: use --zero_stage 0, 1 or 2")


def four_bit_config():
    """--load_in_4bit: from_pretrained's quantization_config for QLoRA's base, NF4 with double quantisation and bf16
    compute (bitsandbytes, CUDA only)."""
    if not torch.cuda.is_available():
        fail("--load_in_4bit needs bitsandbytes on a CUDA GPU, and this machine has none")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        fail("--load_in_4bit needs the bitsandbytes package: pip install bitsandbytes")
    return transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                           bnb_4bit_compute_dtype=torch.bfloat16)


def add_adapters(model, args):
    """--lora_rank: adapters of that rank on --target_modules (a classifier's `score` head stays fully trainable);
    only they train. On a 4-bit base the norms go to fp32 and the inputs carry gradients into the adapters."""
    from peft import LoraConfig, prepare_model_for_kbit_training

    if args.load_in_4bit:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=args.gradient_checkpointing)
    targets = args.target_modules[0] if args.target_modules == ["all-linear"] else args.target_modules
    try:
        model.add_adapter(LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                                     target_modules=targets,
                                     modules_to_save=["score"] if hasattr(model, "score") else None))
    except ValueError as e:
        fail(f"--target_modules {' '.join(args.target_modules)}: {str(e).splitlines()[0]}")
    return model
