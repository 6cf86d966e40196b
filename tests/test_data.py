"""grpo.data: prompt files and columns, checked row by row with the file and line named."""

from __future__ import annotations

import pytest

from grpo.data import columns_of
from grpo.data import load_jsonl


def test_columns_of_refuses_a_column_missing_from_some_rows():
    rows = [{"prompt": "a", "answer": "1"}, {"prompt": "b"}, {"prompt": "c", "answer": "3"}]
    with pytest.raises(ValueError, match=r"row 1 has no 'answer' column"):
        columns_of(rows, 2)
    rows = [{"prompt": "a"}, {"prompt": "b", "tests": ["assert True"]}]  # not taken from the first row only
    with pytest.raises(ValueError, match=r"row 0 has no 'tests' column"):
        columns_of(rows, 2)
    rows = [{"prompt": "a", "answer": None}, {"prompt": "b", "answer": "2"}]  # an explicit None is a value
    assert columns_of(rows, 2) == {"answer": [None, None, "2", "2"]}


@pytest.mark.parametrize(
    "content, message",
    [
        (b'{"prompt": "a"}\n{"prompt": "b",\n', r":2: not valid JSON"),
        (b'{"prompt": "a"}\n\n{"prompt": "\xff\xfe"}\n', r":3: not UTF-8"),
        (b'{"prompt": "a"}\n["b"]\n', r":2: expected a JSON object"),
        (b'{"prompt": "a"}\n{"prompt": 3}\n', r":2: the prompt must be a str"),
        (b'{"prompt": ""}\n{"prompt": ""}\n', r":1: empty prompt"),
        (b'{"prompt": "a", "answer": "1"}\n{"prompt": "b"}\n', r":2 has no 'answer' column"),
    ],
)
def test_a_bad_jsonl_record_is_named_by_file_and_line(tmp_path, content, message):
    path = tmp_path / "data.jsonl"
    path.write_bytes(content)
    with pytest.raises((ValueError, TypeError), match=f"{path}{message}"):
        load_jsonl(str(path))


def test_jsonl_with_a_byte_order_mark_and_crlf_loads(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"question": "1+1=", "answer": "2"}\r\n{"question": "2+2=", "answer": "4"}\r\n')
    assert load_jsonl(str(path), "question") == [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]
