"""The format registry's contract, run over every registered target: the tensors a target predicts
before any data (leaves) are exactly what its encoder stores, and what it stores reads back, through
the family that reads it, as the codes, zero points and scales it was given. A lookup miss lists what
is registered."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from qconv.formats.checkpoint import open_target
from qconv.formats.reader import read_module, require_decodable
from qconv.formats.registry import family, target, targets

from conftest import CHECKPOINTS

# A producer-made module each target holds without touching codes.
SOURCE = {"compressed-tensors-w8a8": "llama-ct-w8a8", "awq": "llama-awq-w4g128"}
DEFAULT_SOURCE = "llama-ct-w4a16"
MODULE = "model.layers.1.mlp.down_proj"
_TORCH = {"I32": torch.int32, "I64": torch.int64, "I8": torch.int8, "F16": torch.float16,
          "BF16": torch.bfloat16, "F32": torch.float32}


def _source(name):
    comp = open_target(CHECKPOINTS / name).components[0]
    det = require_decodable(comp)
    m = next(m for m in det.modules if m.name == MODULE)
    return read_module(comp, det, m, "float16")


@pytest.mark.parametrize("name", [t.name for t in targets()])
def test_leaves_are_what_the_encoder_stores_and_it_reads_back(tmp_path, name):
    tgt = target(name)
    qt = _source(SOURCE.get(name, DEFAULT_SOURCE))
    spec = replace(qt.spec, zero_encoding="v2" if name == "gptq-v2" else "v1" if tgt.family == "gptq" else None)
    if name == "auto-round":
        spec = replace(spec, symmetric=True)
    qt = replace(qt, spec=spec)
    g_idx = tgt.g_idx == "always"
    stored = tgt.encode(qt, spec, g_idx)
    predicted = tgt.leaves(spec, qt.shape, g_idx)
    assert {k: (d, tuple(a.shape)) for k, (d, a) in stored.items()} == \
        {k: (d, tuple(shape)) for k, (d, shape) in predicted.items()}
    # Written with the target's own config, the family that reads it gets the same module back.
    from qconv.formats.registry import WriteContext
    import json

    folder = tmp_path / name
    folder.mkdir()
    arrays = {}
    for leaf, (dtype, values) in stored.items():
        t = torch.from_numpy(np.ascontiguousarray(values))
        arrays[f"{MODULE}.{leaf}"] = t.view(torch.int16).view(torch.bfloat16) if dtype == "BF16" else t.to(_TORCH[dtype])
    save_file(arrays, folder / "model.safetensors")
    qc = tgt.config(WriteContext({MODULE: spec}, (), False, None))
    (folder / "config.json").write_text(json.dumps({"quantization_config": qc, "dtype": "float16"}))
    comp = open_target(folder).components[0]
    det = require_decodable(comp)
    (m,) = det.modules
    assert m.family == tgt.family and family(m.family).method
    back = read_module(comp, det, m, "float16")
    assert np.array_equal(back.codes, qt.codes) and np.array_equal(back.zeros, qt.zeros)
    assert np.array_equal(back.scales, qt.scales)


def test_a_lookup_miss_lists_what_is_registered():
    with pytest.raises(KeyError, match="registered: .*awq.*compressed-tensors"):
        target("gguf")
    with pytest.raises(KeyError, match="no format family 'gguf'; registered: .*bnb8"):
        family("gguf")
