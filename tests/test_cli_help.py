"""``visionserve --help`` as a user reads it: quick (no torch), and every default written once, as it is typed."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest

from service.cli import SUBCOMMANDS, build_parser
from service.core.arguments import default_text


def _help_of(command: str) -> tuple[str, argparse.ArgumentParser]:
    parser = build_parser(command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    child = sub.choices[command]
    return " ".join(child.format_help().split()), child  # argparse wraps lines: compare with the spaces joined


def test_plain_help_imports_no_torch() -> None:
    code = (
        "import sys\nfrom service.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit as exc:\n    assert exc.code == 0, exc.code\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO TORCH', file=sys.stderr)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().endswith("NO TORCH"), proc.stderr
    for name in SUBCOMMANDS:
        assert name in proc.stdout


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_every_default_is_shown_once_as_typed(command: str) -> None:
    text, parser = _help_of(command)
    assert "(default: None)" not in text and "(default: False)" not in text and "(default: True)" not in text
    assert "(default: (" not in text and "(default: [" not in text, "a Python tuple or list shown as a default"
    assert not re.search(r"\(default: [^()]*\) \(default:", text), "a default stated twice"
    for action in parser._actions:
        if not action.option_strings or action.help is argparse.SUPPRESS:
            continue
        help_text = " ".join((action.help or "").split())
        shown = default_text(action)
        mentions = len(re.findall(r"\bdefault\s*:|\(default\b", help_text, re.IGNORECASE))
        if shown is not None:
            assert f"{help_text} (default: {shown})" in text, (action.option_strings, shown)
            assert mentions == 0
        # However the default is stated, it is stated at most once for each flag.
        assert mentions + (shown is not None) <= 1, action.option_strings
        if isinstance(action.default, tuple | list):
            assert shown is not None and ", " not in shown and "(" not in shown


def test_sequence_defaults_read_as_typed() -> None:
    text, _ = _help_of("loadtest")
    assert "clients per step (default: 1,4,16)" in text
    assert "WIDTHxHEIGHT (default: 500x375)" in text
    export, _ = _help_of("export")
    assert "(default: ImageNet)" in export and "(default: ImageNet) (default:" not in export
