"""`partq produce`'s JSON-lines parsing: one Line per valid line, one error text per bad one."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from partq.cli import main
from partq.cli.produce import SOURCE, Line, _lines, parse_lines


def parse(text: str) -> list[Line | str]:
    return list(parse_lines(io.StringIO(text)))


def test_valid_lines_become_lines_with_their_numbers() -> None:
    # Given two valid JSON lines
    text = '{"key": "k1", "body": "hello"}\n{"key": "k2", "body": "world"}\n'
    # When they are parsed
    lines = parse(text)
    # Then each is a Line with its 1-based number, key and UTF-8 body
    assert lines == [
        Line(1, "k1", b"hello", None, None),
        Line(2, "k2", b"world", None, None),
    ]


def test_non_string_body_is_sent_as_json() -> None:
    # Given bodies that are objects, lists and numbers
    text = '{"key": "a", "body": {"n": 1}}\n{"key": "b", "body": [1, 2]}\n{"key": "c", "body": 3}\n'
    # When parsed
    bodies = [line.body for line in parse(text) if isinstance(line, Line)]
    # Then each body is its JSON encoding
    assert [json.loads(b) for b in bodies] == [{"n": 1}, [1, 2], 3]


def test_unicode_body_is_utf8() -> None:
    # Given a body with non-ASCII text
    [line] = parse('{"key": "ключ", "body": "héllo ✓"}\n')
    # Then key stays text and the body is UTF-8 bytes
    assert isinstance(line, Line)
    assert line.key == "ключ"
    assert line.body == "héllo ✓".encode()


def test_headers_and_message_id_are_kept() -> None:
    # Given a line with headers and a numeric message id
    [line] = parse('{"key": "k", "body": "b", "headers": {"h": "v"}, "message_id": 42}\n')
    # Then both are carried, the id as a string
    assert isinstance(line, Line)
    assert line.headers == {"h": "v"}
    assert line.message_id == "42"


def test_blank_lines_are_skipped_but_counted() -> None:
    # Given blank lines between valid ones
    text = '\n{"key": "k", "body": "1"}\n   \n{"key": "k", "body": "2"}\n'
    # When parsed
    lines = parse(text)
    # Then only the valid lines come out, numbered as in the file
    assert [line.number for line in lines if isinstance(line, Line)] == [2, 4]
    assert all(isinstance(line, Line) for line in lines)


def test_last_line_without_newline() -> None:
    # Given a file whose last line has no newline
    lines = parse('{"key": "k", "body": "1"}\n{"key": "k", "body": "2"}')
    # Then it is parsed too
    assert [line.body for line in lines if isinstance(line, Line)] == [b"1", b"2"]


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("not json", "line 1: not JSON"),
        ('{"key": "k"', "line 1: not JSON"),
        ('["k", "b"]', 'line 1: expected an object with "key" and "body"'),
        ('"just a string"', 'line 1: expected an object with "key" and "body"'),
        ('{"body": "b"}', 'line 1: expected an object with "key" and "body"'),
        ('{"key": "k"}', 'line 1: expected an object with "key" and "body"'),
        ('{"key": 7, "body": "b"}', 'line 1: "key" must be a string, got int'),
        ('{"key": null, "body": "b"}', 'line 1: "key" must be a string, got NoneType'),
        ('{"key": "k", "body": "b", "headers": [1]}', 'line 1: "headers" must be an object'),
        (
            '{"key": "k", "body": "", "headers": {"x-partq-control": "purge"}}',
            "line 1: header 'x-partq-control' is partq's own (a dlq redrive or purge request)",
        ),
    ],
)
def test_invalid_line_gives_an_error_naming_it(raw: str, expected: str) -> None:
    # Given one invalid line
    # When parsed
    [result] = parse(raw + "\n")
    # Then the result is an error text that names the line and the problem
    assert isinstance(result, str)
    assert result.startswith(expected)


def test_invalid_lines_do_not_stop_parsing() -> None:
    # Given a bad line between two good ones
    text = '{"key": "a", "body": "1"}\n{oops\n{"key": "b", "body": "2"}\n'
    # When parsed
    lines = parse(text)
    # Then the good lines still come out, in order, and the bad one names line 2
    assert [type(line) for line in lines] == [Line, str, Line]
    assert isinstance(lines[1], str)
    assert lines[1].startswith("line 2: ")
    assert [line.key for line in lines if isinstance(line, Line)] == ["a", "b"]


def test_parsing_is_lazy() -> None:
    # Given a source that fails after the first line
    class Exploding(io.StringIO):
        def __iter__(self):  # type: ignore[no-untyped-def]
            yield '{"key": "k", "body": "1"}\n'
            raise RuntimeError("read past the first line")

    # When only the first result is taken
    first = next(parse_lines(Exploding()))
    # Then it is there without reading further (so stdin can be streamed)
    assert isinstance(first, Line)
    assert first.body == b"1"


def test_a_line_the_producer_cannot_send_is_invalid_with_its_number() -> None:
    # Given lines with a lone surrogate in the key, the body, a header; a header AMQP cannot
    # carry; and JSON nested 5,000 deep
    deep = '{"key": "k", "body": ' + "[" * 5000 + "]" * 5000 + "}"
    text = "\n".join(
        [
            '{"key": "\\ud800", "body": "b"}',
            '{"key": "k", "body": "\\udfff"}',
            '{"key": "k", "body": "b", "headers": {"h": "\\ud800"}}',
            '{"key": "k", "body": "b", "headers": {"h": 1.5}}',
            deep,
            '{"key": "k", "body": "fine"}',
        ]
    )
    # When parsed
    lines = parse(text + "\n")
    # Then each bad one is an error text naming its line and what is wrong; the last is sent
    assert lines[0] == 'line 1: "key" is not valid UTF-8 text (it holds a lone surrogate)'
    assert lines[1] == 'line 2: "body" is not valid UTF-8 text (it holds a lone surrogate)'
    assert isinstance(lines[2], str) and lines[2].startswith("line 3: header 'h' is not valid")
    assert isinstance(lines[3], str) and lines[3].startswith("line 4: header 'h' is a float")
    assert lines[4] == "line 5: JSON nested too deeply for this parser; flatten it"
    assert lines[5] == Line(6, "k", b"fine", None, None)


NOT_UTF8 = (  # line 2 holds a Latin-1 byte
    b'{"key": "k1", "body": "a"}\n{"key": "k2", "body": "caf\xe9"}\n{"key": "k3", "body": "c"}\n'
)


def test_a_byte_that_is_not_utf8_names_its_line_and_nothing_is_sent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 43, item 13: was exit 1, "UnicodeDecodeError: ... position 55", no line."""
    # Given a file whose line 2 holds a Latin-1 byte
    path = tmp_path / "lines.jsonl"
    path.write_bytes(NOT_UTF8)
    # When it is produced (nothing connects: the file is checked first)
    code = main(["produce", "orders", "--from", str(path)])
    # Then exit 2 and one line naming line 2, the byte, and what to do
    lines = capsys.readouterr().err.splitlines()
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith("partq: error: line 2: not UTF-8"), lines
    assert "0xe9" in lines[0] and "nothing sent" in lines[0]


def test_a_byte_that_is_not_utf8_is_skipped_under_skip_invalid(tmp_path: Path) -> None:
    # Given the same file, opened as --from opens it
    path = tmp_path / "lines.jsonl"
    path.write_bytes(NOT_UTF8)
    with SOURCE.convert(str(path), None, None) as source:
        # When its lines are read with --skip-invalid
        lines = list(_lines(None, None, source, skip_invalid=True))
    # Then line 2 is an invalid line naming itself, and lines 1 and 3 are sent
    assert [line.number for line in lines if isinstance(line, Line)] == [1, 3]
    [bad] = [line for line in lines if isinstance(line, str)]
    assert bad.startswith("line 2: not UTF-8")
