"""Non-finite decoded weights (issue 34): the reference FP8, NVFP4 (compressed-tensors and ModelOpt),
MXFP4 and GGUF checkpoints with one scale set to a value at or past the edge of what decodes (a global
scale of 0, 1e-30, inf, NaN or below 0; e4m3 group scales at their extremes; an E8M0 exponent of 0 or
254; a GGUF block scale of NaN or inf), run through every verb that reads it.

Whatever a run decides, the contract of the hostile-input sweep holds (sweep_cases.check_contract: a
documented exit code, one `qconv: error:` line naming the file and the module, no traceback and no
numpy / torch RuntimeWarning on stderr; SRC unchanged; no DST and no litter after a failure). A source
whose weights, decoded as the format defines them in float32, are not finite is refused by every verb.
An exit 0 is checked against this file's own decoding of the mutated files (torch's float8 and the
formats' formulas, not qconv's): a float32 dequantization equals it, every value of every output is
finite (GGUF outputs read by gguf-py), and a GGUF module qconv reports as requantized has, read back by
gguf-py, exactly the error the report gives against it."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import CHECKPOINTS
from sweep_cases import check_contract, fixture_copy, litter, run_inprocess, snapshot, strict_json

ST = "model.safetensors"
V = "model.layers.0.self_attn.v_proj"       # not one of the q / k rows llama.cpp permutes: GGUF rows as stored
GGUF_V = "blk.0.attn_v.weight"
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def e4m3(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.float8_e4m3fn).float() if t.dtype == torch.uint8 else t.float()


def nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[out, in / 2] bytes -> [out, in] e2m1 values, the even element in the low nibble."""
    p = packed.to(torch.int64)
    return E2M1[torch.stack([p & 0xF, p >> 4], dim=-1).reshape(p.shape[0], -1)]


