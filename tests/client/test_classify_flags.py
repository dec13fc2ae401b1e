"""``visionserve classify``'s numeric flags at their extremes: a usage error (argparse, exit status 2) that names the
flag and its range, before any file is read or any request sent; the edges of each range are taken."""

from __future__ import annotations

import pytest

from service.cli import build_parser, main

MAX = 2**63 - 1
BIG = "9" * 30  # past 64 bits
CASES = [
    *[("--top-k", v, "an integer from 1 to 1000") for v in ["0", "-1", "1001", BIG, "1.5", "1.0", "nan", "inf", "1e3",
                                                             "", "1_0"]],
    *[("--concurrency", v, "an integer from 1 to 1024") for v in ["0", "-5", "1025", BIG, "2.5", "nan"]],
    *[("--images-per-request", v, "an integer from 1 to 4096") for v in ["0", "4097", BIG, "0.5", "-inf"]],
    *[("--max-attempts", v, "an integer from 1 to 1000") for v in ["0", "1001", BIG, "1.5", "Infinity"]],
    *[("--version", v, f"an integer from 1 to {MAX}") for v in ["0", "-1", str(MAX + 1), BIG, "1.0", "NaN"]],
    *[("--timeout", v, "a number > 0 and <= 86400") for v in ["0", "-1", "-0.0", "nan", "inf", "-inf", "1e400",
                                                              "86400.5", BIG, "x"]],
    *[("--max-retry-s", v, "a number from 0 to 86400") for v in ["-1", "-1e-9", "nan", "NaN", "inf", "1e400",
                                                                 "86401", BIG]],
]  # fmt: skip


@pytest.mark.parametrize(("flag", "value", "allowed"), CASES, ids=[f"{f}={v}" for f, v, _ in CASES])
def test_a_flag_past_its_range_is_a_usage_error_naming_it(
    flag: str, value: str, allowed: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:  # "--flag=value", so that argparse does not read "-1" as a flag
        main(["classify", "--model", "digits", "no-such-folder", f"{flag}={value}", "--no-progress"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"error: argument {flag}: must be {allowed}, got {value!r}" in err, err
    assert "Traceback" not in err


def test_the_edges_of_each_range_are_taken() -> None:
    args = build_parser("classify").parse_args(
        ["classify", "--model", "m", "x", "--top-k", "1000", "--concurrency", "1024", "--images-per-request", "4096",
         "--max-attempts", "1", "--version", str(MAX), "--timeout", "86400", "--max-retry-s", "0"]
    )  # fmt: skip
    assert (args.top_k, args.concurrency, args.images_per_request, args.max_attempts, args.version) == (
        1000, 1024, 4096, 1, MAX
    )  # fmt: skip
    assert (args.timeout, args.max_retry_s) == (86400.0, 0.0)
    low = build_parser("classify").parse_args(["classify", "--model", "m", "x", "--top-k", "1", "--timeout", "1e-3"])
    assert (low.top_k, low.timeout) == (1, 0.001)


def test_the_help_states_each_range(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["classify", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for said in ("classes per image: an integer from 1 to 1000", "1 to 1024", "1 to 4096", "at most 86400"):
        assert said in text, text
