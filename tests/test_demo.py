"""The demo's pieces: the RL stages' start data (toy.sloppy), the curves it reads from a stage's log, its picture, the
health check against the seeds' ranges, and the README's figures against bench/results/toy_seeds.json."""

import json
import re
import statistics

import pytest

from conftest import ROOT, results, run_main

import demo
import toy


def test_sloppy_start_data_forgets_three_carries_in_four(toy_world):
    rows = [json.loads(line) for line in open(toy_world / "sft_sloppy_train.jsonl")]
    answers = {}
    for row in rows:
        answers.setdefault(row["input"], []).append(int(row["output"]))
    truth = {r["input"]: int(r["output"]) for r in map(json.loads, open(toy_world / "sft_train.jsonl"))}
    assert answers.keys() == truth.keys()
    for prompt, outs in answers.items():
        a, b = int(prompt[:2]), int(prompt[3:5])
        if (a % 10) + (b % 10) >= 10:  # a carry: right once, the carry forgotten (10 less) three times
            assert sorted(outs) == [truth[prompt] - 10] * 3 + [truth[prompt]], prompt
        else:
            assert outs == [truth[prompt]], prompt
    # the start's figure by construction: the held-out sums without a carry
    test = [json.loads(line)["input"] for line in open(toy_world / "sft_test.jsonl")]
    assert sum(int(p[1]) + int(p[4]) < 10 for p in test) == 288  # 57.6% of 500


LOG = """\x1b[2K\x1b[1Atrain step 10: loss=0.5
eval step 0: accuracy=0.576 reward=0.576
train step 50: loss=0.3\r\x1b[2Keval step 50: reward=0.7 accuracy=0.7123
eval step 100: accuracy=0.9
"""


def test_curve_reads_the_logged_evals():
    assert demo.curve(LOG, "accuracy") == [(0, 0.576), (50, 0.7123), (100, 0.9)]
    assert demo.curve(LOG, "exact_match") == []


def test_curve_of_a_real_run_ends_at_its_figures(policy, eval_file, tmp_path):
    """What demo.py reads from a stage's log: a real grpo.py run's evals, the first and last its eval_results.json's
    figures before and after training (logged to 4 significant digits)."""
    proc = run_main("grpo.py", "--pretrain", policy, "--eval_dataset", eval_file, "--max_samples", 64,
                    "--rollout_batch_size", 16, "--n_samples_per_prompt", 4, "--train_batch_size", 32,
                    "--micro_train_batch_size", 16, "--eval_steps", 2, "--save_path", tmp_path / "grpo")
    points, res = demo.curve(proc.stdout + proc.stderr, "accuracy"), results(tmp_path / "grpo")
    assert [step for step, _ in points] == [0, 2, 4]
    assert points[0][1] == pytest.approx(res["eval_accuracy_before"], rel=5e-4)
    assert points[-1][1] == pytest.approx(res["eval_accuracy"], rel=5e-4)


def test_plot_draws_the_logged_values(tmp_path):
    curves = {"GRPO": ("runs/sft_start", demo.curve(LOG, "accuracy")),
              "DPO": ("runs/sft_start", [(0, 0.576), (80, 0.8)]),
              "GRPO tool": ("runs/sft_tool", [(0, 0.05), (200, 0.3)])}
    ranges = {"GRPO": [0.88, 0.91, 0.9], "GRPO tool": [0.25, 0.35, 0.3]}
    fig = demo.plot(curves, ranges, tmp_path / "demo.png")
    assert (tmp_path / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    left, right = fig.axes
    lines = {line.get_label(): line for ax in (left, right) for line in ax.get_lines()}
    assert list(lines["GRPO"].get_xdata()) == [0, 50, 100]
    assert list(lines["GRPO"].get_ydata()) == pytest.approx([57.6, 71.23, 90.0])
    assert list(lines["DPO"].get_ydata()) == pytest.approx([57.6, 80.0])
    assert list(lines["GRPO tool"].get_xdata()) == [0, 200] and lines["GRPO tool"] in right.get_lines()
    assert list(lines["start 57.6%"].get_ydata()) == pytest.approx([57.6, 57.6])  # the start: a dashed line
    (bar,) = left.containers  # GRPO's range over seeds at its last step: 88 to 91 (DPO has none)
    (segment,) = bar.lines[2][0].get_segments()
    assert segment.flatten().tolist() == pytest.approx([100, 88.0, 100, 91.0])


def test_checked_marks_a_figure_outside_its_seeds():
    assert demo.checked(0.9, [0.88, 0.91]) == "yes" and demo.checked(0.88, [0.88, 0.91]) == "yes"
    assert "outside by -1.0 points" in demo.checked(0.87, [0.88, 0.91])
    assert "outside by +2.0 points" in demo.checked(0.93, [0.88, 0.91])


def fig(value):
    """'57.6 (57.6 to 57.6)' -> [mean, min, max]"""
    return [float(x) for x in re.findall(r"[-+]?\d+\.\d", value)]


def test_readme_figures_are_the_seeds_file():
    """README's seeds table and its demo figures are bench/results/toy_seeds.json's runs (the demo's start and RL
    stages run seed 0)."""
    stages = json.loads((ROOT / "bench/results/toy_seeds.json").read_text())["stages"]
    readme = (ROOT / "README.md").read_text()
    table = readme.split("<!-- bench/toy_seeds.py --table -->\n", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    assert {row.split(" | ")[0][2:] for row in table} == set(stages)
    for row in table:
        name, seeds, start, end, lift, seconds = (c.strip() for c in row.strip("|").split("|"))
        runs = [stages[name][s] for s in seeds.split(", ")]
        assert sorted(seeds.split(", ")) == sorted(stages[name])
        for text, values in ((end, [r["end"] for r in runs]),
                             (start, [r["start"] for r in runs] if runs[0]["start"] is not None else None),
                             (lift, [r["end"] - r["start"] for r in runs] if runs[0]["start"] is not None else None)):
            if values is None:
                assert text == "-"
                continue
            want = [100 * statistics.mean(values), 100 * min(values), 100 * max(values)]
            assert fig(text) == pytest.approx(want, abs=0.051), (name, text)
    demo_rows = readme.split("<!-- make demo -->\n", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    checked = 0
    for row in demo_rows:
        name, _, value = (c.strip() for c in row.strip("|").split("|")[:3])
        if name in stages and "0" in stages[name]:
            run = stages[name]["0"]
            want = [run["end"]] if run["start"] is None else [run["start"], run["end"]]
            assert [float(x) / 100 for x in re.findall(r"(\d+\.\d)%", value)][:len(want)] == \
                pytest.approx(want, abs=0.00051), name
            checked += 1
    assert checked >= 10  # the start and every RL stage of the demo
