"""common.py's tensor utilities vs naive float64 loops and closed forms; and its CPU allocator setting."""
import math
import os
import subprocess
import sys

import pytest
import torch

import common
from conftest import ROOT


def test_masked_mean_matches_loop_over_kept_entries():
    torch.manual_seed(0)
    x = torch.randn(4, 7, dtype=torch.float64)
    mask = torch.rand(4, 7) > 0.4
    mask[:, 0] = True  # every row and column keeps something
    mask[0, :] = True
    kept = [x[i, j].item() for i in range(4) for j in range(7) if mask[i, j]]
    assert abs(common.masked_mean(x, mask).item() - sum(kept) / len(kept)) < 1e-12
    for dim in (0, 1):  # the mean along `dim`, one value per index of the other dimension
        got = common.masked_mean(x, mask, dim)
        other = 1 - dim
        for k in range(x.size(other)):
            row = [x.select(other, k)[t].item() for t in range(x.size(dim)) if mask.select(other, k)[t]]
            assert abs(got[k].item() - sum(row) / len(row)) < 1e-12


@pytest.mark.parametrize("shift_mean", [True, False])
@pytest.mark.parametrize("across_ranks", [False, True])  # the RL scripts' batch whitening (a world of one here)
def test_masked_whiten_matches_loop(shift_mean, across_ranks):
    torch.manual_seed(1)
    x = torch.randn(3, 9, dtype=torch.float64) * 4 + 2
    mask = torch.rand(3, 9) > 0.3
    kept = [x[i, j].item() for i in range(3) for j in range(9) if mask[i, j]]
    mean = sum(kept) / len(kept)
    std = math.sqrt(sum((v - mean) ** 2 for v in kept) / len(kept) + 1e-8)
    got = common.masked_whiten(x, mask, shift_mean=shift_mean, across_ranks=across_ranks)
    for i in range(3):
        for j in range(9):
            want = ((x[i, j].item() - mean) / std + (0 if shift_mean else mean)) if mask[i, j] else 0.0
            assert abs(got[i, j].item() - want) < 1e-10
    if shift_mean:  # whitened: mean 0 and variance 1 over the kept entries
        assert abs(common.masked_mean(got, mask).item()) < 1e-10
        assert abs(common.masked_mean(got ** 2, mask).item() - 1) < 1e-6


def test_kl_estimators_closed_forms_and_k3_nonnegative():
    d = torch.linspace(-3, 3, 61, dtype=torch.float64)
    ref = torch.zeros_like(d)
    for i, v in enumerate(d.tolist()):
        assert abs(common.approx_kl(d, ref, "k1")[i].item() - v) < 1e-12
        assert abs(common.approx_kl(d, ref, "k2")[i].item() - v * v / 2) < 1e-12
        assert abs(common.approx_kl(d, ref, "k3")[i].item() - (math.exp(-v) - 1 + v)) < 1e-12
    assert (common.approx_kl(d, ref, "k3") >= 0).all()
    with pytest.raises(ValueError, match="k4"):
        common.approx_kl(d, ref, "k4")


def test_k1_and_k3_sample_means_equal_the_exact_kl():
    # samples x ~ p; KL(p || q) = sum p log(p/q); both estimators are unbiased for it
    g = torch.Generator().manual_seed(2)
    p = torch.softmax(torch.randn(6, generator=g, dtype=torch.float64), 0)
    q = torch.softmax(torch.randn(6, generator=g, dtype=torch.float64), 0)
    exact = sum(pi * math.log(pi / qi) for pi, qi in zip(p.tolist(), q.tolist()))
    x = torch.multinomial(p, 200_000, replacement=True, generator=g)
    for estimator in ("k1", "k3"):
        samples = common.approx_kl(p.log()[x], q.log()[x], estimator)
        stderr = samples.std().item() / math.sqrt(len(samples))
        assert abs(samples.mean().item() - exact) < 4 * stderr, (estimator, samples.mean().item(), exact)


FAULTS_OF_STEPS = """
import random, resource, sys, torch
sys.path.insert(0, sys.argv[1])
import common
if sys.argv[2] == "keep":
    common.keep_freed_memory()
rng = random.Random(0)

def step():  # activations kept for backward, a packed row's length varying step to step, then freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    n = rng.randrange(800, 1900)
    acts = [torch.empty(n, 1408).fill_(1.0) for _ in range(8)]
    del acts
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

print(sum([step() for _ in range(20)][10:]))  # after 10 steps of warm-up
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a glibc setting; other allocators differ")
def test_cpu_steps_reuse_freed_memory_without_page_faults():
    """After common.keep_freed_memory (init_distributed calls it on CPU) a step reuses the memory the last one
    freed; with glibc's default thresholds it faults most of its activations in again, page by page.
    The baseline pins those defaults (128 KB) through glibc's environment variables: left alone, glibc raises
    its thresholds the first time the process frees a large mapped block, and whether importing torch already
    did so varies from run to run (1 run in 4 here started with them raised: 8.9k faults instead of 124k)."""
    def faults(mode):  # in a fresh process: fresh allocator state
        env = dict(os.environ, **({"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
                                  if mode == "default" else {}))
        proc = subprocess.run([sys.executable, "-c", FAULTS_OF_STEPS, str(ROOT), mode], capture_output=True,
                              text=True, check=True, env=env)
        return int(proc.stdout.split()[-1])

    default, kept = faults("default"), faults("keep")
    assert default > 10 * 4096  # the cost removed (over 160 MB faulted in; measured 147k): it measures something
    assert kept < default / 20
