"""--torch_compile (speedups.compile_layers) on the CPU, through inductor (which builds C++ with the machine's gcc): the
compiled decoder layers give each sequence's eager logits in padded and packed rows of different lengths, with no new
graph per length; generate (its KV cache runs the layers eager) gives the eager tokens; sft.py trains with it under
ZeRO-2, packing and gradient checkpointing to the eager run's losses."""
import pytest
import torch
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM

import common
from conftest import logged, results, run_main, script_args

# inductor fuses and reorders float32 work (RMSNorm's reduction, SiLU times up): ~6e-7 apart on logits of size ~1
# after 4 layers here, and other CPUs round differently. A wrong position, mask or piece boundary moves them by > 1e-2.
ATOL = 1e-5


@pytest.fixture(autouse=True)
def fresh_compiler():
    """Dynamo's 8 compiles per function are shared by every model in the process: each test starts and ends empty."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def sequences(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 100, (n,), generator=g) for n in lengths]


def padded(model, seqs):
    """Right-padded batch -> each sequence's logits [n, V]."""
    ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = s, 1
    out = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    return [out[i, :len(s)] for i, s in enumerate(seqs)]


def packed(model, seqs):
    """One packed row, positions restarting per sequence -> each sequence's logits [n, V]."""
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    out = model(input_ids=torch.cat(seqs)[None], position_ids=pos, use_cache=False).logits[0]
    return list(out.split([len(s) for s in seqs]))


@torch.no_grad()
def test_compiled_layers_give_the_eager_logits_for_every_length(toy_world, tokenizer):
    path = toy_world / "model"
    eager = AutoModelForCausalLM.from_pretrained(path).eval()
    model = common.load_model(path, script_args(torch_compile=True, packing_samples=True), tokenizer).eval()
    alone = lambda seqs: [eager(input_ids=s[None]).logits[0] for s in seqs]  # noqa: E731  the reference
    # first shapes compile (a padded batch, a packed row: two graphs and the pieces' eager loop); later lengths reuse
    warm = sequences([5, 11, 3], 0)
    for layout in (padded, packed):
        for got, want in zip(layout(model, warm), alone(warm)):
            torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0
    for seed, lengths in enumerate([(7, 13, 2, 20), (1, 9), (30, 4, 4, 6, 12), (8, 17, 3)], 1):
        seqs = sequences(lengths, seed)
        for layout in (padded, packed):
            for got, want in zip(layout(model, seqs), alone(seqs)):
                torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
    assert counters["stats"]["unique_graphs"] == graphs  # dynamic shapes: no graph per length or batch size

    prompt = torch.tensor([[tokenizer.bos_token_id, *sequences([6], 9)[0].tolist()]])
    stock = eager.generate(prompt, do_sample=False, max_new_tokens=8, pad_token_id=tokenizer.pad_token_id)
    assert torch.equal(model.generate(prompt, do_sample=False, max_new_tokens=8, pad_token_id=tokenizer.pad_token_id),
                       stock)
    assert counters["stats"]["unique_graphs"] == graphs  # generate ran the layers eager


def test_sft_trains_compiled_as_eager(toy_world, tmp_path):
    """ZeRO-2, packing and gradient checkpointing (a checkpoint inside each compiled layer) combine with it. The
    losses match the eager padded run's; the weights are not compared: Adam's first step divides each gradient by
    its own size, so a gradient that is rounding noise takes a full step either way."""
    short = ["--max_samples", 32, "--train_batch_size", 16, "--micro_train_batch_size", 8, "--max_epochs", 1,
             "--eval_generate_samples", 0, "--logging_steps", 1]
    eager = run_main("sft.py", *short, "--save_path", tmp_path / "eager", cwd=tmp_path)
    graphs = counters["stats"]["unique_graphs"]
    compiled = run_main("sft.py", *short, "--torch_compile", "--zero_stage", 2, "--packing_samples",
                        "--gradient_checkpointing", "--save_path", tmp_path / "compiled", cwd=tmp_path)
    assert counters["stats"]["unique_graphs"] > graphs  # it did compile
    assert len(logged(compiled.stderr, "loss")) == 2
    assert logged(compiled.stderr, "loss") == pytest.approx(logged(eager.stderr, "loss"), abs=2e-3)  # 4 digits logged
    assert results(tmp_path / "compiled")["eval_loss"] == pytest.approx(results(tmp_path / "eager")["eval_loss"],
                                                                        abs=1e-4)
