"""``visionserve serve``: its flags come from :class:`~service.core.settings.ServerSettings`' fields, each declared
once on its field (the default, the help, the flag's name where it is not the field's, and the unit the flag counts
in: ``--max-body-mb`` sets ``max_body_bytes``), so a flag's default, its help and the setting it fills cannot drift.
"""

from __future__ import annotations

import argparse
import typing
from dataclasses import dataclass
from typing import Any

from service.core.errors import ConfigError
from service.core.settings import ServerSettings


@dataclass(frozen=True)
class SettingFlag:
    """One ServerSettings field as a command-line flag."""

    field: str
    flag: str
    help: str
    default: Any
    kind: type
    unit: int
    choices: tuple[str, ...]

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")

    def add_to(self, p: argparse.ArgumentParser) -> None:
        help_text = self.help.replace("%", "%%")  # argparse %-formats help
        if self.kind is bool:  # a switch: --strict-readiness turns on, --no-metrics turns off
            action = "store_false" if self.default else "store_true"
            p.add_argument(self.flag, dest=self.dest, action=action, help=help_text)
            return
        default = self.default / self.unit if self.unit != 1 and self.default is not None else self.default
        kind = float if self.unit != 1 else self.kind
        choices = list(self.choices) or None
        p.add_argument(self.flag, dest=self.dest, type=kind, default=default, choices=choices, help=help_text)

    def value(self, args: argparse.Namespace) -> Any:
        raw = getattr(args, self.dest)
        return int(raw * self.unit) if self.unit != 1 and raw is not None else raw


def _kind(annotation: Any) -> type:
    """The flag's type: the field's, with ``X | None`` read as X and a Literal of strings as str."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Literal:
        return type(args[0])
    if args:
        return _kind(args[0])
    return annotation if isinstance(annotation, type) else str


def setting_flags() -> list[SettingFlag]:
    """Every ServerSettings field's flag, in the fields' order."""
    hints = typing.get_type_hints(ServerSettings, include_extras=True)
    defaults = ServerSettings()
    out = []
    for field in ServerSettings.__struct_fields__:
        meta = hints[field].__metadata__[0]
        extra = meta.extra or {}
        name = extra.get("flag") or "--" + field.replace("_", "-")
        out.append(
            SettingFlag(
                field=field,
                flag=name,
                help=meta.description or "",
                default=getattr(defaults, field),
                kind=_kind(hints[field].__origin__),
                unit=int(extra.get("unit", 1)),
                choices=tuple(extra.get("choices", ())),
            )
        )
    return out


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.description = "Serve every model in the repository over HTTP (image API, Open Inference Protocol v2, /metrics)."
    for setting in setting_flags():
        setting.add_to(p)
    # The supervisor's own options: how many processes, and each one's arena (not settings of the front end).
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        help="HTTP front-end processes feeding one engine per device; 0: half the cores, 1 to 8 (printed at start)",
    )
    p.add_argument(
        "--shm-mb", type=int, default=64, help="each front end's shared-memory arena for image tensors (MiB)"
    )


def settings_from(args: argparse.Namespace) -> ServerSettings:
    """The settings the flags in ``args`` ask for."""
    return ServerSettings(**{s.field: s.value(args) for s in setting_flags()})


def run_serve(args: argparse.Namespace) -> int:
    from service.supervisor import SupervisorOptions, serve

    settings = settings_from(args)
    if args.workers < 0 or args.shm_mb < 1:
        raise ConfigError(f"--workers must be >= 0 and --shm-mb >= 1, got {args.workers} and {args.shm_mb}")
    return serve(settings, SupervisorOptions(workers=args.workers, shm_mb=args.shm_mb, log_level=args.log_level))
