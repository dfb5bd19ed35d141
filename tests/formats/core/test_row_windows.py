"""Row windows: every family reads output rows r0:r1 of a module from only those rows' bytes (what
lets `qconv validate` hold a bounded part of any layer), and gets exactly the whole read's rows."""

import math
import os

import numpy as np
import pytest

from conftest import ALL_CHECKPOINTS, CHECKPOINTS
from qconv.errors import CorruptCheckpoint
from qconv.formats.storage.checkpoint import open_target
from qconv.formats.core.ir import FloatWeight
from qconv.formats.core.reader import model_dtype, read_module, require_decodable
from qconv.formats.core.registry import family
from qconv.formats.storage.safetensors_header import read_header
from qconv.formats.storage.tensor_io import read_array


def _components():
    for name in ALL_CHECKPOINTS:
        for comp in open_target(CHECKPOINTS / name).components:
            det = require_decodable(comp)
            if det.modules:
                yield pytest.param(comp, det, id=f"{name}/{comp.name}" if comp.name else name)


def _windows(out: int, step: int) -> list[tuple[int, int]]:
    """Three windows covering every row: a first, a middle one and the tail (ends on the step)."""
    a = min(out, step)
    b = min(out, a + 2 * step)
    return [(0, a), (a, b), (b, out)] if b < out else [(0, a), (a, out)]


@pytest.mark.parametrize("comp,det", list(_components()))
def test_a_window_is_the_whole_reads_rows(comp, det):
    dtype = model_dtype(comp, det)
    checked = 0
    for m in det.modules:
        fam = family(m.family)
        step = math.lcm(32, fam.row_step(m))
        if m.out_features <= step:
            continue
        whole = read_module(comp, det, m, dtype)
        for r0, r1 in _windows(m.out_features, step):
            part = read_module(comp, det, m, dtype, rows=(r0, r1))
            assert part.shape == (r1 - r0, m.in_features)
            if isinstance(part, FloatWeight):                 # no codes (MLX's min / max biases): its values
                assert np.array_equal(part.values.view(np.uint32), whole.values[r0:r1].view(np.uint32))
            elif not part.spec.flat:                       # codes [out, in] (integers, e4m3, e2m1)
                assert np.array_equal(part.codes, whole.codes[r0:r1])
                assert (part.zeros is None and whole.zeros is None) or np.array_equal(part.zeros, whole.zeros[r0:r1])
                assert np.array_equal(part.scales, whole.scales[r0:r1])
                assert (part.g_idx is None) == (whole.g_idx is None)
            else:
                inp, bs = m.in_features, part.spec.group_size
                assert np.array_equal(part.codes, whole.codes[r0 * inp:r1 * inp])
                assert np.array_equal(part.scales, whole.scales[r0 * inp // bs:-(-r1 * inp // bs)])
            got, want = part.dequantize_rows(0, r1 - r0), whole.dequantize_rows(r0, r1)
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (m.name, r0, r1)
            checked += 1
    assert checked, "no module had more than one window"


@pytest.mark.parametrize("name", ["llama-gptq-w4g64-asym", "llama-awq-w4g128", "llama-ct-w4a16-asym"])
def test_a_window_off_the_step_is_refused(name):
    comp = open_target(CHECKPOINTS / name).components[0]
    det = require_decodable(comp)
    m = det.modules[0]
    with pytest.raises(ValueError, match="rows 1:"):
        read_module(comp, det, m, model_dtype(comp, det), rows=(1, m.out_features))


def test_column_windows_read_only_their_bytes(tmp_path):
    from safetensors.numpy import save_file

    a = np.arange(9 * 40, dtype=np.int32).reshape(9, 40)
    save_file({"a": a}, str(tmp_path / "x.safetensors"))
    info = read_header(tmp_path / "x.safetensors").tensors["a"]
    assert np.array_equal(read_array(info, cols=(8, 24)), a[:, 8:24])
    assert np.array_equal(read_array(info, rows=(2, 7), cols=(0, 3)), a[2:7, 0:3])
    assert np.array_equal(read_array(info, cols=(0, 40)), a)
    assert read_array(info, cols=(5, 5)).shape == (9, 0)
    with pytest.raises(ValueError):
        read_array(info, cols=(30, 41))
    # Truncated below the last row's window: named, never short data.
    path = tmp_path / "x.safetensors"
    os.truncate(path, os.path.getsize(path) - 4 * 20)
    with pytest.raises(CorruptCheckpoint, match="truncated"):
        read_array(info, cols=(24, 32))


def _float_rows(comp, name):
    from qconv.formats.storage.tensor_io import to_float32

    info = comp.tensors[name]
    return to_float32(read_array(info), info.dtype).reshape(-1, info.shape[-1])


@pytest.mark.parametrize("name", ["llama-fp16", "qwen3moe-bf16"])
def test_an_unquantized_module_reads_through_the_registry_by_windows(name):
    """A float model's Linears (the "unquantized" family, which data-free conversion quantizes) read like
    any family's modules: whole, by windows, and an interleaved per-expert view (gpt-oss' gate / up rows,
    experts.split_interleaved) as every other row: each equal to the stored values."""
    from dataclasses import replace

    from qconv.formats.core.experts import split_interleaved
    from qconv.formats.core.request import Options
    from qconv.formats.core.source import data_free_modules

    comp = open_target(CHECKPOINTS / name).components[0]
    det = require_decodable(comp)
    modules = data_free_modules(comp, Options("gptq"))
    assert modules and {m.family for m in modules} == {"unquantized"}
    for m in modules[:12]:
        want = _float_rows(comp, m.weight_tensors[0])
        assert np.array_equal(np.asarray(read_module(comp, det, m, "float32").values), want)
        cut = m.out_features // 3
        part = read_module(comp, det, m, "float32", rows=(cut, m.out_features))
        assert np.array_equal(part.dequantize_rows(0, m.out_features - cut), want[cut:])
    parent = replace(modules[0], experts=2)               # two "experts" of interleaved gate / up rows
    raw = _float_rows(comp, parent.weight_tensors[0])
    for v in split_interleaved(parent):
        first = v.details["rows_of"][1]
        want = raw[first:first + 2 * v.out_features:2]
        assert np.array_equal(np.asarray(read_module(comp, det, v, "float32").values), want)
        assert np.array_equal(read_module(comp, det, v, "float32", rows=(1, 3)).dequantize_rows(0, 2), want[1:3])
