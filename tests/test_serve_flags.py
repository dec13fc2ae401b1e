"""``visionserve serve``'s flags are derived from ServerSettings' fields (service/commands.py): every setting has its
flag, each flag's default is the setting's default in the flag's unit, and the flags fill the settings."""

from __future__ import annotations

import argparse

import pytest

from service.commands import add_serve_arguments, setting_flags, settings_from
from service.core.errors import ConfigError
from service.core.settings import ServerSettings


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return p


def test_every_setting_has_one_flag_with_help() -> None:
    flags = setting_flags()
    assert [f.field for f in flags] == list(ServerSettings.__struct_fields__)
    assert len({f.flag for f in flags}) == len(flags) and all(f.help for f in flags)


def test_no_flags_give_the_default_settings() -> None:
    assert settings_from(parser().parse_args([])) == ServerSettings()


def test_flags_fill_their_settings_in_the_settings_units() -> None:
    argv = ["--max-body-mb", "1.5", "--max-header-kb", "8", "--no-metrics", "--strict-readiness", "--admin-token",
            "t", "--log-format", "json", "--memory-budget", "2GB", "--port", "0", "--decode-workers", "3",
            "--stream-send-timeout-s", "2.5", "--max-images", "9"]  # fmt: skip
    settings = settings_from(parser().parse_args(argv))
    assert settings.max_body_bytes == int(1.5 * 1024 * 1024) and settings.max_header_bytes == 8 * 1024
    assert settings.metrics is False and settings.strict_readiness is True and settings.admin_token == "t"
    assert settings.log_format == "json" and settings.memory_budget == "2GB" and settings.port == 0
    assert settings.decode_workers == 3 and settings.stream_send_timeout_s == 2.5
    assert settings.max_images_per_request == 9


def test_a_bad_value_is_refused_with_the_settings_name() -> None:
    with pytest.raises(ConfigError, match="decode_workers must be an integer >= 1, got 0"):
        settings_from(parser().parse_args(["--decode-workers", "0"]))
    with pytest.raises(SystemExit):
        parser().parse_args(["--log-format", "xml"])
