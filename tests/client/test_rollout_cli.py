"""``visionserve rollout`` and ``train --rollout`` (docs/rollouts.md): the flags, the refusals, the status printer on
the contract's own example, and one run against a real server (start a shadow, compare, promote)."""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from rich.console import Console

from service.cli import build_parser, main
from service.client.rollout import RolloutStatus, check_rollout_args, error_text, print_status, start_body
from service.inprocess import InProcessServer
from tests.client.conftest import digit_pixels
from tests.conftest import copy_model, encode_image
from tests.http.conftest import ADMIN_TOKEN, start_server

DOC = Path(__file__).resolve().parents[2] / "docs" / "rollouts.md"
URL = ["--url", "http://127.0.0.1:9", "--model", "digits"]  # nothing listens on port 9 (discard)


def in_process(capsys: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess[str]:
    """``visionserve ARGS`` through ``service.cli.main`` here: its exit status and output, as a process gives."""
    try:
        code = main(list(args))
    except SystemExit as exc:  # argparse's refusals
        code = exc.code if isinstance(exc.code, int) else 1
    out = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, out.out, out.err)


def parse(*args: str) -> Any:
    return build_parser("rollout").parse_args(["rollout", *args])


def documented_status() -> dict[str, Any]:
    """The example answer of ``GET /v2/models/{m}/rollout`` in docs/rollouts.md, the contract."""
    found = re.search(r"```json\n(.*?)```", DOC.read_text(), re.DOTALL)
    assert found, f"{DOC} lost its JSON example"
    return dict(json.loads(found.group(1)))


def test_start_sends_what_the_flags_say() -> None:
    args = parse("start", *URL, "--candidate", "3", "--mode", "canary", "--fraction", "0.25", "--sticky-header",
                 "x-user-id", "--no-auto", "--min-samples", "500", "--min-agreement", "0.98")  # fmt: skip
    assert start_body(args) == {"candidate": 3, "mode": "canary", "fraction": 0.25, "sticky_header": "x-user-id",
                                "auto": False, "min_samples": 500, "min_agreement": 0.98}  # fmt: skip


def test_start_defaults_to_a_tenth_in_shadow_and_leaves_the_policy_to_the_server() -> None:
    assert start_body(parse("start", *URL, "--candidate", "2")) == {"candidate": 2, "mode": "shadow", "fraction": 0.1}


