"""Where ``gyre submit`` finds the cluster's Ray auth token, and its one-line refusals (the
real head with token authentication is in tests/integration/test_ray_submit.py, slow)."""

from __future__ import annotations

import pytest

from gyre.runners.submit import SubmitError, read_token


@pytest.fixture
def clean(monkeypatch, tmp_path):
    for var in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    return monkeypatch


def test_token_sources_in_order(clean, tmp_path):
    assert read_token() == (None, "no token")
    default = tmp_path / ".ray" / "auth_token"
    default.parent.mkdir()
    default.write_text("d" * 32 + "\n")
    assert read_token() == ("d" * 32, str(default))
    named = tmp_path / "named"
    named.write_text("p" * 32)
    clean.setenv("RAY_AUTH_TOKEN_PATH", str(named))
    assert read_token() == ("p" * 32, "RAY_AUTH_TOKEN_PATH")
    clean.setenv("RAY_AUTH_TOKEN", "e" * 32)
    assert read_token() == ("e" * 32, "RAY_AUTH_TOKEN")
    given = tmp_path / "given"
    given.write_text("f" * 32)
    assert read_token(str(given)) == ("f" * 32, f"--token-file {given}")


def test_missing_or_empty_token_files_are_one_line(clean, tmp_path):
    with pytest.raises(SubmitError, match=r"^--token-file '/nope': no such file$"):
        read_token("/nope")
    clean.setenv("RAY_AUTH_TOKEN_PATH", "/nope2")
    with pytest.raises(SubmitError, match=r"^RAY_AUTH_TOKEN_PATH '/nope2': no such file$"):
        read_token()
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(SubmitError, match=r"^the token from --token-file .*empty is empty$"):
        read_token(str(empty))


def test_the_cli_takes_no_token_argument():
    """A token on the command line would land in shell history and ``ps``: only a file or the
    environment (and ``--token`` is not taken as an abbreviation of ``--token-file``)."""
    from gyre.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["submit", "--token", "abc", "--address", "http://127.0.0.1:1"])
    assert exc.value.code == 2
