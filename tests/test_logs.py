"""grpo.logs: a torn last line of the JSON log is dropped, a broken middle line is named."""

from __future__ import annotations

import pytest

from grpo import logs


def test_a_torn_last_log_line_is_dropped_and_a_broken_middle_line_named(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "rew')  # killed while writing step 3
    assert logs.RunLog(str(path), resume_step=2).records == [{"step": 1}, {"step": 2}]
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
    path.write_text('{"step": 1}\n{"step": 2, "re\n{"step": 3}\n')
    with pytest.raises(ValueError, match=rf"{path}:2: not valid JSON"):
        logs.RunLog(str(path), resume_step=3)