def per_group(s: torch.Tensor, inp: int) -> torch.Tensor:
    return s.repeat_interleave(inp // s.shape[1], dim=1)


def blocks(s: torch.Tensor, out: int, inp: int, block: int = 128) -> torch.Tensor:
    return s.repeat_interleave(block, 0)[:out].repeat_interleave(block, 1)[:, :inp]


# The formats' own definitions (docs/formats.md, floating-point formats), float32, of v_proj's weight in the (mutated) files.
def _ct_nvfp4(t):
    codes = nibbles(t[V + ".weight_packed"])
    s = e4m3(t[V + ".weight_scale"]) / t[V + ".weight_global_scale"].float()
    return (codes * per_group(s, codes.shape[1])).to(torch.bfloat16).float()


def _modelopt_nvfp4(t):
    codes = nibbles(t[V + ".weight"])
    s = e4m3(t[V + ".weight_scale"]) * t[V + ".weight_scale_2"].float()
    return codes * per_group(s, codes.shape[1])


def _ct_mxfp4(t):
    codes = nibbles(t[V + ".weight_packed"])
    s = torch.exp2(t[V + ".weight_scale"].to(torch.float32) - 127)
    return codes * per_group(s, codes.shape[1])


def _fp8_block(scale_leaf):
    def decode(t):
        w = e4m3(t[V + ".weight"])
        return w * blocks(t[V + "." + scale_leaf].float(), *w.shape)
    return decode


def _modelopt_fp8(t):
    return e4m3(t[V + ".weight"]) * t[V + ".weight_scale"].float()


@dataclass(frozen=True)
class Family:
    fixture: str
    decode: object
    same: str          # the target that keeps its codes (byte-preserving)
    other: str         # another floating-point target


FAMILIES = {
    "ct-nvfp4": Family("llama-ct-nvfp4a16", _ct_nvfp4, "compressed-tensors-nvfp4", "compressed-tensors-mxfp4"),
    "modelopt-nvfp4": Family("llama-modelopt-nvfp4", _modelopt_nvfp4, "compressed-tensors-nvfp4", "fp8"),
    "ct-mxfp4": Family("llama-ct-mxfp4", _ct_mxfp4, "compressed-tensors-mxfp4", "compressed-tensors-nvfp4"),
    "fp8-block": Family("llama-fp8-block", _fp8_block("weight_scale_inv"), "fp8", "compressed-tensors-nvfp4"),
    "ct-fp8": Family("llama-ct-fp8-block", _fp8_block("weight_scale"), "compressed-tensors-fp8", "fp8"),
    "modelopt-fp8": Family("llama-modelopt-fp8", _modelopt_fp8, "fp8", "compressed-tensors-mxfp4"),
}


@dataclass(frozen=True)
class Case:
    name: str
    family: str
    leaf: str                  # v_proj's tensor changed
    value: float | None = None  # set (as the tensor's dtype) ...
    byte: int | None = None     # ... or its raw bytes set to this
    first: bool = False        # only the first element (else every one)
    refused: bool = False      # every verb refuses: decoded in float32 the weights are not finite, or a
    #                            global scale is outside the format's definition (0, inf, below 0)


CASES = [
    # compressed-tensors NVFP4: every group scale is divided by the global scale
    Case("global-0", "ct-nvfp4", "weight_global_scale", 0.0, refused=True),
    Case("global-1e-30", "ct-nvfp4", "weight_global_scale", 1e-30),          # issue 34's repro: 2.7e33, finite
    Case("global-inf", "ct-nvfp4", "weight_global_scale", float("inf"), refused=True),
    Case("global-nan", "ct-nvfp4", "weight_global_scale", float("nan"), refused=True),
    Case("global-negative", "ct-nvfp4", "weight_global_scale", -3856.0, refused=True),
    Case("global-1e-45", "ct-nvfp4", "weight_global_scale", 1e-45, refused=True),   # 448 / 1e-45: inf
    # ModelOpt NVFP4: weight_scale_2 multiplies them
    Case("scale2-0", "modelopt-nvfp4", "weight_scale_2", 0.0, refused=True),
    Case("scale2-1e30", "modelopt-nvfp4", "weight_scale_2", 1e30),
    Case("scale2-1e36", "modelopt-nvfp4", "weight_scale_2", 1e36, refused=True),     # 448 x 1e36: inf
    Case("scale2-inf", "modelopt-nvfp4", "weight_scale_2", float("inf"), refused=True),
    Case("scale2-nan", "modelopt-nvfp4", "weight_scale_2", float("nan"), refused=True),
    Case("scale2-negative", "modelopt-nvfp4", "weight_scale_2", -1e-3, refused=True),
    # e4m3 group scales at their extremes: 448 (0x7E) everywhere, the smallest subnormal 2^-9, NaN (0x7F)
    Case("e4m3-448", "ct-nvfp4", "weight_scale", byte=0x7E),
    Case("e4m3-subnormal", "modelopt-nvfp4", "weight_scale", byte=0x01, first=True),
    Case("e4m3-nan", "ct-nvfp4", "weight_scale", byte=0x7F, first=True, refused=True),
    # MXFP4's E8M0 exponents: 0 is 2^-127, 254 is 2^127 (x 6: beyond float32), 252 2^125 (x 6: within)
    Case("e8m0-0", "ct-mxfp4", "weight_scale", byte=0, first=True),
    Case("e8m0-254", "ct-mxfp4", "weight_scale", byte=254, first=True, refused=True),
    Case("e8m0-252", "ct-mxfp4", "weight_scale", byte=252, first=True),
    # FP8: per-block, per-tensor scales
    Case("fp8-scale-3e38", "fp8-block", "weight_scale_inv", 3e38, first=True, refused=True),
    Case("fp8-scale-1e30", "fp8-block", "weight_scale_inv", 1e30, first=True),
    Case("fp8-scale-nan", "fp8-block", "weight_scale_inv", float("nan"), first=True, refused=True),
    Case("ct-fp8-scale-65504", "ct-fp8", "weight_scale", 65504.0, first=True),
    Case("ct-fp8-scale-inf", "ct-fp8", "weight_scale", float("inf"), first=True, refused=True),
    Case("modelopt-fp8-scale-1e36", "modelopt-fp8", "weight_scale", 1e36, refused=True),
]
VERBS = ["dequantize", "dequantize-f32", "validate", "to-gguf", "to-gptq", "to-same", "to-other", "to-bfloat16"]
# The repro, and every verb on one case of each kind; the rest rotate over the verbs.
EVERY_VERB = {"global-1e-30", "global-nan", "scale2-1e30", "e8m0-254"}


def _verbs(i: int, case: Case) -> list[str]:
    if case.name in EVERY_VERB:
        return VERBS
    rest = VERBS[2:]
    return ["dequantize-f32", rest[i % len(rest)], rest[(i + 3) % len(rest)]]


RUNS = [(c.name, v) for i, c in enumerate(CASES) for v in _verbs(i, c)]
BY_NAME = {c.name: c for c in CASES}


def mutate(case: Case, work: Path) -> Path:
    family = FAMILIES[case.family]
    src = fixture_copy(family.fixture, work)
    tensors = load_file(src / ST)
    key = f"{V}.{case.leaf}"
    t = tensors[key].clone()
    if case.byte is not None:
        raw = t.view(torch.uint8)
        (raw.view(-1)[:1] if case.first else raw).fill_(case.byte)
    else:
        wide = t.double()
        (wide.view(-1)[:1] if case.first else wide).fill_(case.value)
        t = wide.to(t.dtype)
    tensors[key] = t
    save_file(tensors, src / ST, metadata={"format": "pt"})
    return src


def _args(verb: str, case: Case, src: Path, dst: Path) -> list:
    family = FAMILIES[case.family]
    if verb == "validate":
        return ["validate", src, CHECKPOINTS / family.fixture]
    if verb.startswith("dequantize"):
        return ["dequantize", "--json", *(["--dtype", "float32"] if verb.endswith("f32") else []), src, dst]
    to = {"to-same": family.same, "to-other": family.other}.get(verb, verb[3:])
    return ["convert", "--json", "--validate", "--to", to, src, dst.with_suffix(".gguf") if to == "gguf" else dst]


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    d = np.linalg.norm((got.astype(np.float64) - want.astype(np.float64)).ravel())
    n = np.linalg.norm(want.astype(np.float64).ravel())
    return float(d / n) if n else float(d)


def _check_gguf(run, dst: Path, want: np.ndarray) -> None:
    import gguf

    reader = gguf.GGUFReader(dst)
    for t in reader.tensors:
        values = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
        assert np.isfinite(values).all(), f"{t.name}: non-finite values in an exit-0 GGUF\n{run}"
        if t.name == GGUF_V:
            got = values.reshape(want.shape)
    reported = {r["module"]: r["rel_frobenius"] for c in strict_json(run.out)["components"] for r in c.get("layers", [])}
    err = _rel(got, want)
    if V in reported:           # requantized: read back by gguf-py, the error convert reported
        assert abs(err - reported[V]) <= 1e-3 * reported[V] + 1e-6, (err, reported[V], str(run))
    else:                       # codes kept: the source's weights, but for the float16 block scales
        assert err <= 4e-3, (err, str(run))


def _check_folder(run, dst: Path, checks: Path, want: np.ndarray) -> None:
    folder = dst
    config = json.loads((dst / "config.json").read_text())
    if "quantization_config" in config:      # read back at float32 (its decoders are checked elsewhere)
        back = run_inprocess("dequantize", "--dtype", "float32", dst, checks)
        assert back.code == 0, f"qconv cannot read its own exit-0 output back\n{back}\n{run}"
        folder = checks
    for name, t in load_file(folder / ST).items():
        if t.is_floating_point():
            assert torch.isfinite(t.float()).all(), f"{name}: non-finite values in an exit-0 output\n{run}"
    got = load_file(folder / ST)[V + ".weight"].float().numpy()
    if run.args[0] == "dequantize":          # the weights as the format defines them, in the dtype written
        assert np.array_equal(got, want) or np.allclose(got, want, rtol=2**-8, atol=0), (
            f"exit 0, but v_proj is not the files' own decoding (largest difference "
            f"{float(np.abs(got - want).max()):.3g})\n{run}")
        return
    reported = {r["module"]: r["rel_frobenius"] for c in strict_json(run.out)["components"] for r in c.get("layers", [])}
    err = _rel(got, want)
    if V in reported:                        # requantized: read back, the error convert reported
        assert abs(err - reported[V]) <= 1e-3 * reported[V] + 1e-6, (err, reported[V], str(run))
    else:                                    # codes kept, or a float copy: only the scales' or dtype's rounding
        assert err <= 4e-3, (err, str(run))


@pytest.mark.parametrize("case, verb", RUNS, ids=[f"{c}-{v}" for c, v in RUNS])
def test_nonfinite_source(tmp_path, case, verb):
    case = BY_NAME[case]
    work = tmp_path / "work"
    work.mkdir()
    src = mutate(case, work)
    dst = tmp_path / "made" / "dst"
    before = snapshot(work)
    args = _args(verb, case, src, dst)
    run = run_inprocess(*args)

    with np.errstate(all="ignore"):
        want = FAMILIES[case.family].decode(load_file(src / ST)).numpy()
    assert np.isfinite(want).all() or case.refused, "weights that are not finite, and the case expects no refusal"
    check_contract(run, names=(str(src / ST), V) if run.code not in (0, 1) else (), refusal_only=case.refused)
    if case.refused and verb != "validate":
        assert run.code == 4, f"a source whose weights are not finite must be refused as corrupt\n{run}"
    assert snapshot(work) == before, f"SRC changed\n{run}"
    out = Path(args[-1])
    if run.code != 0 or verb == "validate":
        assert not (tmp_path / "made").exists() and not litter(tmp_path), str(run)
        if verb == "validate" and run.code == 1:
            assert "FAIL" in run.out and V in run.out, f"validate must fail the changed layer\n{run}"
        return
    if out.suffix == ".gguf":
        _check_gguf(run, out, want)
    else:
        _check_folder(run, out, tmp_path / "checks", want)
    if verb == "dequantize-f32":
        assert not case.refused


def test_catalogue():
    """Every floating-point family meets the catalogue, both kinds of case, and every verb."""
    assert {c.family for c in CASES} == set(FAMILIES)
    assert {c.refused for c in CASES} == {True, False}
    assert {v for _, v in RUNS} == set(VERBS)
    assert all(sum(c.family == f and c.refused for c in CASES) for f in FAMILIES)


# --------------------------------------------------------------------------- a GGUF source
def _gguf_source(tmp_path: Path, d_bits: int) -> Path:
    """llama-gptq-w8g128 as a GGUF (qconv keeps its codes as Q8_0), then the first Q8_0 block of attn_v
    given a float16 scale of d_bits (NaN 0x7E00, inf 0x7C00); gguf-py locates the tensor's bytes."""
    import gguf

    work = tmp_path / "work"
    work.mkdir()
    path = work / "model.gguf"
    made = run_inprocess("convert", "--to", "gguf", CHECKPOINTS / "llama-gptq-w8g128", path)
    assert made.code == 0, str(made)
    (t,) = [t for t in gguf.GGUFReader(path).tensors if t.name == GGUF_V]
    assert t.tensor_type == gguf.GGMLQuantizationType.Q8_0
    with open(path, "r+b") as f:            # a Q8_0 block: float16 d, then 32 int8 codes
        f.seek(t.data_offset)
        f.write(np.uint16(d_bits).tobytes())
    return path


@pytest.mark.parametrize("d_bits", [0x7E00, 0x7C00], ids=["nan", "inf"])
@pytest.mark.parametrize("verb", ["dequantize", "to-gptq", "to-gguf", "validate"])
def test_nonfinite_gguf_block_scale(tmp_path, d_bits, verb):
    src = _gguf_source(tmp_path, d_bits)
    before = snapshot(src.parent)
    dst = tmp_path / "made" / "dst"
    args = {"dequantize": ["dequantize", src, dst], "to-gptq": ["convert", "--to", "gptq", src, dst],
            "to-gguf": ["convert", "--to", "gguf", src, dst.with_suffix(".gguf")],
            "validate": ["validate", src, CHECKPOINTS / "llama-gptq-w8g128"]}[verb]
    run = run_inprocess(*args)
    check_contract(run, names=(str(src),), refusal_only=True)
    assert run.code == 4 and (V in run.err or GGUF_V in run.err), str(run)
    assert ("not finite" in run.err or "non-finite" in run.err) and "stored as infinity" not in run.err, str(run)
    assert snapshot(src.parent) == before and not (tmp_path / "made").exists() and not litter(tmp_path)
