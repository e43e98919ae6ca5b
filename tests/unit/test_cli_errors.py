"""Every error of the `partq` command is one line (`partq: error: …`) and at most one hint
line; `--debug` adds the traceback. Nothing here needs a server: each case fails first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from partq.cli import main
from partq.kernel.terminal import printable


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str]]:
    code = main(list(argv))
    err = capsys.readouterr().err
    return code, err.splitlines()


def one_error(lines: list[str]) -> str:
    """The error line, checking the shape: one error line, at most one hint after it."""
    assert 1 <= len(lines) <= 2, lines
    assert lines[0].startswith("partq: error: "), lines
    if len(lines) == 2:
        assert lines[1].startswith("partq: hint: "), lines
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["status"], "Missing argument 'STREAM'"),
        (["stauts", "x"], "No such command 'stauts'"),
        (["status", "x", "--bogus"], "No such option '--bogus'"),
        (["move", "x", "-p", "zz", "--to", "m"], "'zz' is not a valid integer"),
        (["coordinator", "x", "--settle", "-1"], "-1"),
        (["consume", "x", "--handler", "h:h", "--drain-timeout", "-5"], "-5"),
        # issue 43, item 11: was 19,000 threads, then "can't start new thread"
        (["consume", "x", "--handler", "h:h", "--concurrency", "1000000"], "1<=x<=1024"),
    ],
)
def test_a_usage_error_is_one_line_and_a_hint(
    capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    # When the command is called wrongly
    code, lines = run(capsys, *argv)
    # Then exit 2, one error line saying what is wrong, one hint naming the --help
    assert code == 2
    assert says in one_error(lines)
    assert len(lines) == 2 and "--help" in lines[1]


def test_a_bad_toml_config_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # Given a config file that is not TOML
    config = tmp_path / "partq.toml"
    config.write_text("etcd_endpoints = [\n")
    # When any command loads it
    code, lines = run(capsys, "--config", str(config), "status", "x")
    # Then exit 2 and one line naming the file
    assert code == 2
    assert f"config file {config} is not valid TOML" in one_error(lines)


def test_an_etcd_cert_without_its_key_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    code, lines = run(capsys, "--etcd-cert", "/nonexistent/c.pem", "status", "x")
    assert code == 2
    assert "set both --etcd-cert and --etcd-key" in one_error(lines)


def test_an_unexpected_error_is_one_line_with_a_hint_and_debug_adds_the_traceback(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a command that fails in a way partq did not foresee
    import partq.cli.context

    def boom(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("boom\nsecond line \x1b[31mred")

    monkeypatch.setattr(partq.cli.context.Settings, "load", boom)
    # When it runs
    code, lines = run(capsys, "status", "x")
    # Then one line (its lines joined, escapes escaped) and a hint to use --debug
    assert code == 1
    assert one_error(lines) == r"partq: error: RuntimeError: boom second line \x1b[31mred"
    assert "--debug" in lines[1]
    # And with --debug the traceback comes first
    code, lines = run(capsys, "--debug", "status", "x")
    assert code == 1 and lines[0].startswith("Traceback")


def test_closed_stdin_is_one_line(tmp_path: Path) -> None:
    # Given `partq produce` started with its stdin closed (it fails before connecting)
    result = subprocess.run(
        [sys.executable, "-m", "partq", "produce", "s"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PARTQ_ETCD_ENDPOINTS": "http://127.0.0.1:9"},
        preexec_fn=lambda: os.close(0),
        check=False,
    )
    # Then one line saying what to give instead
    assert result.returncode == 2, result.stderr
    assert result.stderr == "partq: error: stdin is closed: give --from FILE, or --key and --body\n"


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("plain-key", "plain-key"),
        ("ключ ✓ 🎉", "ключ ✓ 🎉"),
        ("\x1b]0;owned\x07", r"\x1b]0;owned\x07"),
        ("a\nb\tc\r", r"a\x0ab\x09c\x0d"),
        ("\x9b31m", r"\x9b31m"),  # C1 CSI
        ("\u202eevil", r"\u202eevil"),  # bidi override
        ("x\u2028y", r"x\u2028y"),
        ("\ud800", r"\ud800"),
        ("\x7f", r"\x7f"),
    ],
)
def test_printable_escapes_terminal_controls_only(raw: str, shown: str) -> None:
    assert printable(raw) == shown


def test_a_handler_module_with_a_syntax_error_is_the_users_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 43, item 14: was exit 1, "an unexpected error ... report it"."""
    # Given a handler module whose line 2 is not Python
    (tmp_path / "broken.py").write_text("def handle(message):\n    return message +\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "broken", raising=False)
    # When a consumer is started with it
    code, lines = run(capsys, "consume", "orders", "--handler", "broken:handle")
    # Then exit 2 and one line naming the module, the line and what Python said
    assert code == 2
    assert one_error(lines).startswith(
        "partq: error: handler module 'broken' has a syntax error at line 2: invalid syntax"
    )
