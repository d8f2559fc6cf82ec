"""What --bf16 on a CPU, --flash_attn, --use_liger_kernel and --torch_compile change in how the model's math runs:
each checked here in one line before a run starts (a package, a GPU, a dtype missing) and applied to the model that
common.load_model loaded. common.py imports this module only where one of those flags is given; importing it only
defines things."""

import importlib.util
import os
import time
from pathlib import Path

import torch
import transformers

from common import console, fail


def before_load(args, zero3, attention):
    """The flags' checks before from_pretrained -> the attention implementation to load with."""
    if zero3 and getattr(args, "torch_compile", False):
        # tried on CPU: dynamo traces ZeRO-3's gather hooks on every submodule, recompiles until its limit, warns
        fail("--torch_compile does not combine with --zero_stage 3 (the compiler re-traces ZeRO-3's parameter "
             "gathering hooks in every layer until it gives up): use --zero_stage 2")
    if not args.flash_attn:
        return attention
    if not args.bf16:  # flash-attn has no fp32 kernels: every forward would raise
        fail("--flash_attn runs in bf16 only: add --bf16")
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        fail("--flash_attn needs the flash-attn package (GPU only): pip install flash-attn")
    return "flash_attention_2"


def after_load(model, args, trainable):
    """Liger's kernels patched into the model, then (a trainable model's) decoder layers compiled."""
    if getattr(args, "use_liger_kernel", False):  # serve_rm has no such flag
        use_liger_kernel(model)
    if trainable and getattr(args, "torch_compile", False):  # (frozen models stay eager: dynamo's budget of
        compile_layers(model)                                  # graphs per function is shared by every model)


def use_liger_kernel(model):
    """--use_liger_kernel: Liger's RMSNorm, SwiGLU and rotary kernels patched into the model. Not its (fused linear)
    cross-entropy: our losses read the final hidden states (common.forward_hidden) and make logits a chunk at a time.
    Its rotary kernel only applies the cos/sin the model computed from position_ids, one row per token: packed rows,
    whose positions restart per sequence, stay right."""
    missing = [what for what, here in (("the liger-kernel package", importlib.util.find_spec("liger_kernel")),
                                       ("Triton", importlib.util.find_spec("triton")),
                                       ("a CUDA GPU", torch.cuda.is_available())) if not here]
    if missing:
        fail(f"--use_liger_kernel: this machine lacks {', '.join(missing)} (Liger's kernels are Triton's, for CUDA "
             "GPUs; make venv-gpu installs liger-kernel, and the CUDA torch brings Triton)")
    from liger_kernel.transformers import _apply_liger_kernel_to_instance
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    if model.config.model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:  # Liger would only log it and patch nothing
        fail(f"--use_liger_kernel: liger-kernel has no kernels for {model.config.model_type} models")
    _apply_liger_kernel_to_instance(model=model, rms_norm=True, swiglu=True, rope=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False)


def compile_layers(model):
    """--torch_compile: each decoder layer compiled (dynamic shapes: one graph serves every layer and every row
    length, padded or packed); embeddings and our chunked losses stay eager. packed_sdpa reads a packed row's pieces
    on the host: the graph breaks there and that part runs as it is. Forwards with a KV cache (generate) run eager:
    its per-layer state costs a graph per layer and step, and once dynamo's 8 compiles per function are spent, the
    training forwards would run eager too."""
    layers = [m for m in model.get_decoder().modules()
              if isinstance(m, transformers.modeling_layers.GradientCheckpointingLayer)]  # every family's decoder layer
    if not layers:
        fail(f"--torch_compile: {type(model).__name__} has no transformers decoder layers to compile (remote code?)")
    for layer in layers:
        eager, compiled = layer.forward, torch.compile(layer.forward, dynamic=True)
        layer.forward = lambda *args, eager=eager, compiled=compiled, **kwargs: (
            eager if kwargs.get("past_key_values") is not None else compiled)(*args, **kwargs)


def cpu_has_native_bf16(cpuinfo="/proc/cpuinfo"):
    """Whether this CPU multiplies bf16 in hardware (x86 avx512_bf16 or AMX, Arm's bf16). Without it PyTorch
    emulates bf16 matmul: on an AVX2-only EPYC 1 GFLOP/s against 160 for fp32."""
    try:
        cpuinfo = Path(cpuinfo).read_text()
    except OSError:  # not Linux: ask oneDNN
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    flags = {f for line in cpuinfo.splitlines() if line.startswith(("flags", "Features")) for f in line.split()}
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def warn_if_slow_bf16():
    """--bf16 on a CPU that emulates it: say what that costs here (one line) and keep bf16, as asked."""
    if torch.cuda.is_available() or os.environ.get("RANK", "0") != "0" or cpu_has_native_bf16():
        return  # (before init_distributed: the launcher's RANK says who prints)
    speed = {}
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(256, 256, dtype=dtype)
        x @ x  # warm up
        t0 = time.perf_counter()
        for _ in range(3):
            x @ x
        speed[dtype] = 3 * 2 * 256**3 / (time.perf_counter() - t0) / 1e9
    console.print(f"warning: --bf16 on a CPU without native bf16 matmul (no avx512_bf16/amx_bf16): bf16 matmul "
                  f"ran at {speed[torch.bfloat16]:.1f} GFLOP/s here against {speed[torch.float32]:.0f} for fp32 "
                  f"({speed[torch.float32] / speed[torch.bfloat16]:.1f}x the time); drop --bf16 to run in fp32",
                  markup=False)
