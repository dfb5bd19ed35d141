"""Requantization reads a module's exact weight a window of rows at a time (formats/core/requantize.py:
ExactRows, blocks of BLOCK_ELEMENTS for the integer search, windows of REQUANTIZE_WINDOW for the
row-separable target quantizers: FP8, MXFP4, NVFP4 under its planned global scale), measuring each window's error while it is in hand
(issue 33); where every leaf of the target is its rows' leaves stacked, a module is also read from its
source, encoded and written a window at a time (convert._Stream). Three things hold whatever the window:

* the output is the same bytes as with one window per module, and the report the same numbers;
* no lossy path that is row-separable ever asks for a module's whole float weight (ExactRows.__array__);
* the 8-bit search (five candidates and one least-squares step, not the 203 of lower widths) is never
  worse than round-to-nearest on any layer, and its reported errors are what the files hold, measured
  here independently in float64."""

import json

import numpy as np
import pytest
from safetensors.torch import load_file

import qconv
from conftest import CHECKPOINTS, load_tensors
from qconv.convert import activation_cost, convert as convert_mod
from qconv.formats.core import requantize as rq
from qconv.formats.compressed_tensors import codec as ct_codec

# (fixture, convert keywords, written a window of rows at a time: every leaf of the target is its rows'
# leaves stacked; GPTQ's qweight is [in / 8, out], so its modules are encoded whole, their weight read
# by blocks all the same)
JOBS = [
    ("llama-fp16", {"to": "compressed-tensors-w8a8"}, True),                 # float -> int8 per channel, searched
    ("llama-fp16", {"to": "compressed-tensors-w8a8", "search": False}, True),    # ... round-to-nearest
    ("llama-fp8-block", {"to": "compressed-tensors-w8a8"}, True),            # e4m3 blocks -> int8
    ("llama-gptq-w4g128-actorder", {"to": "compressed-tensors-w8a8"}, True),     # act-order int4 -> int8
    ("llama-gptq-w8g128", {"to": "gptq", "group_size": 64}, False),          # int8 groups of 128 -> of 64
    ("llama-fp16", {"to": "compressed-tensors-fp8"}, True),                  # llm-compressor's FP8_DYNAMIC
    ("llama-fp16", {"to": "compressed-tensors-fp8", "block_size": (128, 128)}, True),   # ... FP8_BLOCK
    ("llama-fp16", {"to": "fp8"}, True),                                     # transformers' fine-grained FP8
    ("llama-fp16", {"to": "compressed-tensors-mxfp4"}, True),                # MXFP4A16
    ("llama-fp16", {"to": "compressed-tensors-nvfp4"}, False),               # NVFP4A16 (its [1] global scale:
    ("llama-ct-fp8-dynamic", {"to": "compressed-tensors-nvfp4"}, False),     # encoded whole, quantized by windows)
    ("llama-fp16", {"to": "mlx", "bits": 8, "group_size": 64}, True),        # mlx-lm affine 8-bit
]


def _report(result) -> list[dict]:
    return sorted(result.requantized, key=lambda r: r["module"])


@pytest.mark.parametrize("name, kw, streamed", JOBS, ids=lambda v: v if isinstance(v, str) else "-".join(
    f"{k}={v}" for k, v in v.items()) if isinstance(v, dict) else str(v))
def test_small_windows_give_the_same_bytes_and_never_the_whole_weight(tmp_path, monkeypatch, name, kw, streamed):
    whole = qconv.convert(CHECKPOINTS / name, tmp_path / "whole", card=False, **kw)   # cards name their DST
    assert whole.requantized, "a lossy path"
    monkeypatch.setattr(rq, "BLOCK_ELEMENTS", 4096)              # 256-input layers: blocks of 16 rows
    monkeypatch.setattr(convert_mod, "REQUANTIZE_WINDOW", 8192)  # ... windows of 32 rows
    monkeypatch.setattr(convert_mod, "STREAM_WINDOW", 16384)     # ... written 64 rows at a time
    monkeypatch.setattr(ct_codec, "ABSMAX_WINDOW", 8192)        # NVFP4's planned maximum: 32 rows at a time
    monkeypatch.setattr(activation_cost, "BLOCK_ELEMENTS", 4096)  # W8A8's activation cost: 16 rows at a time
    streams = []
    stream = convert_mod._Stream.__init__
    monkeypatch.setattr(convert_mod._Stream, "__init__", lambda self, windows, *a: streams.append(len(windows))
                        or stream(self, windows, *a))
    reads = []
    original = rq.ExactRows.__getitem__

    def rows(self, key):
        reads.append(key.indices(self.shape[0])[:2])
        return original(self, key)

    def whole_weight(self, dtype=None, copy=None):
        raise AssertionError("a row-separable lossy path asked for a module's whole weight")

    monkeypatch.setattr(rq.ExactRows, "__getitem__", rows)
    monkeypatch.setattr(rq.ExactRows, "__array__", whole_weight)
    windows = qconv.convert(CHECKPOINTS / name, tmp_path / "windows", card=False, **kw)
    # really read by windows: of 32 rows, or one 128-row block of FP8_BLOCK; several per module
    assert max(r1 - r0 for r0, r1 in reads) <= 128 and len(reads) >= 2 * len(whole.requantized)
    # written by windows where the target's leaves are stacked rows: every module of more than one window
    assert (streams and min(streams) >= 2) if streamed else not streams
    files = sorted(p.name for p in (tmp_path / "whole").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "windows").iterdir())
    for f in files:
        assert (tmp_path / "whole" / f).read_bytes() == (tmp_path / "windows" / f).read_bytes(), f
    # the same errors: per-group sums are the same, only the order the blocks are added in differs
    for a, b in zip(_report(whole), _report(windows), strict=True):
        assert a.keys() == b.keys()
        for key in a:
            if isinstance(a[key], float):
                assert a[key] == pytest.approx(b[key], rel=1e-12, abs=0), (a["module"], key)
            else:
                assert a[key] == b[key], (a["module"], key)


