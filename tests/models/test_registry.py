"""Contract tests for the model zoo: complete specs, the right output shape, a registry that refuses duplicates."""

from __future__ import annotations

import pytest
import torch

import models
from models.normalize import Uint8Classifier
from models.registry import register
from service.core.errors import UnknownNameError

EXPECTED = {
    "smallcnn",
    "resnet18",
    "resnet50",
    "mobilenet_v3_small",
    "mobilenet_v3_large",
    "efficientnet_b0",
    "convnext_tiny",
}


def test_the_zoo_has_every_promised_architecture() -> None:
    assert set(models.architecture_names()) >= EXPECTED


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_spec_is_complete(name: str) -> None:
    spec = models.get_architecture(name).spec
    assert spec.architecture == name
    assert spec.input.channels == 3 and spec.input.dtype == "uint8" and spec.input.layout == "NCHW"
    assert spec.input.height >= 8 and spec.input.width >= 8
    assert spec.resize_size >= max(spec.input.height, spec.input.width)
    assert len(spec.mean) == len(spec.std) == spec.input.channels
    assert all(0 < s < 1 for s in spec.std) and all(0 <= m <= 1 for m in spec.mean)
    assert spec.labels and all(isinstance(label, str) and label for label in spec.labels)
    if name != "smallcnn":
        assert spec.num_classes == 1000 and spec.labels[0] == "tench"  # torchvision's ImageNet names


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_model_gives_n_by_classes_on_a_cpu_batch(name: str) -> None:
    arch = models.get_architecture(name)
    spec = arch.spec
    torch.manual_seed(0)
    model = Uint8Classifier(arch.build(), spec.mean, spec.std).eval()
    x = torch.randint(0, 256, (2, 3, spec.input.height, spec.input.width), dtype=torch.uint8)
    with torch.inference_mode():
        out = model(x)
    assert out.shape == (2, spec.num_classes)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


def test_builders_are_keyword_only_and_take_num_classes() -> None:
    arch = models.get_architecture("resnet18")
    with pytest.raises(TypeError):
        arch.builder(7)
    assert arch.build(num_classes=7).fc.out_features == 7


def test_registry_refuses_a_duplicate_name() -> None:
    spec = models.get_architecture("smallcnn").spec
    with pytest.raises(ValueError, match="already registered"):
        register("smallcnn", spec=spec, description="again")(lambda **_: torch.nn.Identity())


def test_unknown_architecture_lists_the_choices() -> None:
    with pytest.raises(UnknownNameError) as info:
        models.get_architecture("resnet9000")
    message = str(info.value)
    assert "resnet9000" in message
    for name in EXPECTED:
        assert name in message


def test_uint8_normalize_matches_the_float_formula() -> None:
    spec = models.get_architecture("resnet18").spec
    norm = models.Uint8Normalize(spec.mean, spec.std)
    x = torch.randint(0, 256, (3, 3, 5, 5), dtype=torch.uint8)
    mean = torch.tensor(spec.mean).view(1, 3, 1, 1)
    std = torch.tensor(spec.std).view(1, 3, 1, 1)
    torch.testing.assert_close(norm(x), (x.float() / 255 - mean) / std, rtol=1e-5, atol=1e-5)
