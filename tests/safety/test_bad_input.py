"""Corrupt, truncated, hostile and inconsistent inputs, each made from a real checkpoint: one line on
stderr naming the file (and tensor) and the problem, a documented non-zero exit, no traceback, no
output on stdout, nothing changed, and no pickle ever executed."""

import hashlib
import json
import os
import pickle
import struct

import pytest
from safetensors.torch import load_file, save_file

from conftest import CHECKPOINTS, copy_checkpoint, run_qconv

NOT_FOUND, CORRUPT = 3, 4


def _rewrite_header(path, fn, *, raw=None):
    """Apply fn to the parsed header (or replace it with raw bytes), keeping the data as it was."""
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    if raw is None:
        header = json.loads(blob[8:8 + n])
        fn(header)
        raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + blob[8 + n:])


def _sharded(tmp_path, name="llama-bnb8"):
    """The checkpoint re-saved as two shards with a standard index."""
    src = copy_checkpoint(name, tmp_path)
    tensors = load_file(src / "model.safetensors")
    (src / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:]), 1):
        shard = f"model-0000{i}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, src / shard, metadata={"format": "pt"})
        weight_map.update({k: shard for k in part})
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return src


def _edit_index(folder, fn):
    p = folder / "model.safetensors.index.json"
    doc = json.loads(p.read_text())
    fn(doc["weight_map"])
    p.write_text(json.dumps(doc))


def _first_tensor(path):
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    return next(k for k in json.loads(path.read_bytes()[8:8 + n]) if k != "__metadata__")


# Each case: (make(tmp_path) -> (path to inspect, list of strings the message must contain), code)
def case_missing(t):
    return t / "nope", ["nope", "no such file or folder"]


def case_empty(t):
    (t / "empty").mkdir()
    return t / "empty", ["empty", "folder is empty"]


def case_no_safetensors(t):
    d = copy_checkpoint("llama-bnb8", t)
    (d / "model.safetensors").unlink()
    return d, [str(d), "no .safetensors weights"]


def case_not_safetensors_file(t):
    p = t / "notes.txt"
    p.write_text("hello")
    return p, ["notes.txt", "not a .safetensors file"]


def case_too_short(t):
    d = copy_checkpoint("llama-bnb8", t)
    (d / "model.safetensors").write_bytes(b"\x01\x02\x03")
    return d, ["model.safetensors", "too short"]


