"""validate reads a layer a window of rows at a time: what it holds is bounded by WINDOW_ELEMENTS codes
per side whatever the layer's size, and the report is exactly the one a whole-layer read gives."""

import shutil

import numpy as np
import pytest

from conftest import CHECKPOINTS
from qconv import validation
from qconv.formats.storage.safetensors_header import read_header

BLOCK = 1 << 13        # 16 rows of 512 inputs, rounded up to 32: blocks of 32 rows
WINDOW = 1 << 15       # two such blocks a window

# Every family on one side or the other: GPTQ (column windows of [in, out] words, v1 and act-order),
# compressed-tensors pack-quantized (asymmetric zero points packed along out) and int-quantized, AWQ,
# LLM.int8, 4-bit with and without double quantization (its kernel on sliced blocks) and float16.
PAIRS = [("llama-gptq-w4g64-asym", "llama-ct-w4a16-asym"), ("llama-awq-w4g128", "llama-bnb8"),
         ("llama-bnb4-nf4-dq", "llama-fp16"), ("llama-ct-w8a8", "llama-gptq-w3g128"),
         ("llama-bnb4-fp4", "llama-ct-w3a16"), ("llama-autoround-w4g128-mixed8", "llama-ct-mixed"),
         ("llama-gptq-w4g128-actorder", "llama-ct-w8a16"), ("llama-bnb4-nf4-bf16storage", "llama-awq-w4g64-sym")]


def _run(monkeypatch, a, b, window, reads=None):
    monkeypatch.setattr(validation, "BLOCK_ELEMENTS", BLOCK)
    monkeypatch.setattr(validation, "WINDOW_ELEMENTS", window)
    if reads is not None:
        host = validation.Side.host

        def recording(side, name, rows):
            hw = host(side, name, rows)
            if hw.qt is not None:
                reads.append((id(side), name, rows, hw.qt.codes.size, side.entries[name].module.in_features))
            return hw
        monkeypatch.setattr(validation.Side, "host", recording)
    return validation.validate(a, b, device="cpu", kernels="all")


@pytest.mark.parametrize("pair", PAIRS, ids=["+".join(p) for p in PAIRS])
def test_windowed_reads_give_the_whole_layer_report(monkeypatch, pair):
    a, b = (CHECKPOINTS / n for n in pair)
    whole = _run(monkeypatch, a, b, 1 << 40)
    reads = []
    windowed = _run(monkeypatch, a, b, WINDOW, reads)
    assert windowed == whole
    # The producers' kernels ran on the first block's rows (32 of 256), read from only those rows' bytes.
    kernels = [k for r in whole["layers"] for k in r.get("kernels", {}).values()]
    assert all(k["ok"] is True for k in kernels)
    assert kernels or "bnb" not in "".join(pair)
    # Every quantized layer was read in windows of at most WINDOW codes that cover its rows exactly once.
    by_layer = {}
    for side, name, rows, size, inp in reads:
        assert size == (rows[1] - rows[0]) * inp and size <= WINDOW
        by_layer.setdefault((side, name), []).append(rows)
    assert by_layer and any(len(w) > 1 for w in by_layer.values())
    for windows in by_layer.values():          # read on reader threads: in any order
        windows.sort()
        assert windows[0][0] == 0 and all(x[1] == y[0] for x, y in zip(windows, windows[1:]))


def test_a_code_off_in_a_later_window_is_named_where_it_is(monkeypatch, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(CHECKPOINTS / "llama-bnb8", bad, ignore=shutil.ignore_patterns("oracle"))
    path, tensor = bad / "model.safetensors", "model.layers.1.mlp.up_proj.weight"
    info = read_header(path).tensors[tensor]
    out, inp = info.shape
    row, col = out - 7, 5                     # in the last window
    with open(path, "r+b") as f:
        f.seek(info.offset + row * inp + col)
        code = f.read(1)[0]
        f.seek(info.offset + row * inp + col)
        f.write(bytes([(code + 1) % 256]))
    reads = []
    result = _run(monkeypatch, CHECKPOINTS / "llama-bnb8", bad, WINDOW, reads)
    failed = [r for r in result["layers"] if not r["ok"]]
    assert [r["module"] for r in failed] == ["model.layers.1.mlp.up_proj"]
    assert failed[0]["weights_over_bound"] == 1 and failed[0]["first_weight_over_bound"] == [row, col]
    assert failed[0]["worst_channel"] == row
    assert max(rows[1] - rows[0] for _, name, rows, _, _ in reads if name == "model.layers.1.mlp.up_proj") < out


def test_windows_are_bounded_contiguous_and_on_the_step():
    blocks = validation.row_blocks(28672, 8192)
    for step in (32, 96):
        windows = validation.row_windows_read(blocks, 8192, 28672, step)
        assert windows[0][0] == 0 and windows[-1][1] == 28672
        assert all(w[0] % step == 0 and (w[1] % step == 0 or w[1] == 28672) for w in windows)
        covered = [blocks[i] for w in windows for i in range(w[2], w[3])]
        assert covered == blocks
        assert max(w[1] - w[0] for w in windows) * 8192 <= validation.WINDOW_ELEMENTS + step * 8192
    # Sampled rows: each spread window is its own read, never the rows between them.
    sampled = validation.row_windows(28672)
    windows = validation.row_windows_read(sampled, 8192, 28672, 32)
    assert [(w[0], w[1]) for w in windows] == [tuple(s) for s in sampled]
    assert np.sum([w[1] - w[0] for w in windows]) == 4096