def _decoded_w8a8(folder) -> dict[str, np.ndarray]:
    t = load_tensors(folder)
    return {k[: -len(".weight")]: t[k].double().numpy() * t[k[: -len(".weight")] + ".weight_scale"].double().numpy()
            for k in t if k.endswith(".weight") and k[: -len(".weight")] + ".weight_scale" in t}


def _rtn_sq_error_per_channel(w: np.ndarray) -> float:
    """int8 symmetric round-to-nearest per output channel (scale 2 absmax / 255 stored as float16, codes
    -128..127), written here independently of qconv."""
    scale = (np.abs(w).max(axis=1, keepdims=True) / 127.5).astype(np.float16).astype(np.float64)
    scale[scale == 0] = 1
    q = np.clip(np.round(w / scale), -128, 127)
    return float(((q * scale - w) ** 2).sum())


def test_8bit_search_beats_round_to_nearest_on_every_layer(tmp_path):
    """float -> W8A8 (int8 per channel): every layer's error, measured here in float64 from the file
    against the float source, is what the report says, at or below round-to-nearest's (computed here
    independently) on every layer and below it overall; --no-search writes round-to-nearest itself."""
    src = load_file(CHECKPOINTS / "llama-fp16" / "model.safetensors")
    searched = qconv.convert(CHECKPOINTS / "llama-fp16", tmp_path / "s", to="compressed-tensors-w8a8")
    plain = qconv.convert(CHECKPOINTS / "llama-fp16", tmp_path / "p", to="compressed-tensors-w8a8", search=False)
    for result, folder in ((searched, tmp_path / "s"), (plain, tmp_path / "p")):
        decoded = _decoded_w8a8(folder)
        layers = {r["module"]: r for r in result.requantized}
        assert set(layers) == set(decoded) and len(layers) == 14
        total = total_rtn = 0.0
        for module, wq in decoded.items():
            w = src[module + ".weight"].double().numpy()
            sq, rtn = float(((wq - w) ** 2).sum()), _rtn_sq_error_per_channel(w)
            r = layers[module]
            assert sq == pytest.approx(r["sq_error"], rel=1e-5) and rtn == pytest.approx(r["rtn_sq_error"], rel=1e-5)
            assert sq <= rtn * (1 + 1e-9), module
            total, total_rtn = total + sq, total_rtn + rtn
        if result is plain:
            assert total == pytest.approx(total_rtn, rel=1e-9)
            assert all(r["sq_error"] == r["rtn_sq_error"] for r in layers.values())
        else:
            assert total < 0.995 * total_rtn, total / total_rtn
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())["quantization_config"]
    assert cfg["config_groups"]["group_0"]["weights"]["num_bits"] == 8


def test_a_window_that_cannot_be_stored_refuses_the_module_and_writes_nothing(tmp_path, monkeypatch):
    """A weight whose int8 scale float16 cannot hold (1e30 / 127), in the last window of a module that is
    written a window at a time: the earlier windows were already encoded into the staging folder, and
    still the run is refused with the one-line message naming the module, and no DST or staging is left."""
    import shutil

    import torch
    from safetensors.torch import save_file

    src = tmp_path / "src"
    shutil.copytree(CHECKPOINTS / "llama-fp16", src)
    tensors = {k: v.float() for k, v in load_file(src / "model.safetensors").items()}
    tensors["model.layers.0.mlp.down_proj.weight"][-1, 3] = 1e30
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(cfg | {"torch_dtype": "float32"}))
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    monkeypatch.setattr(convert_mod, "STREAM_WINDOW", 16384)
    streams = []
    stream = convert_mod._Stream.__init__
    monkeypatch.setattr(convert_mod._Stream, "__init__", lambda self, windows, *a: streams.append(len(windows))
                        or stream(self, windows, *a))
    with pytest.raises(qconv.UnsupportedFormat) as info:
        qconv.convert(src, tmp_path / "out", to="compressed-tensors-w8a8")
    assert info.value.exit_code == 5 and "model.layers.0.mlp.down_proj" in str(info.value)
    assert "float16" in str(info.value) and "\n" not in str(info.value)
    assert streams and max(streams) >= 2                          # it was being written a window at a time
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no DST, no staging folder
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before
    assert torch.isfinite(load_file(src / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"]).all()


def test_a_streamed_tensor_read_twice_gives_the_same_bytes(monkeypatch):
    """An output tensor of a module written a window at a time, asked for twice (a writer that reads a
    tensor again): the second reading reads the module anew and yields the same bytes, never a short
    tensor."""
    from qconv.formats.storage.checkpoint import open_component

    monkeypatch.setattr(convert_mod, "STREAM_WINDOW", 16384)
    comp = open_component(CHECKPOINTS / "llama-fp16", "llama-fp16")
    planned = convert_mod._plan(comp, convert_mod.Options(to="compressed-tensors-w8a8"))
    weight = planned.outputs["model.layers.0.mlp.down_proj.weight"]
    scale = planned.outputs["model.layers.0.mlp.down_proj.weight_scale"]
    first = b"".join(np.ascontiguousarray(a).tobytes() for a in weight.chunks())
    scales = b"".join(np.ascontiguousarray(a).tobytes() for a in scale.chunks())
    again = b"".join(np.ascontiguousarray(a).tobytes() for a in weight.chunks())
    assert first == again and len(first) == int(np.prod(weight.shape))     # int8 codes: a byte each
    assert len(scales) == 2 * int(np.prod(scale.shape))                      # float16 scales
