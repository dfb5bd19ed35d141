"""The format registry's contract, run over every registered target: the tensors a target predicts
before any data (leaves, with the settings its plan gives a module) are exactly what its encoder
stores, and what it stores reads back, through the family that reads it, as the codes, zero points and
scales it was given. A lookup miss lists what is registered."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from qconv.formats.storage.checkpoint import open_target
from qconv.formats.core.reader import read_module, require_decodable
from qconv.formats.core.registry import ModuleContext, Target, WriteContext, family, target, targets

from conftest import CHECKPOINTS

# A producer-made module each target holds without touching codes.
SOURCE = {"compressed-tensors-w8a8": "llama-ct-w8a8", "awq": "llama-awq-w4g128", "bnb8": "llama-bnb8",
          "bnb4-nf4": "llama-bnb4-nf4-dq", "bnb4-fp4": "llama-bnb4-fp4", "fp8": "llama-fp8-block",
          "compressed-tensors-fp8": "llama-ct-fp8-dynamic", "compressed-tensors-nvfp4": "llama-ct-nvfp4a16",
          "modelopt-nvfp4": "llama-modelopt-nvfp4", "compressed-tensors-mxfp4": "llama-ct-mxfp4"}
DEFAULT_SOURCE = "llama-ct-w4a16"
MODULE = "model.layers.1.mlp.down_proj"
_TORCH = {"I32": torch.int32, "I64": torch.int64, "I8": torch.int8, "U8": torch.uint8, "F16": torch.float16,
          "BF16": torch.bfloat16, "F32": torch.float32, "U32": torch.uint32}


def _tensors(name):
    """The checkpoint's tensor headers (ModuleContext.tensors: a plan reading a module's small state)."""
    return open_target(CHECKPOINTS / name).components[0].tensors


def _read(name):
    comp = open_target(CHECKPOINTS / name).components[0]
    det = require_decodable(comp)
    m = next(m for m in det.modules if m.name == MODULE)
    return m, read_module(comp, det, m, "float16")


def _source(name):
    return _read(name)[1]


def _kept(tgt, qt, spec, settings):
    """qt in the target's terms with its codes kept, as convert writes it (Target.retarget)."""
    return tgt.retarget(qt, spec, settings)[0] if tgt.overrides(Target.retarget) else qt


def _settings(tgt, m, spec, qt, g_idx, request=None, reason=None, make=None, tensors=None):
    """The settings the target's plan gives the module ({} without a plan), then its share hook as for
    a model of this one module; make(settings) -> the QuantTensor it encodes (default: qt kept)."""
    if not tgt.overrides(Target.plan):
        return {}
    from qconv.convert.convert import Options

    from qconv.formats.core.activation import static_activation

    make = make or (lambda trial: _kept(tgt, qt, spec, trial))
    settings = tgt.plan(ModuleContext(m, spec, reason, request or Options(tgt.name), qt.dtype,
                                      lambda trial: tgt.encode(make(trial), spec, g_idx), qt.dequantize, tensors,
                                      activation=static_activation(m, tensors or {})))
    return tgt.share({m.name: settings})[m.name]


def _shapes(stored):
    return {k: (d, tuple(a.shape)) for k, (d, a) in stored.items()}


@pytest.mark.parametrize("name", [t.name for t in targets()])
def test_leaves_are_what_the_encoder_stores_and_it_reads_back(tmp_path, name):
    tgt = target(name)
    m, qt = _read(SOURCE.get(name, DEFAULT_SOURCE))
    tensors = _tensors(SOURCE.get(name, DEFAULT_SOURCE))
    spec = replace(qt.spec, zero_encoding="v2" if name == "gptq-v2" else "v1" if tgt.family == "gptq" else None)
    if name == "auto-round":
        spec = replace(spec, symmetric=True)
    qt = replace(qt, spec=spec)
    g_idx = tgt.g_idx == "always"
    if tgt.overrides(Target.fit):            # a target fitting modules itself keeps this one's codes as they are
        from qconv.convert.convert import Options

        unfitted = lambda caps=None: (spec.bits, spec.group_size, spec.symmetric, None)  # noqa: E731
        assert tgt.fit(m, spec, Options(name), unfitted) in ((spec, None), None)   # None: the caps negotiation
    settings = _settings(tgt, m, spec, qt, g_idx, tensors=tensors)
    qt = _kept(tgt, qt, spec, settings)
    stored = tgt.encode(qt, spec, g_idx)
    predicted = tgt.module_leaves(spec, qt.shape, g_idx, settings)
    assert _shapes(stored) == {k: (d, tuple(shape)) for k, (d, shape) in predicted.items()}
    # Written with the target's own config, the family that reads it gets the same module back.
    import json

    folder = tmp_path / name
    folder.mkdir()
    arrays = {}
    for leaf, (dtype, values) in stored.items():
        t = torch.from_numpy(np.ascontiguousarray(values))
        if dtype == "BF16":
            t = t.view(torch.int16).view(torch.bfloat16)
        elif dtype == "F8_E4M3":
            t = t.view(torch.uint8).view(torch.float8_e4m3fn)
        else:
            t = t.to(_TORCH[dtype])
        arrays[f"{MODULE}.{leaf}"] = t
    save_file(arrays, folder / "model.safetensors")
    qc = tgt.quantization_config(WriteContext({MODULE: spec}, (), False, None, {MODULE: settings}))
    (folder / "config.json").write_text(json.dumps({"quantization_config": qc, "dtype": "float16"}))
    comp = open_target(folder).components[0]
    det = require_decodable(comp)
    (m,) = det.modules
    assert m.family == tgt.family and family(m.family).method
    back = read_module(comp, det, m, "float16")
    assert np.array_equal(back.codes, qt.codes) and np.array_equal(back.zeros, qt.zeros)
    assert np.array_equal(back.scales, qt.scales)
    if qt.double_quant is not None:          # bitsandbytes' double quantization, kept as it was
        assert back.double_quant is not None and np.array_equal(back.double_quant.codes, qt.double_quant.codes)
        assert back.double_quant.offset == qt.double_quant.offset


