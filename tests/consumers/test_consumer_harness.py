"""The consumer harness (tests/consumers/vllm_logprobs.py) tells a crash from a refusal and from a wrong
answer, with stand-in workers in place of vLLM (which crashes on its own only now and then): a native
crash is retried once and reported, a Python exception (a refusal) is never retried, and a run that
completed is compared, never retried, however wrong its answer."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))          # the harness scripts beside this file
import vllm_logprobs as harness  # noqa: E402

WORKER = r"""
import json, os, sys
from pathlib import Path
model, out = sys.argv[1], sys.argv[sys.argv.index("--worker-out") + 1]
kind = Path(model).name
marker = Path(model) / "crashed-once"
if kind == "crash-always" or (kind == "crash-once" and not marker.exists()):
    marker.touch()
    import resource
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))   # no core file left behind
    print("terminate called without an active exception", flush=True)
    os.abort()                                     # SIGABRT, exit -6: what vLLM's CPU build does
if kind == "refuse":
    print("(EngineCore pid=1) ERROR 12-03 11:53:39 [core.py:1] ValueError: Marlin does not support this")
    print("RuntimeError: Engine core initialization failed. See root cause above.")
    sys.exit(1)
logprob = -0.5 if kind == "float" else -3.0       # "wrong": far from the float run
positions = [[logprob, -1.0, -2.0] for _ in range(3)]
Path(out).write_text(json.dumps({"quant_method": None, "load_s": 0.0, "run_s": 0.0, "positions": positions}))
"""


@pytest.fixture
def worker(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    return [sys.executable, str(script)]


def _run(tmp_path, worker, kind):
    model = tmp_path / kind
    model.mkdir(exist_ok=True)
    logs = tmp_path / "logs"
    logs.mkdir(exist_ok=True)
    return harness.run_model(model, [1, 2, 3], logs, kind, timeout=60, worker=worker)


def test_a_crash_is_retried_once_and_reported(tmp_path, worker):
    result, error, _ = _run(tmp_path, worker, "crash-once")
    assert error is None and result["attempts"] == 2
    assert result["crashes"] == [{"exit_status": -6, "error": "terminate called without an active exception"}]


def test_two_crashes_are_a_failure_that_says_crash(tmp_path, worker):
    result, error, _ = _run(tmp_path, worker, "crash-always")
    assert result is None and error.startswith("crashed twice (exit -6, then -6)")


def test_a_refusal_is_never_retried(tmp_path, worker):
    result, error, _ = _run(tmp_path, worker, "refuse")
    assert result is None and error == "ValueError: Marlin does not support this"
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["refuse.log"]     # one attempt


def test_a_wrong_answer_is_never_retried_and_does_not_match(tmp_path, worker):
    wrong, error, _ = _run(tmp_path, worker, "wrong")
    right, _, _ = _run(tmp_path, worker, "float")
    assert error is None and wrong["attempts"] == 1 and wrong["crashes"] == []
    diff, _, _ = harness.compare(wrong["positions"], right["positions"], harness.DEFAULT_TOLERANCE)
    assert diff == pytest.approx(2.5)


def test_a_retried_crash_is_reported_as_a_warning():
    from conftest import VllmCrashRetried, report_crashes

    entry = {"quantized_crashes": [{"exit_status": -6, "error": "terminate called"}], "float_crashes": []}
    with pytest.warns(VllmCrashRetried, match=r"pair: vLLM crashed loading the quantized model \(exit -6"):
        report_crashes("pair", entry)

