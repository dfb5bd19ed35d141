"""The consumer harness (tests/consumers/vllm_logprobs.py) tells a crash from a refusal, from a wrong
answer and from a model this CPU's vLLM cannot run, with stand-in workers in place of vLLM (which
crashes on its own only now and then): a native crash is retried once in a new worker, which goes on
with the models after it; a Python exception (a refusal) is never retried; a run that completed is
compared, never retried, however wrong its answer; a missing W4A16 op is "cannot run here" only when
the worker's probe found vLLM's build without it."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))          # the harness scripts beside this file
import vllm_logprobs as harness  # noqa: E402

# A stand-in for the harness's --batch worker: the model folder's name says what it does.
WORKER = r"""
import json, os, sys, time
from pathlib import Path
plan = json.loads(Path(sys.argv[sys.argv.index("--batch") + 1]).read_text())
avx2 = "--isa" in sys.argv
def write(path, doc):
    Path(path + ".part").write_text(json.dumps(doc)); os.replace(path + ".part", path)
write(plan["probe"], {"library": "_C_AVX2" if avx2 else "_C", "forced_isa": "avx2" if avx2 else None,
                      "ops": {"cpu_gemm_wna16": not avx2}, "cpu_flags": []})
for job in plan["jobs"]:
    print("=== vllm_logprobs: model " + job["tag"], flush=True)
    kind = Path(job["model"]).name
    marker = Path(job["model"]) / "crashed-once"
    if kind == "crash-always" or (kind == "crash-once" and not marker.exists()):
        marker.touch()
        import resource
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))   # no core file left behind
        print("terminate called without an active exception", flush=True)
        os.abort()                                     # SIGABRT, exit -6: what vLLM's CPU build does
    if kind == "hang":
        time.sleep(600)
    if kind == "refuse":
        write(job["out"], {"error": "ValueError: Marlin does not support this"})
        continue
    if kind == "w4a16":
        if avx2:
            write(job["out"], {"error": "AttributeError: '_OpNamespace' '_C' object has no attribute 'cpu_gemm_wna16'"})
            continue
    logprob = -0.5 if kind in ("float", "w4a16") else -3.0       # "wrong": far from the float run
    positions = [[logprob, -1.0, -2.0] for _ in range(3)]
    write(job["out"], {"quant_method": None, "load_s": 0.0, "run_s": 0.0, "positions": positions})
"""


@pytest.fixture
def worker(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    return [sys.executable, str(script)]


def _run(tmp_path, worker, *kinds, timeout=60, isa=None):
    jobs = []
    for kind in kinds:
        model = tmp_path / kind
        model.mkdir(exist_ok=True)
        jobs.append((kind, model, [1, 2, 3]))
    logs = tmp_path / "logs"
    logs.mkdir(exist_ok=True)
    results, probe = harness.run_models(jobs, logs, timeout, isa=isa, worker=worker)
    return results, probe, logs


def test_a_crash_is_retried_once_in_a_new_worker_that_goes_on(tmp_path, worker):
    results, _, logs = _run(tmp_path, worker, "float", "crash-once", "wrong")
    result, error, _ = results["crash-once"]
    assert error is None and result["attempts"] == 2
    assert result["crashes"] == [{"exit_status": -6, "error": "terminate called without an active exception"}]
    assert results["float"][0]["attempts"] == 1 and results["wrong"][0]["attempts"] == 1
    # the first worker ran float and crashed on crash-once; the second started at crash-once
    assert [j["tag"] for j in json.loads((logs / "plan-2.json").read_text())["jobs"]] == ["crash-once", "wrong"]


def test_two_crashes_are_a_failure_that_says_crash_and_the_rest_still_run(tmp_path, worker):
    results, _, _ = _run(tmp_path, worker, "crash-always", "float")
    result, error, _ = results["crash-always"]
    assert result is None and error.startswith("crashed twice (exit -6, then -6)")
    assert results["float"][1] is None and results["float"][0]["attempts"] == 1


def test_a_refusal_is_never_retried(tmp_path, worker):
    results, _, logs = _run(tmp_path, worker, "refuse", "float")
    assert results["refuse"] == (None, "ValueError: Marlin does not support this", results["refuse"][2])
    assert sorted(p.name for p in logs.glob("worker-*.log")) == ["worker-1.log"]     # one worker, no retry


def test_a_model_that_hangs_is_killed_and_the_rest_go_on(tmp_path, worker):
    results, _, _ = _run(tmp_path, worker, "hang", "float", timeout=2)
    assert results["hang"][:2] == (None, "timed out after 2 s")
    assert results["float"][1] is None


def test_a_wrong_answer_is_never_retried_and_does_not_match(tmp_path, worker):
    results, _, _ = _run(tmp_path, worker, "wrong", "float")
    wrong, right = results["wrong"][0], results["float"][0]
    assert wrong["attempts"] == 1 and wrong["crashes"] == []
    diff, _, _ = harness.compare(wrong["positions"], right["positions"], harness.DEFAULT_TOLERANCE)
    assert diff == pytest.approx(2.5)


def test_a_missing_w4a16_op_is_cannot_run_here_only_where_the_probe_says_so(tmp_path, worker):
    """The same W4A16 model: run on a build with the op it matches; on one without it (the stand-in for
    --isa avx2) the engine's own error plus the probe make it "cannot run here", never a match."""
    (tmp_path / "w4a16").mkdir()
    (tmp_path / "float").mkdir()
    (tmp_path / "float" / "config.json").write_text("{}")        # another folder than w4a16 (not deduplicated)
    pairs = [(tmp_path / "w4a16", tmp_path / "float")]
    here, probe = harness.compare_pairs(pairs, tmp_path / "logs-512", 0.1, 60, worker=worker)
    assert probe["ops"]["cpu_gemm_wna16"] and here[0]["matched"] and here[0]["cannot_run_here"] is None
    avx2, probe = harness.compare_pairs(pairs, tmp_path / "logs-avx2", 0.1, 60, isa="avx2", worker=worker)
    (entry,) = avx2
    assert not entry["loaded"] and not entry["matched"]
    assert entry["cannot_run_here"].startswith("vLLM CPU cannot run W4A16 on this CPU: its _C_AVX2 kernel library")
    # the same error from a build that has the op is a failure, not an expected outcome
    assert harness.cannot_run_here(entry["error"], {"library": "_C", "ops": {"cpu_gemm_wna16": True}}) is None
    assert harness.cannot_run_here("ValueError: Marlin does not support this", probe) is None


def test_folders_with_the_same_files_are_loaded_once(tmp_path, worker):
    for name in ("float", "float-copy", "wrong"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"same" if name != "wrong" else b"other")
    pairs = [(tmp_path / "wrong", tmp_path / "float"), (tmp_path / "wrong", tmp_path / "float-copy")]
    entries, _ = harness.compare_pairs(pairs, tmp_path / "logs", 0.1, 60, worker=worker)
    (plan,) = [json.loads(p.read_text()) for p in (tmp_path / "logs").glob("plan-*.json")]
    assert [j["model"] for j in plan["jobs"]] == [str(tmp_path / "wrong"), str(tmp_path / "float")]
    assert [e["max_abs_logprob_diff"] for e in entries] == [2.5, 2.5]


def test_a_retried_crash_is_reported_as_a_warning():
    from conftest import VllmCrashRetried, report_crashes

    entry = {"quantized_crashes": [{"exit_status": -6, "error": "terminate called"}], "float_crashes": []}
    with pytest.warns(VllmCrashRetried, match=r"pair: vLLM crashed loading the quantized model \(exit -6"):
        report_crashes("pair", entry)
