"""Writing artifacts: an eager uint8 model (a classifier, or a detector) -> ``model.onnx`` (dynamic batch) or
``model.pt`` (TorchScript).

The graph takes uint8 NCHW and does the float conversion and normalisation inside (:mod:`models.normalize`).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

DEFAULT_OPSET = 20
MAX_EXPORT_BATCH = 4096  # the dynamic batch dimension's upper bound in the exported ONNX graph


class Fp32Output(nn.Module):
    """Casts a reduced-precision model's logits back to float32, so every artifact answers in FP32."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x).float()


def half_model(model: nn.Module) -> nn.Module:
    """An fp16 copy of ``model`` whose output is float32."""
    import copy

    return Fp32Output(copy.deepcopy(model).half()).eval()


def example_input(channels: int, height: int, width: int, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 256, (batch, channels, height, width), dtype=torch.uint8)


def to_onnx(
    model: nn.Module,
    example: torch.Tensor,
    path: Path,
    *,
    opset: int = DEFAULT_OPSET,
    output: str | tuple[str, ...] = "logits",
) -> None:
    """Export with torch's ONNX exporter (torch.export based); batch dimension dynamic from 1 to 4096; ``output``:
    the output's name, or each one's (a segmenter's two)."""
    import onnx

    batch = torch.export.Dim("batch", min=1, max=MAX_EXPORT_BATCH)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model.eval(),
            (example,),
            str(path),
            input_names=["input"],
            output_names=[output] if isinstance(output, str) else list(output),
            dynamic_shapes={"x": {0: batch}},
            opset_version=opset,
            dynamo=True,
            external_data=False,
            verbose=False,
        )
    onnx.checker.check_model(onnx.load(str(path)), full_check=True)


def to_torchscript(model: nn.Module, example: torch.Tensor, path: Path) -> None:
    """Trace to TorchScript (the graph is fixed; every model here has a static control flow)."""
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(model.eval(), (example,), check_trace=False)
        traced.save(str(path))


def to_aoti(model: nn.Module, example: torch.Tensor, path: Path, *, device: str = "cpu") -> None:
    """``torch.export`` with a dynamic batch dimension (1 to 4096), then AOTInductor compiles and packages it for
    ``device``'s type (a package loads only there). Runs the C++ compiler: about 14 s for smallcnn and 56 s for
    resnet18 on a 2-core VM with torch 2.14.1."""
    import copy

    batch = torch.export.Dim("batch", min=1, max=MAX_EXPORT_BATCH)
    target = copy.deepcopy(model).eval().to(device)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.export.export(target, (example.to(device),), dynamic_shapes={"x": {0: batch}})
        torch._inductor.aoti_compile_and_package(program, package_path=str(path))


def cuda_toolkit_missing() -> str | None:
    """Why AOTInductor cannot compile for CUDA here (None: it can). Its CUDA compile needs the CUDA toolkit's headers
    and nvcc (CUDA_HOME), which a pip-only torch does not bring (pytorch/pytorch#150442): said before a compile
    that would fail minutes in."""
    from torch.utils import cpp_extension

    home = cpp_extension.CUDA_HOME
    if home is None or not (Path(home) / "include" / "cuda_runtime.h").is_file():
        return ("AOTInductor's CUDA compile needs the CUDA toolkit (headers and nvcc, found through CUDA_HOME); "
                f"none here (CUDA_HOME: {home}): install it, or leave aoti out of --formats")  # fmt: skip
    return None