def test_a_lookup_miss_lists_what_is_registered():
    with pytest.raises(KeyError, match="registered: .*awq.*compressed-tensors"):
        target("exl2")
    with pytest.raises(KeyError, match="no format family 'exl2'; registered: .*bnb8"):
        family("exl2")


# Targets whose plan settles per-module settings: a requantized module too stores exactly the planned
# tensors (bitsandbytes: the double-quant offset, learnt by encoding once, sizes the quant_state JSON;
# compressed-tensors-fp8: scales in the model dtype). name -> (source, request options).
REQUANTIZED = {"bnb4-nf4": ("llama-bnb4-fp4", dict(block_size=128, double_quant=True, quant_storage="float32")),
               "bnb4-fp4": ("llama-bnb4-nf4-dq", dict(block_size=128, double_quant=True, quant_storage="float32")),
               "compressed-tensors-fp8": ("llama-ct-w4a16", dict(block_size=(128, 128))),
               "compressed-tensors-nvfp4": ("llama-ct-w4a16", {})}


# (modelopt-nvfp4 requantizes nothing: its plan refuses every source whose codes it cannot keep,
# test_modelopt_nvfp4_writer.py)
@pytest.mark.parametrize("name", [t.name for t in targets() if t.overrides(Target.plan) and t.overrides(Target.requantize)])
def test_planned_settings_are_what_a_requantized_module_stores(name):
    from qconv.convert.convert import Options

    tgt = target(name)
    src, options = REQUANTIZED[name]
    m, source = _read(src)
    request = Options(name, **options)
    spec, reason = tgt.fit(m, source.spec, request, None)
    assert reason and spec.group_size == (16 if name == "compressed-tensors-nvfp4" else 128)
    w = source.dequantize()
    make = lambda trial: tgt.requantize(source, w, spec, trial)[0]  # noqa: E731
    settings = _settings(tgt, m, spec, source, False, request, reason, make)
    qt = make(settings)
    stored = tgt.encode(qt, spec, False)
    assert _shapes(stored) == {k: (d, tuple(shape))
                               for k, (d, shape) in tgt.module_leaves(spec, qt.shape, False, settings).items()}
    if tgt.family == "bnb4":
        assert spec.storage == "F32" and settings["double_quant"] and settings["nested_offset"] is not None
        assert float(qt.double_quant.offset) == settings["nested_offset"]
    elif name == "compressed-tensors-nvfp4":  # one global scale, 2688 / absmax in the model dtype
        g = settings["global_scale"]
        assert g == np.float32(np.float16(448 * 6) / np.float16(np.abs(w).max())) or \
            abs(g * np.abs(w).max() / 2688 - 1) < 2.0**-10
        assert stored["weight_global_scale"][1].tolist() == [g]
    else:                                    # compressed-tensors-fp8: llm-compressor's scales, in the model dtype
        assert settings == {"scale_dtype": "F16"} and stored["weight_scale"][0] == "F16"


def test_a_plan_refuses_packed_bytes_its_storage_cannot_hold():
    """bitsandbytes 4-bit: 9 codes are 5 bytes, not a whole number of float32 items; refused before any
    data is read (the plan's encoder is never called), and the leaves say why."""
    from qconv.convert.convert import Options
    from qconv.errors import UnsupportedFormat
    from qconv.formats.core.layout import QuantModule

    tgt = target("bnb4-nf4")
    m = QuantModule("layer", "float", "float16", 16, 3, 3, ("layer.weight",), (), details={"dtype": "float16"})
    spec, reason = tgt.fit(m, _source("llama-bnb4-fp4").spec, Options("bnb4-nf4", quant_storage="float32"), None)

    def never(trial):
        raise AssertionError("encoded")

    with pytest.raises(UnsupportedFormat, match="5 packed bytes cannot be stored as F32"):
        tgt.plan(ModuleContext(m, spec, reason, Options("bnb4-nf4"), "float16", never))
    with pytest.raises(ValueError, match="5 packed bytes cannot be stored as F32"):
        tgt.module_leaves(spec, (3, 3), False)


def test_the_registry_imports_no_numpy():
    """Targets' numpy hooks are bound lazily: `inspect` imports the registry, never numpy."""
    import subprocess
    import sys

    code = "import sys, qconv.formats.core.registry as r; r.targets(); assert 'numpy' not in sys.modules, 'numpy'"
    subprocess.run([sys.executable, "-c", code], check=True)
