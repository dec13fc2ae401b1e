"""The config.toml tune writes (service/tune/candidates.py ``config_text``) reads back as the configuration it was
made from, its tables included (a rollout, faults)."""

from __future__ import annotations

import tomllib

from service.core.config import Faults, ModelConfig, RolloutConfig, parse_config
from service.tune.candidates import config_text


def test_a_config_with_a_rollout_and_faults_reads_back() -> None:
    config = ModelConfig(
        max_batch_size=8,
        rollout=RolloutConfig(candidate=2, mode="canary", fraction=0.25, sticky_header="x-user", auto=False),
        faults=Faults(delay_ms=5.0, versions=(2,)),
    )
    text = config_text(config, "tuned")
    assert "[rollout]" in text and "[faults]" in text
    assert parse_config(tomllib.loads(text), source="test") == config


def test_the_default_config_has_no_tables() -> None:
    text = config_text(ModelConfig())
    assert "\n[rollout]" not in text and "\n[faults]" not in text
    assert parse_config(tomllib.loads(text), source="test") == ModelConfig()


def test_exports_template_lists_every_field_of_every_table_and_reads_back_as_the_defaults() -> None:
    from service.core.config import default_config_text

    text = default_config_text(16)
    assert parse_config(tomllib.loads(text), source="template") == ModelConfig(max_batch_size=16)
    for struct, prefix in ((ModelConfig, ""), (Faults, "# [faults]"), (RolloutConfig, "# [rollout]")):
        for field in struct.__struct_fields__:
            assert f"{field} = " in text or f"# [{field}]" in text, (prefix, field)
    # Fields that the hand-written template had lost (issue 42): declared once, they cannot be left out again.
    assert "image_delay_ms = 0.0" in text and "shadow_timeout_ms = 1000.0" in text


def test_a_string_with_quotes_and_backslashes_reads_back() -> None:
    config = ModelConfig(faults=Faults(load_error='a "quoted" \\ path\tand tab'))
    assert parse_config(tomllib.loads(config_text(config)), source="test") == config