def case_truncated(t):
    d = copy_checkpoint("llama-bnb8", t)
    p = d / "model.safetensors"
    os.truncate(p, p.stat().st_size // 2)
    return d, ["model.safetensors", "tensor '", "run past the end", "truncated"]


def case_header_length_past_end(t):
    d = copy_checkpoint("llama-fp16", t)
    p = d / "model.safetensors"
    blob = bytearray(p.read_bytes())
    blob[:8] = struct.pack("<Q", len(blob) + 10)
    p.write_bytes(bytes(blob))
    return d, ["model.safetensors", "header length", "runs past the end"]


def case_header_too_large(t):
    d = copy_checkpoint("llama-fp16", t)
    p = d / "model.safetensors"
    blob = bytearray(p.read_bytes())
    blob[:8] = struct.pack("<Q", 2**62)
    p.write_bytes(bytes(blob))
    return d, ["model.safetensors", "above the 100000000-byte limit"]


def case_header_not_json(t):
    d = copy_checkpoint("llama-fp16", t)
    p = d / "model.safetensors"
    blob = p.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    _rewrite_header(p, None, raw=b"{" + b"\xff" * (n - 1))
    return d, ["model.safetensors", "not a valid JSON object"]


def case_overlapping_offsets(t):
    d = copy_checkpoint("llama-fp16", t)
    p = d / "model.safetensors"
    victim = {}

    def fn(h):
        entries = sorted(((v["data_offsets"], k) for k, v in h.items() if k != "__metadata__"))
        (b0, e0), k0 = entries[0]
        (b1, e1), k1 = entries[1]
        shift = min(16, e0 - b0)
        h[k1]["data_offsets"] = [b1 - shift, e1 - shift]
        victim["name"] = k1
    _rewrite_header(p, fn)
    return d, ["model.safetensors", "overlap"]


def case_offsets_out_of_range(t):
    d = copy_checkpoint("llama-fp16", t)
    p = d / "model.safetensors"

    def fn(h):
        last = max((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][1])
        b, e = h[last]["data_offsets"]
        h[last]["data_offsets"] = [b + 1024, e + 1024]
    _rewrite_header(p, fn)
    return d, ["model.safetensors", "run past the end"]


def case_shape_mismatch(t):
    d = copy_checkpoint("llama-bnb8", t)
    p = d / "model.safetensors"
    _rewrite_header(p, lambda h: h["model.layers.0.mlp.up_proj.weight"].update(shape=[512, 512]))
    return d, ["model.safetensors", "'model.layers.0.mlp.up_proj.weight'", "needs 262144 bytes",
               "span 131072"]


def case_unknown_dtype(t):
    d = copy_checkpoint("llama-bnb8", t)
    _rewrite_header(d / "model.safetensors", lambda h: h["model.norm.weight"].update(dtype="Q4_K"))
    return d, ["'model.norm.weight'", "unknown dtype 'Q4_K'"]


def case_trailing_bytes(t):
    d = copy_checkpoint("llama-bnb8", t)
    with open(d / "model.safetensors", "ab") as f:
        f.write(b"\0" * 100)
    return d, ["model.safetensors", "100 bytes after the last tensor"]


def case_index_missing_shard(t):
    d = _sharded(t)
    (d / "model-00002-of-00002.safetensors").unlink()
    return d, ["model.safetensors.index.json", "'model-00002-of-00002.safetensors', which does not exist"]


def case_index_outside_folder(t):
    d = _sharded(t)
    (t / "evil.safetensors").write_bytes((d / "model-00001-of-00002.safetensors").read_bytes())
    _edit_index(d, lambda wm: wm.update({k: "../evil.safetensors" for k in list(wm)[:3]}))
    return d, ["model.safetensors.index.json", "points outside the folder"]


def case_index_absolute_path(t):
    d = _sharded(t)
    _edit_index(d, lambda wm: wm.update({next(iter(wm)): "/etc/passwd"}))
    return d, ["model.safetensors.index.json", "'/etc/passwd'", "outside the folder"]


def case_index_symlink_out(t):
    d = _sharded(t)
    (t / "elsewhere.safetensors").write_bytes((d / "model-00002-of-00002.safetensors").read_bytes())
    (d / "model-00002-of-00002.safetensors").unlink()
    (d / "model-00002-of-00002.safetensors").symlink_to(t / "elsewhere.safetensors")
    return d, ["model.safetensors.index.json", "resolves outside the folder"]


def case_index_tensor_not_in_shard(t):
    d = _sharded(t)
    _edit_index(d, lambda wm: wm.update({"model.ghost.weight": "model-00001-of-00002.safetensors"}))
    return d, ["model.safetensors.index.json", "'model.ghost.weight'", "has no such tensor"]


def case_index_not_json(t):
    d = _sharded(t)
    (d / "model.safetensors.index.json").write_text('{"weight_map": {')
    return d, ["model.safetensors.index.json", "not valid JSON"]


def case_config_not_json(t):
    d = copy_checkpoint("llama-gptq-w4g64-asym", t)
    (d / "config.json").write_text("{'bits': 4,}")
    return d, ["config.json", "not valid JSON"]


def case_quantization_config_not_object(t):
    d = copy_checkpoint("llama-bnb8", t)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = "bitsandbytes"
    (d / "config.json").write_text(json.dumps(cfg))
    return d, ["config.json", "quantization_config must be a JSON object"]


def case_quant_state_not_json(t):
    d = copy_checkpoint("llama-bnb4-nf4-dq", t)
    p = d / "model.safetensors"
    from qconv.formats.storage.safetensors_header import read_header
    name = "model.layers.1.self_attn.o_proj.weight.quant_state.bitsandbytes__nf4"
    info = read_header(p).tensors[name]
    with open(p, "r+b") as f:
        f.seek(info.offset)
        f.write(b"\x00garbage")
    return d, ["model.safetensors", repr(name), "quant_state is not valid JSON"]


def case_duplicate_tensor_without_index(t):
    d = copy_checkpoint("llama-fp16", t)
    (d / "extra.safetensors").write_bytes((d / "model.safetensors").read_bytes())
    return d, ["'lm_head.weight'", "both extra.safetensors and model.safetensors"]


def case_model_index_not_json(t):
    d = t / "pipe"
    import shutil
    shutil.copytree(CHECKPOINTS / "pipeline-qwen3vl-bnb8", d)
    (d / "model_index.json").write_text("[")
    return d, ["model_index.json", "not valid JSON"]


def case_pipeline_component_truncated(t):
    import shutil
    d = t / "pipe"
    shutil.copytree(CHECKPOINTS / "pipeline-qwen3vl-bnb8", d)
    p = d / "text_encoder" / "model.safetensors"
    os.truncate(p, 1000)
    return d, ["text_encoder/model.safetensors"]


class _Boom:
    """Unpickling this creates a marker file: proof that a pickle was executed."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def case_pickle_only(t):
    d = copy_checkpoint("llama-fp16", t)
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(pickle.dumps(_Boom(t / "PWNED")))
    return d, [str(d), "only pickle weights", "never loads"]


def case_pickle_file(t):
    p = t / "pytorch_model.bin"
    p.write_bytes(pickle.dumps(_Boom(t / "PWNED")))
    return p, ["pytorch_model.bin", "only pickle weights"]


CASES = {name[5:]: (fn, NOT_FOUND if name[5:] in {
    "missing", "empty", "no_safetensors", "not_safetensors_file", "pickle_only", "pickle_file"} else CORRUPT)
    for name, fn in list(globals().items()) if name.startswith("case_")}


def _digest(root):
    if not root.exists():
        return None
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("as_json", [False, True])
def test_bad_input_gives_one_line_and_exit_code(tmp_path, case, as_json):
    make, code = CASES[case]
    path, needles = make(tmp_path)
    before = _digest(path)
    proc = run_qconv("inspect", *(["--json"] if as_json else []), path)
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("qconv: error: ")
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert "Traceback" not in proc.stderr
    assert _digest(path) == before
    assert not (tmp_path / "PWNED").exists()


def test_usage_error_exit_2():
    proc = run_qconv("inspect")
    assert proc.returncode == 2 and "Missing argument 'PATH'" in proc.stderr


@pytest.mark.parametrize("name", ["llama-fp16", "llama-ct-w4a16", "llama-awq-w4g128"])
def test_a_tensor_stored_in_two_shards_is_warned_and_refused(tmp_path, name):
    """A tensor in two shards, the index naming one: loaders that read the index and loaders that read
    every shard load different models. inspect warns (--strict exits 1); every writing verb and validate
    refuse (exit 4) naming the tensor and both shards, and write nothing."""
    src = _sharded(tmp_path / "work", name)
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    norm = "model.layers.0.input_layernorm.weight"
    mapped = index[norm]
    other = next(s for s in set(index.values()) if s != mapped)
    tensors = load_file(src / other)
    tensors[norm] = load_file(src / mapped)[norm] * 2
    save_file(tensors, src / other, metadata={"format": "pt"})
    before = _digest(src)
    proc = run_qconv("inspect", "--strict", src)
    assert proc.returncode == 1 and f"{norm} in {mapped} (the index's) and {other}" in proc.stdout
    for args in (["dequantize", src, tmp_path / "out"], ["convert", src, tmp_path / "out", "--to", "gptq"],
                 ["validate", src, src]):
        proc = run_qconv(*args)
        assert proc.returncode == CORRUPT and len(proc.stderr.splitlines()) == 1, proc.stderr
        assert f"tensor '{norm}': is stored in both {mapped}" in proc.stderr and other in proc.stderr
        assert not (tmp_path / "out").exists()
    assert _digest(src) == before
