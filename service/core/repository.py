"""The model repository on disk: the only contract between ``export/`` and ``service/``.

::

    model_repository/
      digits/
        config.toml          serving settings (optional; service/config.py)
        1/
          model.onnx         and/or model.pt (TorchScript) and/or model.pt2 (AOTInductor, compiled for the CPU);
                             model.fp16.onnx / model.fp16.pt beside them; model.cuda.pt2 and
                             model.fp16.cuda.pt2 (AOTInductor compiled for CUDA) where export ran on a GPU;
                             model.int8.onnx (`export --int8`: quantized, gated against model.onnx)
          spec.json          the ModelSpec

A folder whose children are version folders is one model's folder, as KServe's storage initializer leaves it
(docs/deploy.md), named by ``model_name`` or the environment variable ``VISIONSERVE_MODEL_NAME``.

Reading validates everything it can before a model is loaded: a missing or truncated model file, a spec or config
that breaks its schema, or a label count that does not match the model's output width is refused with a message
naming the file, the field and the value. A broken version or model is recorded and skipped: it never stops the
others from loading.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from service.core.config import CONFIG_FILE, ModelConfig, load_config, parse_config
from service.core.errors import BadInputError, ConfigError, NotFoundError
from service.core.layouts import check_outputs
from service.core.spec import SPEC_FILE, ModelSpec, load_spec

log = logging.getLogger(__name__)

MODEL_NAME_ENV = "VISIONSERVE_MODEL_NAME"

# An AOTInductor package is compiled for one device type and cannot be loaded on another, so the CPU and the CUDA
# packages are two files ("aoti" and "aoti-cuda"); an fp16 package exists only for CUDA.
MODEL_FILES = {"onnx": "model.onnx", "torchscript": "model.pt", "aoti": "model.pt2", "aoti-cuda": "model.cuda.pt2"}
FP16_FILES = {"onnx": "model.fp16.onnx", "torchscript": "model.fp16.pt", "aoti-cuda": "model.fp16.cuda.pt2"}
# INT8 is onnxruntime's static quantization (QDQ): served by onnxruntime only (``precision = "int8"``).
INT8_FILES = {"onnx": "model.int8.onnx"}


@dataclass(frozen=True)
class ModelVersion:
    """One version folder that passed validation."""

    model: str
    version: int
    path: Path
    spec: ModelSpec
    files: dict[str, Path]
    fp16_files: dict[str, Path]
    int8_files: dict[str, Path] = field(default_factory=dict)

    @property
    def int8_ungated(self) -> bool:
        """Whether the INT8 artifact was written with ``--int8-ungated`` (its agreement with fp32 unproven)."""
        record = self.spec.export_record(INT8_FILES["onnx"])
        return record is None or record.int8 is None or not record.int8.gated


@dataclass(frozen=True)
class ModelEntry:
    """A model with its config and the versions that passed validation (highest = default)."""

    name: str
    path: Path
    config: ModelConfig
    versions: dict[int, ModelVersion]
    version_errors: dict[int, str] = field(default_factory=dict)

    @property
    def latest(self) -> ModelVersion:
        return self.versions[max(self.versions)]

    def version(self, number: int | None) -> ModelVersion:
        """The version ``number`` (``None``: the highest)."""
        if number is None:
            return self.latest
        if number not in self.versions:
            reason = self.version_errors.get(number)
            detail = f": {reason}" if reason else ""
            raise NotFoundError(f"model {self.name!r} has no usable version {number}{detail}")
        return self.versions[number]


@dataclass(frozen=True)
class RepositoryIndex:
    models: dict[str, ModelEntry]
    errors: dict[str, str]  # model name -> why it was refused


def onnx_single_input(graph: Any, path: Path) -> Any:
    """The graph's one real input (initializers listed as inputs do not count)."""
    initializers = {i.name for i in graph.initializer}
    inputs = [i for i in graph.input if i.name not in initializers]
    if len(inputs) != 1:
        raise ConfigError(f"{path} must have exactly one input, has {len(inputs)}")
    return inputs[0]


