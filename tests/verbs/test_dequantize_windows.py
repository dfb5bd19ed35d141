"""dequantize reads a large module a window of output rows at a time (convert/dequantize.read_windows,
Family.read with rows), so memory is bounded by a window, not by the module (issue 20, item 8: a
16384 x 16384 compressed-tensors module peaked at 2.4 GiB read whole). Read in small windows, every
fixture of every family dequantizes to the very same bytes as read whole."""

import pytest

from conftest import CHECKPOINTS, QUANTIZED
from qconv.convert import dequantize as dq


@pytest.mark.parametrize("name", QUANTIZED)
def test_small_windows_give_the_same_bytes(tmp_path, monkeypatch, name):
    dq.dequantize(CHECKPOINTS / name, tmp_path / "whole", dtype="float32")
    monkeypatch.setattr(dq, "WINDOW_ELEMENTS", 4096)          # 256 x 256 layers: windows of 32-64 rows
    seen = []
    original = dq.read_windows
    monkeypatch.setattr(dq, "read_windows", lambda m: seen.append(original(m)) or seen[-1])
    dq.dequantize(CHECKPOINTS / name, tmp_path / "windows", dtype="float32")
    assert any(len(w) > 1 for w in seen)                       # really windowed
    for w in seen:                                             # contiguous, every row once
        assert w[0][0] == 0 and all(a[1] == b[0] for a, b in zip(w, w[1:]))
    files = sorted(p.name for p in (tmp_path / "whole").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "windows").iterdir())
    for f in files:
        assert (tmp_path / "whole" / f).read_bytes() == (tmp_path / "windows" / f).read_bytes(), f
