"""`serve`'s --decode-compile default: auto, unless the flag or $RADIXSERVE_DECODE_COMPILE
says otherwise (tests/conftest.py sets it to off, so servers that tests start never compile
in the background); other commands and in-process engines keep EngineConfig's off."""

from __future__ import annotations

import pytest

from radixserve.cli import build_parser_for
from radixserve.engine.config import EngineConfig
from radixserve.server.cli import DECODE_COMPILE_ENV, serve_decode_compile


def serve_args(*flags: str):
    return build_parser_for(["serve"]).parse_args(["serve", *flags])


def test_the_test_suite_starts_servers_without_background_compiles():
    assert serve_decode_compile(serve_args()) == "off"


@pytest.mark.parametrize("env, flags, expected", [
    (None, (), "auto"),
    ("off", (), "off"),
    ("on", (), "on"),
    ("off", ("--decode-compile", "auto"), "auto"),
    (None, ("--decode-compile", "off"), "off"),
])
def test_serve_default_env_and_flag(monkeypatch, env, flags, expected):
    if env is None:
        monkeypatch.delenv(DECODE_COMPILE_ENV, raising=False)
    else:
        monkeypatch.setenv(DECODE_COMPILE_ENV, env)
    args = serve_args(*flags)
    args.decode_compile = serve_decode_compile(args)
    assert EngineConfig.from_args(args).decode_compile == expected


def test_in_process_engines_and_other_commands_stay_off(monkeypatch):
    monkeypatch.delenv(DECODE_COMPILE_ENV, raising=False)
    assert EngineConfig().decode_compile == "off"
    chat = build_parser_for(["chat"]).parse_args(["chat", "hi"])
    assert EngineConfig.from_args(chat).decode_compile == "off"
