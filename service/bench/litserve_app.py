"""The same TorchScript model served by LitServe, written as its docs and the usual posts write an image classifier:
the JPEG bytes of one image a request, decoded per request in the inference worker (PIL + torchvision's
``Resize`` and ``CenterCrop`` with the model's spec.json), LitServe's own batching, the graph on the GPU.

The image is the form field ``image`` (LitServe hands a form to ``decode_request``, a raw body it parses as JSON);
the answer is ``{"index", "score"}`` of the top class; ``GET /health`` answers once every worker has loaded.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from io import BytesIO
from pathlib import Path
from typing import Any

import litserve as ls  # type: ignore[import-untyped]
import torch
from PIL import Image
from torchvision import transforms


class ImageAPI(ls.LitAPI):
    """Top-1 of a TorchScript classifier (uint8 NCHW in, normalisation inside) on one JPEG a request."""

    def __init__(self, model_file: Path, spec: dict[str, Any], precision: str, max_batch_size: int,
                 batch_timeout_s: float, api_path: str) -> None:  # fmt: skip
        super().__init__(max_batch_size=max_batch_size, batch_timeout=batch_timeout_s, api_path=api_path)
        self.model_file, self.precision = model_file, precision
        self.size = (int(spec["input"]["height"]), int(spec["input"]["width"]))
        mode = transforms.InterpolationMode(spec.get("interpolation", "bilinear"))
        resize = transforms.Resize(spec.get("resize_size") or min(self.size), interpolation=mode)
        self.transform = transforms.Compose([resize, transforms.CenterCrop(self.size), transforms.PILToTensor()])

    def setup(self, device: str) -> None:
        self.device = device
        self.model = torch.jit.load(str(self.model_file), map_location=device).eval()
        with torch.inference_mode():  # a TorchScript graph optimises itself on its first calls: not on a request
            for _ in range(2):
                self.model(torch.zeros((self.max_batch_size, 3, *self.size), dtype=torch.uint8, device=device))

    # Unannotated on purpose: LitServe reads this signature, and only a bare ``request`` gets it the parsed form.
    def decode_request(self, request):  # type: ignore[no-untyped-def]
        image = request["image"]
        data = image.file.read() if hasattr(image, "file") else image
        return self.transform(Image.open(BytesIO(data)).convert("RGB"))

    # batch and unbatch: LitServe's own (torch.stack of the decoded tensors; the list of answers, one per request)
    def predict(self, x: Any) -> Any:
        with torch.inference_mode():
            logits = self.model(x.to(self.device, non_blocking=True)).float()
            score, index = torch.softmax(logits, dim=1).max(dim=1)
        return list(zip(index.tolist(), score.tolist(), strict=True))

    def encode_response(self, output: Any) -> dict[str, Any]:
        return {"index": output[0], "score": output[1]}


def model_file(model_dir: Path, spec: dict[str, Any], precision: str) -> Path:
    """The version folder's TorchScript file of ``precision`` (export's names: model.pt, model.fp16.pt)."""
    for entry in spec.get("exports", []):
        if entry.get("format") == "torchscript" and entry.get("precision") == precision:
            return model_dir / str(entry["file"])
    raise SystemExit(f"{model_dir}/spec.json lists no TorchScript {precision} artifact")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser("litserve_app", description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--model-dir", required=True, help="a model repository version folder (spec.json + model.pt)")
    p.add_argument("--device", default="cuda", help="cuda or cpu (default: cuda)")
    p.add_argument("--precision", default="fp16", choices=("fp16", "fp32"), help="artifact to load (default: fp16)")
    p.add_argument("--workers", type=int, default=1, help="LitServe's workers_per_device (default: 1)")
    p.add_argument("--max-batch-size", type=int, default=64, help="LitServe's max_batch_size (default: 64)")
    p.add_argument("--batch-timeout-s", type=float, default=0.005, help="LitServe's batch_timeout (default: 0.005)")
    p.add_argument("--api-path", default="/predict", help="the route (default: /predict)")
    p.add_argument("--port", type=int, default=8100, help="port on 127.0.0.1 (default: 8100)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    folder = Path(args.model_dir)
    spec = json.loads((folder / "spec.json").read_text())
    api = ImageAPI(model_file(folder, spec, args.precision), spec, args.precision, args.max_batch_size,
                   args.batch_timeout_s, args.api_path)  # fmt: skip
    accelerator = "cuda" if args.device.startswith("cuda") else "cpu"
    server = ls.LitServer(api, accelerator=accelerator, devices=1, workers_per_device=args.workers, timeout=60)
    server.run(host="127.0.0.1", port=args.port, log_level="warning", generate_client_file=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
