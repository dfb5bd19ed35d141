"""W8A8's activation-cost report on large layers: measured on windows of output channels spread over the
layer (convert/activation_cost.py), each side read a window at a time. The fixtures' layers are small, so
the window size is lowered here to make every layer a sampled one; the estimate must agree with the
whole-layer figure, through each source kind's reader (bitsandbytes' own LLM.int8 matmul, a packed GPTQ
source read by row windows, a float source)."""

import numpy as np
import pytest

from qconv.convert import activation_cost as ac
from qconv.formats.core.reader import require_decodable
from qconv.formats.storage.checkpoint import open_target

from conftest import CHECKPOINTS, run_qconv


def test_windows_start_on_the_readers_row_steps():
    assert ac.channel_windows(ac.MAX_CHANNELS) == [(0, ac.MAX_CHANNELS)]
    windows = ac.channel_windows(18432, 32)
    assert len(windows) == ac.WINDOWS and windows[0] == (0, 64) and windows[-1][1] <= 18432
    assert all(r0 % 32 == 0 and r1 - r0 == 64 for r0, r1 in windows)
    assert all(b[0] >= a[1] for a, b in zip(windows, windows[1:]))            # disjoint, in order
    assert all(r1 - r0 == 192 for r0, r1 in ac.channel_windows(100_000, 192))  # a step above 64 rows


@pytest.mark.parametrize("name", ["llama-bnb8", "llama-gptq-w4g128-actorder", "llama-fp16"])
def test_sampled_channels_estimate_the_whole_layer(tmp_path, monkeypatch, name):
    run_qconv("convert", CHECKPOINTS / name, tmp_path / "out", "--to", "compressed-tensors-w8a8", check=0)
    src = open_target(CHECKPOINTS / name).components[0]
    out = open_target(tmp_path / "out").components[0]
    det = require_decodable(src)
    modules = list(det.modules)
    if not modules:                                       # a float source: the Linears convert quantized
        from qconv.convert.convert import Options
        from qconv.formats.core.source import data_free_modules as _data_free_modules
        modules = _data_free_modules(src, Options("compressed-tensors-w8a8"))
    whole = {r["module"]: r for r in ac.activation_cost(src, det, modules, out)["layers"]}
    monkeypatch.setattr(ac, "MAX_CHANNELS", 64)
    monkeypatch.setattr(ac, "WINDOWS", 4)
    monkeypatch.setattr(ac, "WINDOW_ROWS", 32)
    sampled = ac.activation_cost(src, det, modules, out)
    assert sampled["source_matmul"] == ac.activation_cost(src, det, modules[:1], out)["source_matmul"]
    assert len(sampled["layers"]) == len(whole) == 14
    out_features = {m.name: m.out_features for m in modules}
    large = [r for r in sampled["layers"] if out_features[r["module"]] > 4 * 32]
    assert len(large) >= 10
    # other channels than the whole layer's: other figures (to the report's 6 decimals)
    assert sum(r["vs_source_matmul"] != whole[r["module"]]["vs_source_matmul"] for r in large) >= len(large) - 1
    for r in sampled["layers"]:
        w = whole[r["module"]]
        for key in ("vs_source_matmul", "source_matmul_vs_float", "int8_activations_vs_float"):
            if out_features[r["module"]] <= 4 * 32:       # no more channels than the windows hold: whole
                assert r[key] == w[key], (r["module"], key)
                continue
            assert np.isclose(r[key], w[key], rtol=0.35, atol=1e-4), (r["module"], key, r[key], w[key])
