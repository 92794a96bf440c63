"""The command lines' help and defaults: every flag of `dsa-trt` (runtime/cli.py) and of the builder
(builder/build.py) has help text, and the sampling flags default to SamplingParams' own defaults, the
one set the Python API and the Triton model use too."""

from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

from dsa_trt.builder import build
from dsa_trt.runtime import cli
from dsa_trt.runtime.sampling import SamplingParams


def subparsers(ap: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in ap._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_every_cli_flag_has_help():
    missing = [f"{name} {opt.option_strings[0]}" for name, sub in subparsers(cli.parser()).items()
               for opt in sub._actions if opt.option_strings and opt.dest != "help" and not opt.help]
    assert not missing, f"flags without help text: {missing}"


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_sampling_flags_default_to_sampling_params(command):
    defaults = {f.name: f.default for f in dataclasses.fields(SamplingParams) if f.default is not dataclasses.MISSING}
    sub = subparsers(cli.parser())[command]
    shared = {a.dest: a.default for a in sub._actions if a.dest in defaults}
    assert "temperature" in shared
    if command == "bench":  # its prompt count, lengths and seed describe the workload, not the sampling
        shared = {"temperature": shared["temperature"]}
    wrong = {k: (v, defaults[k]) for k, v in shared.items() if v != defaults[k]}
    assert not wrong, f"`dsa-trt {command}` defaults differ from SamplingParams' (flag, SamplingParams): {wrong}"


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"0 = greedy (default: {SamplingParams().temperature})" in text
    assert f"(default: {SamplingParams().max_tokens})" in text


def flags_without_help(help_text: str) -> list[str]:
    """The options of an argparse --help listing whose entry is only the flag and its metavar."""
    options = help_text[help_text.index("options:"):]
    bare = []
    for block in re.split(r"\n(?=  -)", options)[1:]:
        words = block.split()
        described = [w for w in words[1:] if not re.fullmatch(r"[A-Z_]+|\{[a-z0-9,]+\}|-[-a-z]+,?", w)]
        if not described:
            bare.append(words[0])
    return bare


def test_flags_without_help_are_found():
    ap = argparse.ArgumentParser(prog="x")
    ap.add_argument("--with-help", type=int, help="a number")
    ap.add_argument("--bare", choices=("a", "b"))
    assert flags_without_help(ap.format_help()) == ["--bare"]


def test_every_build_flag_has_help(capsys):
    with pytest.raises(SystemExit):
        build.main(["--help"])
    out = capsys.readouterr().out
    assert out.count("\n  --") >= 10, out
    assert not flags_without_help(out), f"build flags without help text: {flags_without_help(out)}\n{out}"