def test_the_token_comes_from_the_flag_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VISIONSERVE_ADMIN_TOKEN", "from-env")
    assert check_rollout_args(parse("promote", *URL)) == "from-env"
    assert check_rollout_args(parse("abort", *URL, "--admin-token", "from-flag")) == "from-flag"
    assert check_rollout_args(parse("status", *URL)) is None  # status needs none, and sends none


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["start"], "rollout start needs --candidate N"),
        (["status", "--candidate", "2"], "--candidate only go with rollout start, not rollout status"),
        (["promote", "--fraction", "0", "--no-auto"], "--fraction, --no-auto only go with rollout start"),
        (["abort", "--sticky-header", ""], "--sticky-header only go with rollout start"),
        (["start", "--candidate", "2", "--sticky-header", "x-user-id"], "add --mode canary"),
        (["status", "--reason", "why"], "--reason goes with rollout promote or abort, not rollout status"),
        (["start", "--candidate", "2", "--mode", "canary"], "needs the server's admin token"),
        (["promote"], "rollout promote needs the server's admin token: --admin-token or VISIONSERVE_ADMIN_TOKEN"),
        (["start", "--candidate", "2", "--fraction", "1.5"], "argument --fraction: must be a number from 0 to 1"),
        (["start", "--candidate", "0"], "argument --candidate: must be an integer from 1"),
        (["start", "--candidate", "2", "--mode", "blue"], "argument --mode: invalid choice: 'blue'"),
        (["pause"], "argument ACTION: invalid choice: 'pause'"),
    ],
)
def test_bad_combinations_are_refused_before_anything_is_sent(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VISIONSERVE_ADMIN_TOKEN", raising=False)
    proc = in_process(capsys, "rollout", *args, *URL)
    assert proc.returncode == 2, proc
    assert message in " ".join(proc.stderr.split()), proc.stderr
    assert "Traceback" not in proc.stderr and "could not be reached" not in proc.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rollout", "shadow"], "--rollout starts a rollout on the server that --reload names: add --reload URL"),
        (["--export", "--rollout", "canary"], "--rollout starts a rollout on the server that --reload names"),
        (["--rollout", "blue"], "argument --rollout: invalid choice: 'blue'"),
        (["--rollout", "shadow", "--rollout-fraction", "2"], "argument --rollout-fraction: must be a number from 0"),
    ],
)
def test_train_refuses_a_rollout_without_a_server_before_training(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    proc = in_process(capsys, "train", "--out", "", "--dataset", "synthetic:40", *args)
    assert proc.returncode == 2, proc
    assert message in " ".join(proc.stderr.split()), proc.stderr
    assert not re.search(r"epoch +\d+/\d+", proc.stdout + proc.stderr)  # refused before a single epoch ran


def test_an_unreachable_server_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    proc = in_process(capsys, "rollout", "status", *URL)
    assert proc.returncode == 1
    assert "visionserve rollout: error: http://127.0.0.1:9: the server could not be reached" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_server_refusal_prints_its_message_and_exits_1(
    client_server: InProcessServer, capsys: pytest.CaptureFixture[str]
) -> None:
    proc = in_process(capsys, "rollout", "status", "--url", client_server.url, "--model", "no-such-model")
    assert proc.returncode == 1, proc
    assert f"visionserve rollout: error: {client_server.url} answered 404: " in proc.stderr
    assert "Traceback" not in proc.stderr and '{"error"' not in proc.stderr  # the message, not the JSON around it


def test_error_text_is_the_message_of_an_error_answer() -> None:
    assert error_text(b'{"error": "unknown model \'x\'"}') == "unknown model 'x'"
    assert error_text(b"<html>bad gateway</html>") == "<html>bad gateway</html>"
    assert error_text(b"") == "(no body)"


def test_the_documented_status_reads_as_a_summary() -> None:
    status = msgspec.convert(documented_status(), RolloutStatus)
    out = io.StringIO()
    print_status(status, Console(file=out, width=160, color_system=None))
    text = out.getvalue()
    lines = [" ".join(line.split()) for line in text.splitlines()]
    assert lines[0] == "digits: rollout running, shadow of 10% of the requests that name no version"
    for row in [
        "versions primary 1 -> candidate 2",
        "samples 412 compared, 410 agreed on top-1",
        "agreement 99.51% (95% interval 98.26% to 99.87%; promote at >= 99.00%)",
        "top-5 overlap 99.1%",
        "latency ratio 1.09x (mean 2.30 ms vs 2.10 ms per image); at most 1.50x",
        "errors 2 of 414 attempts (0.48%; at most 1.00%): ...",
        "shed 37 sampled requests not compared",
        "verdict wait: 412 of 1000 samples",
    ]:
        assert any(line.startswith(row) for line in lines), (row, text)
    assert "lowest agreement, 1 of 1 classes" in text
    assert any("8 x2" in line and "95.00%" in line for line in text.splitlines()), text


def test_the_summary_of_no_rollout_and_of_a_decision() -> None:
    out = io.StringIO()
    print_status(RolloutStatus(model="digits"), Console(file=out, width=160, color_system=None))
    assert out.getvalue().strip() == "digits: no rollout"
    aborted = {**documented_status(), "state": "aborted", "reason": "agreement 0.91 < 0.99", "effective_fraction": 0}
    out = io.StringIO()
    print_status(msgspec.convert(aborted, RolloutStatus), Console(file=out, width=160, color_system=None))
    text = " ".join(out.getvalue().split())
    assert "digits: rollout aborted, shadow of 10% of the requests that name no version versions" in text
    assert "reason agreement 0.91 < 0.99" in text
    manual = {**documented_status(), "auto": False, "effective_fraction": 0.05}
    out = io.StringIO()
    print_status(msgspec.convert(manual, RolloutStatus), Console(file=out, width=160, color_system=None))
    text = " ".join(out.getvalue().split())
    assert "shadow of 10% of the requests that name no version (effectively 5.0%)" in text
    assert "verdict wait: 412 of 1000 samples (auto off: not acted on)" in text


def _status_json(capsys: pytest.CaptureFixture[str], url: str) -> dict[str, Any]:
    proc = in_process(capsys, "rollout", "status", "--url", url, "--model", "digits", "--json")
    assert proc.returncode == 0, proc.stderr
    return dict(json.loads(proc.stdout))


def test_start_status_promote_against_a_real_server(
    digits_export: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What ``train --export --reload URL --rollout shadow`` leads to: a server serving version 1, version 2 written
    beside it, a shadow of it on every request, then a promotion by hand. Version 2 is version 1's copy, so the two
    agree on every image."""
    repo = copy_model(digits_export, tmp_path / "repo")
    server = start_server(repo, tmp_path / "server.log", "--admin-token", ADMIN_TOKEN)
    # Written while the server runs, as train --export writes it; renamed into place whole, as export does.
    shutil.copytree(repo / "digits" / "1", repo / "digits" / ".2.partial")
    (repo / "digits" / ".2.partial").rename(repo / "digits" / "2")
    admin = ["--url", server.url, "--model", "digits", "--admin-token", ADMIN_TOKEN]

    proc = in_process(capsys, "rollout", "start", *admin, "--candidate", "2", "--mode", "shadow", "--fraction", "1.0")
    assert proc.returncode == 0, (proc.stderr, server.tail())
    assert "digits: rollout started" in proc.stdout

    sent = 30
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for i in range(sent):
            png = encode_image(digit_pixels(i)[0], "PNG")
            r = client.post("/v1/models/digits/classify", content=png, headers={"content-type": "image/png"})
            assert r.status_code == 200, r.text
            assert r.json()["version"] == 1  # a shadow is never returned: the primary answers
    # The shadow's work completes after the answers: bounded wait until every sampled request was compared or shed.
    deadline = time.monotonic() + 30
    while True:
        status = _status_json(capsys, server.url)
        done = status["comparison"]["samples"] + status["comparison"]["shed"]
        if done >= sent or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert (status["state"], status["mode"], status["primary"], status["candidate"]) == ("running", "shadow", 1, 2)
    assert status["fraction"] == 1.0 and status["auto"] is True
    comparison = status["comparison"]
    assert comparison["samples"] + comparison["shed"] == sent, comparison
    assert comparison["samples"] >= 1 and comparison["agreed"] == comparison["samples"], comparison
    assert comparison["errors"] == 0 and comparison["agreement"] == 1.0, comparison
    assert status["verdict"] == "wait"  # 30 samples, far below min_samples (1000): neither promoted nor aborted

    proc = in_process(capsys, "rollout", "status", "--url", server.url, "--model", "digits")
    assert proc.returncode == 0, proc.stderr
    assert "digits: rollout running, shadow" in proc.stdout and "primary 1 -> candidate 2" in proc.stdout

    proc = in_process(capsys, "rollout", "promote", *admin, "--reason", "agrees on every test image")
    assert proc.returncode == 0, (proc.stderr, server.tail())
    assert "digits: rollout promoted" in proc.stdout
    status = _status_json(capsys, server.url)
    assert status["state"] == "promoted" and status["reason"] == "agrees on every test image", status
    assert (repo / "digits" / "rollout.json").is_file()  # the decision outlives the process (docs/rollouts.md)
    png = encode_image(digit_pixels(0)[0], "PNG")
    r = httpx.post(server.url + "/v1/models/digits/classify", content=png, headers={"content-type": "image/png"})
    assert r.status_code == 200 and r.json()["version"] == 2, r.text  # the candidate now serves


def test_train_export_with_rollout_puts_the_version_written_on_trial(
    digits_export: Path, digits_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``train --export --reload URL --rollout shadow``'s step after training, on a checkpoint already trained: the
    checkpoint becomes version 2 and the server starts a shadow of it beside version 1, instead of loading it."""
    from export.after_training import prepare_export

    repo = copy_model(digits_export, tmp_path / "repo")
    server = start_server(repo, tmp_path / "server.log", "--admin-token", ADMIN_TOKEN)
    args = build_parser("train").parse_args(
        ["train", "--out", str(digits_checkpoint), "--export", "--repository", str(repo), "--name", "digits",
         "--formats", "onnx", "--reload", server.url, "--admin-token", ADMIN_TOKEN, "--rollout", "shadow",
         "--rollout-fraction", "0.5", "--no-progress"]
    )  # fmt: skip
    assert prepare_export(args)(str(digits_checkpoint)) == 0, server.tail()
    out = " ".join(capsys.readouterr().out.split())
    assert f"{server.url} started a shadow rollout of digits version 2 against version 1 on 50% of the" in out, out
    assert f"visionserve rollout status --url {server.url} --model digits" in out
    status = _status_json(capsys, server.url)
    assert (status["state"], status["mode"], status["primary"], status["candidate"]) == ("running", "shadow", 1, 2)
    assert status["fraction"] == 0.5