def _check_onnx(path: Path, spec: ModelSpec) -> None:
    import onnx

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:
        raise ConfigError(f"{path} is truncated or not an ONNX model: {exc}") from exc
    graph = model.graph
    first = onnx_single_input(graph, path)
    tensor = first.type.tensor_type
    if tensor.elem_type != onnx.TensorProto.UINT8:
        raise ConfigError(
            f"{path} input {first.name!r} must be uint8 (export wraps models for uint8 input), "
            f"got {onnx.TensorProto.DataType.Name(tensor.elem_type)}"
        )
    dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
    expected = [None, spec.input.channels, spec.input.height, spec.input.width]
    if len(dims) != 4 or any(d is not None and e is not None and d != e for d, e in zip(dims, expected, strict=True)):
        raise ConfigError(f"{path} input shape {dims} does not match spec.json's [N, C, H, W] = {expected}")
    out_dims = [d.dim_value if d.HasField("dim_value") else None for d in graph.output[0].type.tensor_type.shape.dim]
    if len(out_dims) == 2 and out_dims[1] and out_dims[1] != spec.num_classes:
        raise ConfigError(
            f"labels in spec.json count {spec.num_classes} classes but {path} outputs {out_dims[1]} logits"
        )


def load_torchscript(path: str | Path, device: str = "cpu") -> Any:
    """``torch.jit.load`` without its deprecation warning (TorchScript is the serving format we ship)."""
    import torch

    _register_torchvision_ops(Path(path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.load(str(path), map_location=device)


def _register_torchvision_ops(path: Path) -> None:
    """Import torchvision when ``path`` holds scripted torchvision code (its detectors: models/tv_detectors.py):
    its operators (``torchvision::nms``) exist only once imported, and TorchScript resolves them at the first call,
    so the load succeeded and the first batch failed. Other models skip the import."""
    try:
        with zipfile.ZipFile(path) as archive:
            scripted = any("/__torch__/torchvision/" in name for name in archive.namelist())
    except (OSError, zipfile.BadZipFile):
        return  # not an archive torch wrote: its own load says what is wrong
    if scripted and importlib.util.find_spec("torchvision") is not None:
        import torchvision  # noqa: F401


def _check_zip(path: Path, what: str) -> None:
    """TorchScript files and AOTInductor packages are zip archives: refuse a truncated or corrupt one."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise ConfigError(f"{path} is truncated or not {what}: {exc}") from exc
    if bad is not None:
        raise ConfigError(f"{path} is corrupt: member {bad} fails its checksum")


def _check_torch(path: Path, spec: ModelSpec, deep: bool, *, aoti: bool) -> None:
    """A TorchScript file or an AOTInductor package: a sound archive and, ``deep``, run on a uint8 batch."""
    _check_zip(path, "an AOTInductor package" if aoti else "a TorchScript file")
    if not deep:
        return
    import torch

    try:
        if aoti:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = torch._inductor.aoti_load_package(str(path), run_single_threaded=True)
        else:
            module = load_torchscript(path, "cpu").eval()
        x = torch.zeros((1, spec.input.channels, spec.input.height, spec.input.width), dtype=torch.uint8)
        with torch.inference_mode():
            out = module(x)
        outs = list(out) if isinstance(out, list | tuple) else [out]  # several: named output_0, output_1, ...
        shapes = {f"output_{i}" if len(outs) > 1 else "output": tuple(o.shape) for i, o in enumerate(outs)}
        shape = next(iter(shapes.values()))
    except Exception as exc:
        does = "does not load or run" if aoti else "does not run"
        raise ConfigError(f"{path} {does} on a uint8 batch of the spec's shape: {exc}") from exc
    if spec.output_layout is not None and not aoti:  # a detector: its outputs held to its layout
        check_outputs(spec.output_layout, shapes, spec.num_classes)
    elif shape[1 if len(shape) > 1 else -1] != spec.num_classes:  # [N, C] or a class map's [N, C, h, w]
        raise ConfigError(f"labels in spec.json count {spec.num_classes} classes but {path} outputs {shape[-1]} logits")


def read_version(model: str, path: Path, *, deep: bool = True, backend: str = "auto") -> ModelVersion:
    """Validate one version folder; raises :class:`ConfigError` naming the file and what is wrong.

    ``backend`` is the model's config's. Where it leaves the choice to an ONNX artifact that is there (``auto`` or
    ``onnxruntime``), the TorchScript and AOTInductor files beside it are the runtimes' spares: checked without
    importing torch, and one that fails its check is set aside with a warning instead of refusing the version (a
    broken ``model.pt`` must not stop ``model.onnx`` from serving, nor cost a serving host a torch import)."""
    number = int(path.name) if path.name.isdecimal() else 0
    if number < 1 or str(number) != path.name:
        raise ConfigError(f"version folders must be positive integers, got {path}")
    spec_path = path / SPEC_FILE
    if not spec_path.is_file():
        raise ConfigError(f"{spec_path} is missing: every version needs the spec written by `visionserve export`")
    spec = load_spec(spec_path)
    files = {fmt: path / name for fmt, name in MODEL_FILES.items() if (path / name).is_file()}
    fp16 = {fmt: path / name for fmt, name in FP16_FILES.items() if (path / name).is_file()}
    int8 = {fmt: path / name for fmt, name in INT8_FILES.items() if (path / name).is_file()}
    if not files and not fp16 and not int8:
        raise ConfigError(f"{path} holds no model file (expected {' or '.join(MODEL_FILES.values())})")
    others = {**{f"{k}-fp16": v for k, v in fp16.items()}, **{f"{k}-int8": v for k, v in int8.items()}}
    spares = backend in ("auto", "onnxruntime") and any(k.startswith("onnx") for k in (*files, *others))
    for fmt, file in {**files, **others}.items():
        spare = spares and not fmt.startswith("onnx")
        try:
            _check_artifact(fmt, file, spec, deep=deep and not spare)
        except ConfigError as exc:
            if not spare:
                raise
            log.warning("model %s: %s set aside (the ONNX artifact serves): %s", model, file.name, exc)
            for table in (files, fp16, int8):
                for key in [k for k, v in table.items() if v == file]:
                    del table[key]
    return ModelVersion(
        model=model, version=number, path=path, spec=spec, files=files, fp16_files=fp16, int8_files=int8
    )


def _check_artifact(fmt: str, file: Path, spec: ModelSpec, *, deep: bool) -> None:
    if file.stat().st_size == 0:
        raise ConfigError(f"{file} is empty")
    if fmt.startswith("onnx"):
        _check_onnx(file, spec)
    else:  # a CUDA package cannot be loaded to check it here
        aoti = fmt.startswith("aoti")
        _check_torch(file, spec, deep and (fmt == "aoti" or not aoti), aoti=aoti)


def read_model(path: Path, *, deep: bool = True, name: str | None = None) -> ModelEntry:
    """Validate a model folder (named ``name``, default its folder's name); raises :class:`ConfigError` when it has
    no usable version or a bad config."""
    name = name or path.name
    config = load_config(path / CONFIG_FILE)
    versions: dict[int, ModelVersion] = {}
    errors: dict[int, str] = {}
    candidates = sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))
    for folder in candidates:
        try:
            version = read_version(name, folder, deep=deep, backend=config.backend)
        except ConfigError as exc:
            log.error("model %s: version %s refused: %s", name, folder.name, exc)
            key = int(folder.name) if folder.name.isdigit() else -len(errors) - 1
            errors[key] = str(exc)
            continue
        versions[version.version] = version
    if not versions:
        detail = "; ".join(errors.values()) if errors else f"no version folders (1/, 2/, ...) in {path}"
        raise ConfigError(f"model {name!r} has no usable version: {detail}")
    return ModelEntry(name=name, path=path, config=config, versions=versions, version_errors=errors)


class ModelRepository:
    """Reads and validates a model repository folder.

    ``model_name`` (default: the ``VISIONSERVE_MODEL_NAME`` environment variable) says the folder is one model's
    folder, as KServe leaves it, and names that model.
    """

    def __init__(self, root: str | Path, *, model_name: str | None = None) -> None:
        self.root = Path(root)
        self.model_name = model_name or os.environ.get(MODEL_NAME_ENV) or None
        if self.model_name is not None and (self.model_name.startswith(".") or "/" in self.model_name):
            raise ConfigError(f"model name must be a plain name, got {self.model_name!r} ({MODEL_NAME_ENV})")

    def _path(self, name: str) -> Path:
        """The folder of model ``name`` (the root itself when the root is one model's folder)."""
        if self.model_name is not None:
            return self.root if name == self.model_name else self.root / ".none" / name
        return self.root / name

    def model_names(self) -> list[str]:
        if not self.root.is_dir():
            raise ConfigError(f"model repository {self.root} does not exist or is not a folder")
        if self.model_name is not None:
            return [self.model_name]
        names = sorted(p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith("."))
        if names and all(n.isdigit() for n in names):
            # What KServe's storage initializer leaves: read as a model called "1" it would only be refused.
            raise ConfigError(
                f"model repository {self.root} holds version folders ({', '.join(n + '/' for n in names)}): it is "
                f"one model's folder; name the model with the environment variable {MODEL_NAME_ENV}"
            )
        return names

    def scan(self, *, deep: bool = True) -> RepositoryIndex:
        """Every model that validates, and why each of the others was refused."""
        models: dict[str, ModelEntry] = {}
        errors: dict[str, str] = {}
        for name in self.model_names():
            try:
                models[name] = read_model(self._path(name), deep=deep, name=name)
            except ConfigError as exc:
                log.error("model %s refused: %s", name, exc)
                errors[name] = str(exc)
        return RepositoryIndex(models=models, errors=errors)

    def model(self, name: str, *, deep: bool = True) -> ModelEntry:
        path = self._path(name)
        if not path.is_dir() or name.startswith("."):
            raise NotFoundError(f"no model {name!r} in {self.root}")
        return read_model(path, deep=deep, name=name)

    def next_version(self, name: str) -> int:
        path = self._path(name)
        if not path.is_dir():
            return 1
        numbers = [int(p.name) for p in path.iterdir() if p.is_dir() and p.name.isdigit()]
        return max(numbers, default=0) + 1


def random_batch(spec: ModelSpec, n: int, seed: int = 0) -> np.ndarray:
    """A uint8 batch of the spec's shape (for warm-up and checks)."""
    rng = np.random.default_rng(seed)
    shape = (n, spec.input.channels, spec.input.height, spec.input.width)
    return rng.integers(0, 256, size=shape, dtype=np.uint8)


def with_config(entry: ModelEntry, override: Any) -> ModelEntry:
    """The entry with a config sent in a load request (a JSON object of config.toml's fields), or a 400."""
    if isinstance(override, str | bytes):
        try:
            override = json.loads(override)
        except ValueError as exc:
            raise BadInputError(f"the load request's config is not valid JSON: {exc}") from None
    if not isinstance(override, dict):
        raise BadInputError(f"the load request's config must be a JSON object of config.toml fields, got {override!r}")
    try:
        config = parse_config({**msgspec.to_builtins(entry.config), **override}, source="the load request's config")
    except ConfigError as exc:
        raise BadInputError(str(exc)) from None
    return ModelEntry(entry.name, entry.path, config, entry.versions, entry.version_errors)
