"""Paths and the file system, through the installed console script on real fixtures copied into
tmp_path: nothing is read from or written to outside SRC and DST, no non-regular file is read, no
pickle is carried, and a failure leaves no DST, no litter, no parent folder qconv created, and
everything under the work folder (SRC, and the victim beside it) exactly as it was.

Runs are interrupted or paused at known steps with the test-only QCONV_TEST_SIGNAL hook (the child
signals itself; see convert/staging.py), never by racing a timer."""

import hashlib
import json
import os
import pickle
import signal
import stat
import struct
import subprocess

import pytest

from conftest import CHECKPOINTS, QCONV, child_env, child_signals, copy_checkpoint, one_error as _one_error, run_qconv
from sweep_cases import snapshot

SECRET = "TOP-SECRET-MARKER qconv must never carry this"


# --- helpers ----------------------------------------------------------------------------------------

def _contents(root):
    """Relative path -> sha256 of every file of an output folder, which must hold no links."""
    out = {}
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            p = os.path.join(dirpath, name)
            assert stat.S_ISREG(os.lstat(p).st_mode), f"{p} is not a regular file"
            with open(p, "rb") as f:
                out[os.path.relpath(p, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _qconv(*args, env=None):
    return subprocess.run([QCONV, *map(str, args)], capture_output=True, text=True, timeout=120,
                          env=child_env(**(env or {})), preexec_fn=child_signals())


@pytest.fixture
def work(tmp_path):
    """Inputs live in tmp_path/work; outputs go to tmp_path/out (or deeper)."""
    w = tmp_path / "work"
    w.mkdir()
    (w / "secret.txt").write_text(SECRET)
    copy_checkpoint("llama-bnb8", w).rename(w / "victim")
    return w


def _pipeline(work):
    return copy_checkpoint("pipeline-qwen3vl-bnb8", work).rename(work / "pipe")


def _model(work, name="llama-bnb8"):
    return copy_checkpoint(name, work).rename(work / "model")


def _add_components(pipe, *keys):
    p = pipe / "model_index.json"
    doc = json.loads(p.read_text())
    doc.update({k: ["transformers", "X"] for k in keys})
    p.write_text(json.dumps(doc))


def _assert_untouched(tmp_path, work, before):
    assert snapshot(work) == before
    assert sorted(os.listdir(tmp_path)) == ["work"]          # no DST, no temp folder, no parents


# --- hostile inputs that qconv would read: every verb refuses -------------------------------------

def case_key_parent(w):
    pipe = _pipeline(w)
    _add_components(pipe, "../victim")
    return pipe, ["pipe/model_index.json", "'../victim'", "not a plain folder name"]


def case_key_absolute(w):
    pipe = _pipeline(w)
    _add_components(pipe, str(w / "victim"))
    return pipe, ["pipe/model_index.json", repr(str(w / "victim")), "not a plain folder name"]


def case_key_dot(w):
    pipe = _pipeline(w)
    _add_components(pipe, ".")
    return pipe, ["pipe/model_index.json", "'.'", "not a plain folder name"]


def case_key_nested(w):
    pipe = _pipeline(w)
    _add_components(pipe, "text_encoder/../../victim")
    return pipe, ["pipe/model_index.json", "'text_encoder/../../victim'", "not a plain folder name"]


def case_component_link_etc(w):
    pipe = _pipeline(w)
    (pipe / "scheduler").symlink_to("/etc")
    _add_components(pipe, "scheduler")
    return pipe, ["pipe/scheduler", "'/etc'", "outside the source folder"]


def case_component_link_victim(w):
    pipe = _pipeline(w)
    (pipe / "unet").symlink_to("../victim")
    _add_components(pipe, "unet")
    return pipe, ["pipe/unet", "outside the source folder"]


def case_weights_link_out(w):
    m = _model(w)
    (m / "model.safetensors").unlink()
    (m / "model.safetensors").symlink_to("../victim/model.safetensors")
    return m, ["model/model.safetensors", "resolves outside the source folder"]


def case_config_link_out(w):
    m = _model(w)
    (m / "config.json").unlink()
    (m / "config.json").symlink_to(w / "victim" / "config.json")
    return m, ["model/config.json", "resolves outside the source folder"]


def case_index_fifo(w):
    m = _model(w)
    os.mkfifo(m / "model.safetensors.index.json")
    return m, ["model/model.safetensors.index.json", "FIFO", "not a regular file"]


def case_index_dev_zero(w):
    m = _model(w)
    (m / "model.safetensors.index.json").symlink_to("/dev/zero")
    return m, ["model/model.safetensors.index.json", "'/dev/zero'", "character device"]


def case_config_fifo(w):
    m = _model(w)
    (m / "config.json").unlink()
    os.mkfifo(m / "config.json")
    return m, ["model/config.json", "FIFO"]


def case_weights_fifo(w):
    m = _model(w)
    (m / "model.safetensors").unlink()
    os.mkfifo(m / "model.safetensors")
    return m, ["model/model.safetensors", "FIFO"]


def case_model_index_fifo(w):
    pipe = _pipeline(w)
    (pipe / "model_index.json").unlink()
    os.mkfifo(pipe / "model_index.json")
    return pipe, ["pipe/model_index.json", "FIFO"]


def case_json_over_cap(w):
    m = _model(w)
    with open(m / "config.json", "r+b") as f:            # a sparse 1 GiB config.json
        f.truncate(1 << 30)
    return m, ["model/config.json", "larger than any real one"]


def _rewrite_header(path, fn):
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    fn(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + blob[8 + n:])


def case_metadata_list(w):
    m = _model(w)
    _rewrite_header(m / "model.safetensors", lambda h: h.update({"__metadata__": []}))
    return m, ["model/model.safetensors", "__metadata__", "found list"]


def case_metadata_not_strings(w):
    m = _model(w)
    _rewrite_header(m / "model.safetensors", lambda h: h.update({"__metadata__": {"format": 1}}))
    return m, ["model/model.safetensors", "__metadata__"]


READ_CASES = {n[5:]: fn for n, fn in globals().items() if n.startswith("case_")}
VERBS = {
    "inspect": lambda src, out: ("inspect", src),
    "dequantize": lambda src, out: ("dequantize", src, out),
    "bnb8-to-gptq": lambda src, out: ("bnb8-to-gptq", src, out),
    "validate": lambda src, out: ("validate", src, src),
}


@pytest.mark.parametrize("verb", sorted(VERBS))
@pytest.mark.parametrize("case", sorted(READ_CASES))
def test_hostile_input_is_refused_by_every_verb(tmp_path, work, case, verb):
    src, needles = READ_CASES[case](work)
    before = snapshot(work)
    proc = run_qconv(*VERBS[verb](src, tmp_path / "out"))
    _one_error(proc, 4, *needles)
    assert proc.stdout == ""
    _assert_untouched(tmp_path, work, before)


def test_metadata_null_is_accepted_as_safetensors_accepts_it(tmp_path, work):
    from safetensors import safe_open

    m = _model(work)
    _rewrite_header(m / "model.safetensors", lambda h: h.update({"__metadata__": None}))
    with safe_open(m / "model.safetensors", "np") as f:       # the reference reader takes it
        assert f.metadata() is None
    run_qconv("inspect", m, check=0)


# --- hostile files qconv would copy: writing verbs refuse, inspect (which does not read them) runs ---

def copy_case_pipeline_link_etc(w):
    pipe = _pipeline(w)
    (pipe / "extras").symlink_to("/etc")                       # not a component: would be copied
    return pipe, ["pipe/extras", "'/etc'", "outside the source folder"]


def copy_case_pipeline_file_link_out(w):
    pipe = _pipeline(w)
    (pipe / "notes.txt").symlink_to(w / "secret.txt")
    return pipe, ["pipe/notes.txt", "resolves outside the source folder"]


def copy_case_component_file_link_etc(w):
    pipe = _pipeline(w)
    (pipe / "tokenizer" / "vocab.txt").symlink_to("/etc/passwd")
    return pipe, ["pipe/tokenizer/vocab.txt", "'/etc/passwd'"]


def copy_case_model_file_link_out(w):
    m = _model(w)
    (m / "tokenizer.json").unlink()
    (m / "tokenizer.json").symlink_to("../secret.txt")
    return m, ["model/tokenizer.json", "resolves outside the source folder"]


def copy_case_fifo_in_component(w):
    pipe = _pipeline(w)
    os.mkfifo(pipe / "tokenizer" / "pipe.fifo")
    return pipe, ["pipe/tokenizer/pipe.fifo", "FIFO", "not a regular file"]


def copy_case_fifo_in_converted_component(w):
    pipe = _pipeline(w)
    os.mkfifo(pipe / "text_encoder" / "notes")
    return pipe, ["pipe/text_encoder/notes", "FIFO"]


def copy_case_fifo_in_model(w):
    m = _model(w)
    os.mkfifo(m / "notes")
    return m, ["model/notes", "FIFO"]


def copy_case_device_link(w):
    m = _model(w)
    (m / "zeros").symlink_to("/dev/zero")
    return m, ["model/zeros", "character device"]


def copy_case_dangling_link(w):
    m = _model(w)
    (m / "README.md").symlink_to("gone.md")
    return m, ["model/README.md", "'gone.md'", "does not exist"]


def copy_case_folder_loop(w):
    pipe = _pipeline(w)
    (pipe / "tokenizer" / "again").symlink_to("..")
    return pipe, ["pipe/tokenizer/again", "loop"]


COPY_CASES = {n[10:]: fn for n, fn in globals().items() if n.startswith("copy_case_")}


@pytest.mark.parametrize("verb", ["dequantize", "bnb8-to-gptq"])
@pytest.mark.parametrize("case", sorted(COPY_CASES))
def test_hostile_file_to_carry_is_refused(tmp_path, work, case, verb):
    src, needles = COPY_CASES[case](work)
    before = snapshot(work)
    proc = run_qconv(*VERBS[verb](src, tmp_path / "out"))
    _one_error(proc, 4, *needles)
    _assert_untouched(tmp_path, work, before)
    assert SECRET not in proc.stdout + proc.stderr


@pytest.mark.parametrize("case", sorted(COPY_CASES))
def test_inspect_reads_only_what_it_needs(tmp_path, work, case):
    src, _ = COPY_CASES[case](work)
    before = snapshot(work)
    run_qconv("inspect", src, check=0)
    _assert_untouched(tmp_path, work, before)


# --- links that stay inside SRC are followed, and copied as files -------------------------------------

def test_links_inside_source_are_copied_as_content(tmp_path, work):
    pipe = _pipeline(work)
    (pipe / "tokenizer_2").symlink_to("tokenizer")                          # a folder link
    (pipe / "tokenizer" / "alias.json").symlink_to("tokenizer_config.json")  # a file link
    (pipe / "text_encoder_2").symlink_to("text_encoder")                    # a component link
    _add_components(pipe, "text_encoder_2", "tokenizer_2")
    before = snapshot(work)
    out = tmp_path / "out"
    proc = run_qconv("bnb8-to-gptq", "--json", pipe, out, check=0)
    assert sorted(c["component"] for c in json.loads(proc.stdout)["components"]) == \
        ["text_encoder", "text_encoder_2"]
    files = _contents(out)                                                   # no links in DST
    tok = (pipe / "tokenizer" / "tokenizer_config.json").read_bytes()
    for rel in ("tokenizer/alias.json", "tokenizer_2/alias.json", "tokenizer_2/tokenizer_config.json"):
        assert (out / rel).read_bytes() == tok
    assert files["text_encoder/model.safetensors"] == files["text_encoder_2/model.safetensors"]
    assert snapshot(work) == before
    assert sorted(os.listdir(tmp_path)) == ["out", "work"]


# --- the Hugging Face cache: every snapshot file is a link to ../../blobs/<hash> ----------------------

def _hf_cache(work, folder, repo="models--org--model"):
    """Lay ``folder`` out as huggingface_hub's cache does and return the snapshot folder."""
    base = work / "hub" / repo
    blobs, snap = base / "blobs", base / "snapshots" / "4f1c0e1d2b"
    blobs.mkdir(parents=True, exist_ok=True)
    (base / "refs").mkdir(exist_ok=True)
    (base / "refs" / "main").write_text(snap.name)
    for p in sorted(folder.rglob("*")):
        target = snap / p.relative_to(folder)
        if p.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        data = p.read_bytes()
        blob = blobs / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(os.path.relpath(blob, target.parent))
    return snap


def _sharded_model(work):
    from test_bad_input import _sharded

    return _sharded(work).rename(work / "sharded")


@pytest.mark.parametrize("layout, verb", [("model", "dequantize"), ("sharded", "dequantize"),
                                          ("pipeline", "dequantize"), ("pipeline", "bnb8-to-gptq")])
def test_hugging_face_cache_snapshot_works(tmp_path, work, layout, verb):
    plain = {"model": _model, "sharded": _sharded_model, "pipeline": _pipeline}[layout](work)
    snap = _hf_cache(work, plain)
    assert all(p.is_symlink() for p in snap.rglob("*") if not p.is_dir())
    before = snapshot(work)
    report = json.loads(run_qconv("inspect", "--json", snap, check=0).stdout)
    assert {c["method"] for c in report["components"]} == {"bitsandbytes LLM.int8"}
    run_qconv(verb, snap, tmp_path / "from-cache", check=0)
    run_qconv(verb, plain, tmp_path / "from-folder", check=0)
    cached, folder = _contents(tmp_path / "from-cache"), _contents(tmp_path / "from-folder")
    # the model cards differ as their sources do: the snapshot's names its repository as the base model
    assert cached.pop("README.md") != folder.pop("README.md") and cached == folder
    card = (tmp_path / "from-cache" / "README.md").read_text()
    assert 'base_model: "org/model"' in card and "base_model" not in (tmp_path / "from-folder" / "README.md").read_text()
    run_qconv("validate", plain, snap, check=0)
    assert snapshot(work) == before


@pytest.mark.parametrize("which", ["config.json", "tokenizer.json"])
def test_hugging_face_cache_link_out_of_the_blobs_is_refused(tmp_path, work, which):
    snap = _hf_cache(work, _model(work))
    (snap / which).unlink()
    (snap / which).symlink_to(work / "secret.txt")
    before = snapshot(work)
    _one_error(run_qconv("dequantize", snap, tmp_path / "out"), 4, which, "resolves outside the source folder")
    _assert_untouched(tmp_path, work, before)


def test_blobs_rule_needs_a_real_cache_repository(tmp_path, work):
    snap = _hf_cache(work, _model(work), repo="not-a-cache-repo")
    before = snapshot(work)
    _one_error(run_qconv("inspect", snap), 4, "snapshots/4f1c0e1d2b/config.json",
               "resolves outside the source folder", "not-a-cache-repo/blobs/")
    _assert_untouched(tmp_path, work, before)


def test_source_may_itself_be_a_link(tmp_path, work):
    m = _model(work)
    (work / "alias").symlink_to("model")
    run_qconv("bnb8-to-gptq", work / "alias", tmp_path / "a" / "out", check=0)
    run_qconv("bnb8-to-gptq", m, tmp_path / "b" / "out", check=0)
    a, b = _contents(tmp_path / "a" / "out"), _contents(tmp_path / "b" / "out")
    assert a.pop("README.md") != b.pop("README.md") and a == b       # the card names SRC as it was given
    assert "qconv bnb8-to-gptq alias out" in (tmp_path / "a" / "out" / "README.md").read_text()


def test_destination_link_is_never_written_through(tmp_path, work):
    m = _model(work)
    (work / "elsewhere").mkdir()
    (tmp_path / "out").symlink_to(work / "elsewhere")
    before = snapshot(work)
    for extra in ([], ["--overwrite"]):
        _one_error(run_qconv("bnb8-to-gptq", *extra, m, tmp_path / "out"), 6, "out", "not a folder")
    assert snapshot(work) == before
    assert sorted(os.listdir(tmp_path)) == ["out", "work"]


# --- pickles are never carried --------------------------------------------------------------------

PICKLE = pickle.dumps({"harmless": True})


@pytest.mark.parametrize("verb", ["dequantize", "bnb8-to-gptq"])
def test_pickles_are_left_out_of_pipelines(tmp_path, work, verb):
    pipe = _pipeline(work)
    vae = pipe / "vae"
    vae.mkdir()
    for f in ("model.safetensors", "config.json"):
        (vae / f).write_bytes((CHECKPOINTS / "llama-fp16" / f).read_bytes())
    (vae / "diffusion_pytorch_model.bin").write_bytes(PICKLE)               # beside safetensors
    (pipe / "extra.pkl").write_bytes(PICKLE)                               # top level
    (pipe / "scheduler" / "deep").mkdir(parents=True)
    (pipe / "scheduler" / "scheduler_config.json").write_text("{}")
    (pipe / "scheduler" / "deep" / "state.PT").write_bytes(PICKLE)         # any depth, any case
    (pipe / "text_encoder" / "training_args.bin").write_bytes(PICKLE)     # in a converted component
    _add_components(pipe, "vae", "scheduler")
    before = snapshot(work)
    out = tmp_path / "out"
    proc = run_qconv(verb, "--json", pipe, out, check=0)
    result = json.loads(proc.stdout)
    assert result["left_out"] == ["extra.pkl", "scheduler/deep/state.PT", "vae/diffusion_pytorch_model.bin"]
    (text_encoder,) = result["components"]
    assert text_encoder["left_out"] == ["training_args.bin"]
    files = _contents(out)
    assert not [f for f in files if f.lower().endswith((".bin", ".pkl", ".pt"))], files
    assert {"vae/model.safetensors", "vae/config.json", "scheduler/scheduler_config.json"} <= set(files)
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("qconv: warning: ")]
    for name in ("extra.pkl", "scheduler/deep/state.PT", "vae/diffusion_pytorch_model.bin",
                 "text_encoder: left out 1 pickle file(s)"):
        assert any(name in w for w in warnings), (name, proc.stderr)
    assert snapshot(work) == before


def test_pickles_are_left_out_of_models(tmp_path, work):
    m = _model(work)
    (m / "training_args.bin").write_bytes(PICKLE)
    (m / "extra.pkl").write_bytes(PICKLE)
    proc = run_qconv("dequantize", m, tmp_path / "out", check=0)
    assert "training_args.bin" not in os.listdir(tmp_path / "out")
    assert "extra.pkl" not in os.listdir(tmp_path / "out")
    assert "qconv: warning: model: left out 2 pickle file(s)" in proc.stderr
    assert "extra.pkl, training_args.bin" in proc.stderr


# --- DST created or filled while qconv runs -------------------------------------------------------

def _paused(*args):
    """Start qconv and return it stopped (SIGSTOP) right before it renames its result onto DST."""
    proc = subprocess.Popen([QCONV, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=child_env(QCONV_TEST_SIGNAL="before-publish:SIGSTOP"),
                            preexec_fn=child_signals())
    _, status = os.waitpid(proc.pid, os.WUNTRACED)
    assert os.WIFSTOPPED(status), status
    return proc


def _resume(proc):
    os.kill(proc.pid, signal.SIGCONT)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


@pytest.mark.parametrize("existing", [False, True])
def test_destination_filled_meanwhile_is_not_replaced(tmp_path, work, existing):
    m = _model(work)
    out = tmp_path / "out"
    if existing:
        out.mkdir()                                  # an empty DST is fine at the start
    proc = _paused("bnb8-to-gptq", m, out)
    out.mkdir(exist_ok=True)
    (out / "keep.txt").write_text("mine")
    code, _, err = _resume(proc)
    assert code == 6 and err.count("\n") == 1 and "created or filled" in err, err
    assert "out" in err and "--overwrite" in err and "Traceback" not in err
    assert snapshot(out) == {"keep.txt": ("file", hashlib.sha256(b"mine").hexdigest())}
    assert sorted(os.listdir(tmp_path)) == ["out", "work"]


def test_two_runs_to_one_destination_one_wins(tmp_path, work):
    m = _model(work)
    out = tmp_path / "out"
    first = _paused("bnb8-to-gptq", m, out)
    run_qconv("bnb8-to-gptq", m, out, check=0)                # the second run finishes first
    won = _contents(out)
    code, _, err = _resume(first)
    assert code == 6 and "created or filled" in err, err
    assert _contents(out) == won
    assert sorted(os.listdir(tmp_path)) == ["out", "work"]


def test_overwrite_replaces_destination_filled_meanwhile(tmp_path, work):
    m = _model(work)
    out = tmp_path / "out"
    proc = _paused("bnb8-to-gptq", "--overwrite", m, out)
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, _, err = _resume(proc)
    assert code == 0, err
    assert "keep.txt" not in os.listdir(out) and (out / "model.safetensors").is_file()
    assert sorted(os.listdir(tmp_path)) == ["out", "work"]


# --- litter: signals, killed runs, parent folders ------------------------------------------------

@pytest.mark.parametrize("sig", ["SIGHUP", "SIGTERM", "SIGINT"])
def test_signal_leaves_nothing_not_even_parents(tmp_path, work, sig):
    m = _model(work)
    (tmp_path / "a").mkdir()                         # the user's: stays
    before = snapshot(work)
    proc = _qconv("dequantize", m, tmp_path / "a" / "b" / "c" / "out",
                  env={"QCONV_TEST_SIGNAL": f"tensor-written:{sig}"})
    assert proc.returncode == 130 and proc.stderr.strip() == "qconv: interrupted", proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["a", "work"] and os.listdir(tmp_path / "a") == []
    assert snapshot(work) == before


@pytest.mark.parametrize("sig", ["SIGHUP", "SIGINT"])
def test_a_signal_ignored_at_start_stays_ignored(tmp_path, work, sig):
    """`nohup qconv ...` (SIGHUP ignored) or `qconv ... &` from a script (a non-interactive shell starts
    background jobs with SIGINT ignored): qconv keeps the disposition it was started with, as every Unix
    tool does, so the run finishes when it gets that signal (docs/safety.md, "Signals")."""
    m = _model(work)
    proc = subprocess.run([QCONV, "bnb8-to-gptq", m, tmp_path / "out"], capture_output=True, text=True,
                          timeout=120, env=child_env(QCONV_TEST_SIGNAL=f"tensor-written:{sig}"),
                          preexec_fn=child_signals(getattr(signal, sig)))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert sorted(os.listdir(tmp_path)) == ["out", "work"]


def test_failure_removes_parent_folders_it_created(tmp_path, work):
    src = copy_checkpoint("llama-gptq-w4g64-asym", work)
    before = snapshot(work)
    proc = run_qconv("bnb8-to-gptq", src, tmp_path / "x" / "y" / "out")      # refused inside the staging
    _one_error(proc, 5, "not bitsandbytes LLM.int8")
    _assert_untouched(tmp_path, work, before)


def _dead_pid():
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_killed_run_litter_is_removed_by_the_next_run(tmp_path, work):
    m = _model(work)
    out = tmp_path / "out"
    proc = _qconv("bnb8-to-gptq", m, out, env={"QCONV_TEST_SIGNAL": "tensor-written:SIGKILL"})
    assert proc.returncode == -signal.SIGKILL
    (stale,) = [p for p in os.listdir(tmp_path) if p.startswith(".out.qconv-tmp-")]
    assert (tmp_path / stale / "model.safetensors").exists()          # a complete-looking output
    run_qconv("bnb8-to-gptq", m, out, check=0)
    assert sorted(os.listdir(tmp_path)) == ["out", "work"]


def test_stale_folders_of_dead_runs_only(tmp_path, work):
    m = _model(work)
    dead, alive = _dead_pid(), os.getpid()
    keep = [f".out.qconv-tmp-{alive}", f".other.qconv-tmp-{dead}", f".out.qconv-tmp-{dead}x",
            f"out.qconv-tmp-{dead}"]
    for name in keep + [f".out.qconv-tmp-{dead}", f".out.qconv-old-{dead}"]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "f").write_text(name)
    os.mkdir(tmp_path / "out")                           # DST is there: the old one is litter
    (tmp_path / "out" / "f").write_text("current")
    run_qconv("bnb8-to-gptq", "--overwrite", m, tmp_path / "out", check=0)
    assert sorted(os.listdir(tmp_path)) == sorted(keep + ["out", "work"])


def test_destination_set_aside_by_a_killed_run_is_put_back(tmp_path, work):
    """A run killed between its two renames (--overwrite) leaves DST only as .DST.qconv-old-PID."""
    m = _model(work)
    old = tmp_path / f".out.qconv-old-{_dead_pid()}"
    old.mkdir()
    (old / "f").write_text("previous output")
    proc = run_qconv("bnb8-to-gptq", m, tmp_path / "out")
    _one_error(proc, 6, "out", "not empty")
    assert (tmp_path / "out" / "f").read_text() == "previous output"
    assert sorted(os.listdir(tmp_path)) == ["out", "work"]


@pytest.mark.parametrize("args", [
    ["convert", "llama-ct-w4a16-asym", "OUT", "--to", "gptq", "--validate"],
    ["validate", "llama-gptq-w4g64-asym", "llama-gptq-w4g64-asym", "--kernels", "all"],
    ["validate", "llama-bnb4-nf4-dq", "llama-bnb4-nf4-dq"],
    ["bnb8-to-gptq", "llama-bnb8", "OUT", "--validate"],
    ["convert", "llama-ct-w4a16", "OUT", "--to", "compressed-tensors-w8a8"],
], ids=lambda a: "-".join(a[:1] + a[1:2]) + ("-" + a[a.index("--to") + 1] if "--to" in a else ""))
def test_nothing_is_written_to_the_temporary_folder(tmp_path, args):
    """The producers' kernels (bitsandbytes, auto-round) import torch._dynamo, whose import makes torch's
    compile cache folder under the temporary folder (torchinductor_<user>); qconv keeps it from being
    made (probes.producer_imports): nothing but DST appears anywhere."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    argv = [str(tmp_path / "out") if a == "OUT" else str(CHECKPOINTS / a) if (CHECKPOINTS / a).is_dir() else a
            for a in args]
    proc = subprocess.run([QCONV, *argv], capture_output=True, text=True, timeout=300, preexec_fn=child_signals(),
                          env=child_env(TMPDIR=str(tmp)))
    assert proc.returncode == 0, proc.stderr
    assert os.listdir(tmp) == []
    assert sorted(os.listdir(tmp_path)) == (["out", "tmp"] if "OUT" in args else ["tmp"])
