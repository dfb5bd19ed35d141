"""Hypothesis mutations of real fixtures (issue 10): safetensors headers (dtype, shape, offsets),
quantization_config fields, the bytes of state tensors (SCB, absmax, nested_absmax, GPTQ scales and
qzeros) and bitsandbytes quant_state JSON fields. Whatever the mutation, ``qconv dequantize`` either
refuses it as documented (exit 2, 4 or 5; one stderr line naming the file; no DST, no litter; SRC
byte-identical) or exits 0 with exactly the weights an independent decoding of the mutated files gives:
safetensors' own reader for every tensor, LLM.int8's CB * SCB * (1/127) for bitsandbytes int8,
bitsandbytes' own QuantState.from_dict + dequantize_4bit for 4-bit, and GPTQModel's dequantization
written out in numpy for 4-bit GPTQ. Where that independent decoding cannot make sense of the files
(safetensors refuses them, bitsandbytes raises, a state tensor is non-finite or of a dtype the format
does not define), only a refusal is right."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from safetensors.torch import load_file

from conftest import CHECKPOINTS
from sweep_cases import (check_contract, edit_json, edit_quant_state, fixture_copy, litter, read_raw_header,
                         run_inprocess, snapshot, write_raw_header)

MUTATIONS = settings(max_examples=25, deadline=None, derandomize=True, database=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                            HealthCheck.data_too_large])
ST = "model.safetensors"
REFUSALS = {2, 4, 5}
FAMILY = {"llama-bnb8": "bnb8", "llama-bnb4-fp4": "bnb4", "llama-bnb4-nf4-dq": "bnb4",
          "llama-bnb4-nf4-bf16storage": "bnb4", "llama-gptq-w4g64-asym": "gptq4",
          "llama-gptq-w4g128-actorder": "gptq4", "llama-fp8-block": "fp8"}
DTYPES = ["F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8", "BOOL",
          "F8_E4M3", "F8_E5M2"]


class Undecodable(Exception):
    """The independent decoding cannot make sense of the mutated files: only a refusal is right."""


# --- independent decoders ----------------------------------------------------------------------------

def _modules(fixture: str) -> list[str]:
    oracle = load_file(CHECKPOINTS / fixture / "oracle" / "dequant.safetensors")
    return sorted(k[: -len(".weight")] for k in oracle)


def _finite(t: torch.Tensor, what: str) -> torch.Tensor:
    if t.is_floating_point() and not torch.isfinite(t).all():
        raise Undecodable(f"{what} is not finite")
    return t


def _bnb8(ts: dict, m: str) -> np.ndarray:
    cb, scb = ts[m + ".weight"], ts[m + ".SCB"]
    if cb.dtype != torch.int8 or scb.dtype != torch.float32 or cb.dim() != 2 or tuple(scb.shape) != cb.shape[:1]:
        raise Undecodable(f"{m}: CB {cb.dtype} {tuple(cb.shape)}, SCB {scb.dtype} {tuple(scb.shape)}")
    _finite(scb, m + ".SCB")
    return (cb.float().numpy() * scb.numpy()[:, None]) * np.float32(1 / 127)


def _bnb4(ts: dict, m: str) -> np.ndarray:
    import bitsandbytes.functional as F

    prefix = m + ".weight."
    state = {k[len(prefix):]: v for k, v in ts.items() if k.startswith(prefix)}
    for k, v in state.items():
        _finite(v, prefix + k)
    packed = ts[m + ".weight"]
    try:
        qs = F.QuantState.from_dict(state, device=torch.device("cpu"))
        w = F.dequantize_4bit(packed.view(torch.uint8).reshape(-1, 1), qs)
    except Exception as exc:                   # bitsandbytes itself cannot read it
        raise Undecodable(f"bitsandbytes: {type(exc).__name__}: {exc}") from None
    return _finite(w, m).float().numpy()


def _gptq4(ts: dict, m: str, group_size: int) -> np.ndarray:
    """GPTQModel's dequantize_weight for its 4-bit v1 files: codes along the input dim, eight per
    int32 word; zero points eight per word along the output dim, stored minus 0x11111111 word-wise."""
    qw, qz, s = ts[m + ".qweight"], ts[m + ".qzeros"], ts[m + ".scales"]
    if qw.dtype not in (torch.int32, torch.uint32) or qz.dtype not in (torch.int32, torch.uint32) or \
            s.dtype not in (torch.float16, torch.bfloat16, torch.float32) or qw.dim() != 2 or qz.dim() != 2:
        raise Undecodable(f"{m}: dtypes {qw.dtype} {qz.dtype} {s.dtype}")
    _finite(s, m + ".scales")
    inp, out = qw.shape[0] * 8, qw.shape[1]
    groups = s.shape[0]
    if s.dim() != 2 or tuple(s.shape) != (groups, out) or tuple(qz.shape) != (groups, out // 8) or out % 8:
        raise Undecodable(f"{m}: shapes {tuple(qw.shape)} {tuple(qz.shape)} {tuple(s.shape)}")
    words = qw.view(torch.int32).numpy().view(np.uint32)
    shifts = (4 * np.arange(8, dtype=np.uint32))
    q = ((words[:, None, :] >> shifts[None, :, None]) & 15).reshape(inp, out).astype(np.float32)
    zw = (qz.view(torch.int32).numpy().view(np.uint32).astype(np.uint64) + 0x11111111) % 2**32
    z = ((zw.astype(np.uint32)[:, :, None] >> shifts[None, None, :]) & 15).reshape(groups, out).astype(np.float32)
    if m + ".g_idx" in ts:
        g = ts[m + ".g_idx"]
        if g.dtype != torch.int32 or tuple(g.shape) != (inp,):
            raise Undecodable(f"{m}: g_idx {g.dtype} {tuple(g.shape)}")
        g = g.numpy()
    else:
        g = np.arange(inp) // group_size
    if g.min() < 0 or g.max() >= groups:
        raise Undecodable(f"{m}: g_idx outside 0..{groups - 1}")
    scales = s.float().numpy()
    return (scales[g] * (q - z[g])).T


def _fp8(ts: dict, m: str, block) -> np.ndarray:
    """DeepSeek-V3's weight_dequant semantics in torch: float32(e4m3) times the scale of its block of the
    config's weight_block_size, the last blocks partial."""
    q, s = ts[m + ".weight"], ts[m + ".weight_scale_inv"]
    if q.dtype != torch.float8_e4m3fn or q.dim() != 2 or s.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise Undecodable(f"{m}: {q.dtype} {tuple(q.shape)}, scale {s.dtype}")
    out, inp = q.shape
    b0, b1 = block
    if tuple(s.shape) != (-(-out // b0), -(-inp // b1)):
        raise Undecodable(f"{m}: scale {tuple(s.shape)} for {out} x {inp} in {block} blocks")
    _finite(s, m + ".weight_scale_inv")
    w = q.float()
    if torch.isnan(w).any():
        raise Undecodable(f"{m}: e4m3 NaN codes")
    full = s.float().repeat_interleave(b0, 0)[:out].repeat_interleave(b1, 1)[:, :inp]
    return (w * full).numpy()


def reference_decode(fixture: str, folder: Path) -> dict[str, np.ndarray]:
    """Every tensor the mutated copy of FIXTURE should dequantize to, decoded without qconv, with the
    intact fixture's method (a config mutation must not change what the tensors say)."""
    try:
        ts = load_file(folder / ST)
    except Exception as exc:                   # safetensors' own reader refuses the file
        raise Undecodable(f"safetensors: {exc}") from None
    family = FAMILY[fixture]
    modules = _modules(fixture)
    config = json.loads((CHECKPOINTS / fixture / "config.json").read_text())
    out = {}
    for m in modules:
        names = [k for k in ts if k.startswith(m + ".")]
        if not names:
            raise Undecodable(f"{m} is gone")
        try:
            if family == "bnb8":
                w = _bnb8(ts, m)
            elif family == "bnb4":
                w = _bnb4(ts, m)
            elif family == "fp8":
                w = _fp8(ts, m, config["quantization_config"]["weight_block_size"])
            else:
                w = _gptq4(ts, m, config["quantization_config"]["group_size"])
        except KeyError as exc:
            raise Undecodable(f"{m}: missing {exc}") from None
        out[m + ".weight"] = w
    for k, v in ts.items():
        if not any(k.startswith(m + ".") for m in modules):
            out[k] = _np(v)
    return out


@pytest.mark.parametrize("fixture", sorted(FAMILY))
def test_reference_decoders_reproduce_the_producer_oracles(fixture):
    """The independent decoders above are the producers' own arithmetic: on the intact fixtures they
    give the oracle (bitsandbytes exactly; GPTQModel's fp16 arithmetic within its rounding)."""
    oracle = {k: v.numpy() for k, v in load_file(CHECKPOINTS / fixture / "oracle" / "dequant.safetensors").items()}
    ours = reference_decode(fixture, CHECKPOINTS / fixture)
    for k, want in oracle.items():
        tol = 0 if FAMILY[fixture] != "gptq4" else 2**-10
        assert np.all(np.abs(ours[k] - want) <= tol * np.abs(want) + (tol and 2**-24)), k


# --- the property ----------------------------------------------------------------------------------------

def _close(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Elementwise: float16/bfloat16 rounding of either side (bitsandbytes returns its quant_state's
    dtype, GPTQModel computes in float16), nothing more: one code off is far outside this."""
    got64, want64 = got.astype(np.float64), want.astype(np.float64)
    return np.abs(got64 - want64) <= 2**-8 * np.abs(want64) + 1e-7


def _np(t: torch.Tensor) -> np.ndarray:
    if t.is_floating_point():
        return t.float().numpy()
    try:
        return t.numpy()
    except TypeError:                          # torch's uint16/32/64 have no numpy view
        return t.to(torch.int64).numpy()


def check_dequantize(fixture: str, mutate, file_named: str, *, must_succeed: bool = False) -> None:
    """Apply mutate(folder) to a fresh copy of FIXTURE and run dequantize --dtype float32 on it."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        work = tmp / "work"
        work.mkdir()
        src = fixture_copy(fixture, work)
        mutate(src)
        try:
            want = reference_decode(fixture, src)
        except Undecodable as exc:
            want, why = None, str(exc)
        before = snapshot(work)
        dst = tmp / "made" / "dst"
        run = run_inprocess("dequantize", "--dtype", "float32", src, dst)
        check_contract(run, names=(file_named,) if run.code not in (0, 2) else ())
        assert run.code == 0 or not must_succeed, f"must succeed\n{run}"
        assert snapshot(work) == before, f"SRC changed\n{run}"
        if run.code != 0:
            assert run.code in REFUSALS, f"not a documented refusal\n{run}"
            assert sorted(p.name for p in tmp.iterdir()) == ["work"] and not litter(tmp), f"DST or litter\n{run}"
            return
        assert want is not None, f"exit 0, but the mutated files cannot be decoded ({why})\n{run}"
        got = {}
        for shard in sorted(dst.glob("*.safetensors")):
            got.update({k: _np(v) for k, v in load_file(shard).items()})
        missing = sorted(set(want) - set(got))
        assert not missing, f"exit 0 but tensors missing: {missing[:5]}\n{run}"
        extra = sorted(set(got) - set(want))
        assert not extra, f"exit 0 with tensors the source does not hold as plain weights: {extra[:5]}\n{run}"
        for k, w in want.items():
            g = got[k]
            assert g.shape == w.shape, f"{k}: shape {g.shape}, expected {w.shape}\n{run}"
            ok = _close(g, w) | (np.isnan(g) & np.isnan(w))
            assert ok.all(), (f"exit 0 with wrong values in {k}: {int((~ok).sum())} of {ok.size} elements, "
                              f"first at {np.argwhere(~ok)[0].tolist()}: {g[~ok][0]} vs {w[~ok][0]}\n{run}")
        assert not litter(tmp), f"litter\n{run}"


# --- headers ------------------------------------------------------------------------------------------

def _header_names(fixture):
    header, _ = read_raw_header(CHECKPOINTS / fixture / ST)
    return sorted(k for k in header if k != "__metadata__")


@MUTATIONS
@given(data=st.data(), fixture=st.sampled_from(sorted(FAMILY)),
       kind=st.sampled_from(["dtype", "shape", "reshape", "offsets"]))
def test_header_mutation(data, fixture, kind):
    name = data.draw(st.sampled_from(_header_names(fixture)), label="tensor")
    if kind == "dtype":
        change = {"dtype": data.draw(st.sampled_from(DTYPES), label="dtype")}
    elif kind == "shape":
        change = {"shape": data.draw(st.lists(st.integers(0, 1100), max_size=3), label="shape")}
    elif kind == "reshape":
        change = {"reshape": data.draw(st.sampled_from([2, 4, 8, -2]), label="split")}
    else:
        change = {"offsets": data.draw(st.tuples(st.integers(-40, 40), st.integers(-40, 40)), label="deltas")}

    def mutate(folder):
        header, body = read_raw_header(folder / ST)
        entry = header[name]
        if "dtype" in change:
            entry["dtype"] = change["dtype"]
        elif "shape" in change:
            entry["shape"] = change["shape"]
        elif "reshape" in change:                      # same element count, other dims
            n, f = int(np.prod(entry["shape"])), change["reshape"]
            entry["shape"] = [f, n // f] if f > 0 and n % f == 0 else [n]
        else:
            b, e = entry["data_offsets"]
            entry["data_offsets"] = [b + change["offsets"][0], e + change["offsets"][1]]
        write_raw_header(folder / ST, header, body)
    check_dequantize(fixture, mutate, ST)


# --- quantization_config ---------------------------------------------------------------------------------

# Fields that legitimately change how the same tensors decode (zero-point convention and the writer it
# implies, per-module overrides) are left out: for those a different result is not a wrong one.
DECODING_FIELDS = {"checkpoint_format", "format", "packing_format", "meta", "dynamic", "extra_config",
                   "weight_block_size"}
VALUES = st.one_of(st.none(), st.booleans(), st.integers(-3, 300), st.floats(allow_nan=True),
                   st.text(max_size=6), st.sampled_from(["gptq", "awq", "bitsandbytes", "nf4", "fp4", "int8",
                                                        "float16", "bfloat16", "auto-round", "fp8"]),
                   st.lists(st.integers(0, 3), max_size=2),
                   st.dictionaries(st.text(max_size=3), st.integers(), max_size=1))


def _config_keys(fixture):
    qc = json.loads((CHECKPOINTS / fixture / "config.json").read_text())["quantization_config"]
    return sorted(set(qc) - DECODING_FIELDS)


@MUTATIONS
@given(data=st.data(), fixture=st.sampled_from(sorted(FAMILY)), value=VALUES, drop=st.booleans())
def test_config_mutation(data, fixture, value, drop):
    key = data.draw(st.sampled_from(_config_keys(fixture)), label="key")

    def mutate(folder):
        def fn(c):
            if drop:
                c["quantization_config"].pop(key)
            else:
                c["quantization_config"][key] = value
        edit_json(folder / "config.json", fn)
        if (folder / "quantize_config.json").is_file():       # GPTQ's second copy says the same
            edit_json(folder / "quantize_config.json", lambda q: q.pop(key, None) if drop else q.update({key: value}))
    check_dequantize(fixture, mutate, "config.json")


# --- state tensor bytes ----------------------------------------------------------------------------------

STATE_TENSORS = {
    "llama-bnb8": [".SCB"],
    "llama-bnb4-fp4": [".weight.absmax"],
    "llama-bnb4-nf4-dq": [".weight.absmax", ".weight.nested_absmax", ".weight.nested_quant_map"],
    "llama-gptq-w4g64-asym": [".scales", ".qzeros"],
    "llama-gptq-w4g128-actorder": [".scales", ".g_idx"],
    "llama-fp8-block": [".weight_scale_inv", ".weight"],      # the e4m3 codes too: 0x7F / 0xFF are NaN
}


@MUTATIONS
@given(data=st.data(), fixture=st.sampled_from(sorted(STATE_TENSORS)),
       edits=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), min_size=1, max_size=4))
def test_state_bytes_mutation(data, fixture, edits):
    module = data.draw(st.sampled_from(_modules(fixture)), label="module")
    suffix = data.draw(st.sampled_from(STATE_TENSORS[fixture]), label="tensor")
    name = module + suffix

    def mutate(folder):
        header, body = read_raw_header(folder / ST)
        b, e = header[name]["data_offsets"]
        body = bytearray(body)
        for where, byte in edits:
            body[b + int(where * (e - b))] = byte
        write_raw_header(folder / ST, header, bytes(body))
    check_dequantize(fixture, mutate, ST)


# --- bitsandbytes quant_state JSON -------------------------------------------------------------------------

QS_VALUES = st.one_of(VALUES, st.sampled_from([0, 1, 16, 32, 64, 128, 256, 4096, -64, "64", 64.0, [256, 256],
                                               [65536], [512, 128], "float32", "bfloat16", "int8", "nf4", "fp4"]))


@MUTATIONS
@given(data=st.data(), fixture=st.sampled_from(["llama-bnb4-fp4", "llama-bnb4-nf4-dq"]), value=QS_VALUES,
       drop=st.booleans())
def test_quant_state_mutation(data, fixture, value, drop):
    module = data.draw(st.sampled_from(_modules(fixture)), label="module")
    tensors = load_file(CHECKPOINTS / fixture / ST)
    qs_name = next(k for k in tensors if k.startswith(module + ".weight.quant_state."))
    key = data.draw(st.sampled_from(sorted(json.loads(bytes(tensors[qs_name].numpy())))),
                    label="key")

    def mutate(folder):
        edit_quant_state(folder / ST, module, lambda qs: qs.pop(key, None) if drop else qs.update({key: value}))
    check_dequantize(fixture, mutate, ST)


@pytest.mark.parametrize("fixture", sorted(FAMILY))
def test_unmutated_rewrite_dequantizes_to_the_reference(fixture):
    """The header rewrite itself changes nothing: a rewritten copy must exit 0 and match, so a failure
    of the properties above is the mutation's, not the harness's."""
    def rewrite(folder):
        write_raw_header(folder / ST, *read_raw_header(folder / ST))
    check_dequantize(fixture, rewrite, ST, must_succeed=True)
