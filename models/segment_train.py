"""What training a segmenter adds to training a detector (``visionserve train --arch digitseg --dataset canvases``,
``models/detect_train.py``): each pasted digit's ink is its instance mask (``make_canvases(..., masks=True)``),
learnt YOLACT's way, and the held-out canvases are judged by pycocotools' ``COCOeval`` with ``iouType="segm"``
(the field's evaluator, not ours) on the masks the server itself would answer (``service.core.tasks.Segment``).

The mask loss: at each object's centre cell its coefficients times the prototypes give the mask's logits at stride
2; binary cross-entropy against the digit's mask (its ink at stride 2: a cell is inside when half of its four
pixels are), counted inside the object's box only and averaged over the boxes' cells, as YOLACT crops.
"""

from __future__ import annotations

import contextlib
import io
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from models.canvases import Canvases
from models.segmenter import PROTO_STRIDE

MASK_WEIGHT = 1.0
MASK_EVALUATOR = (
    "pycocotools COCOeval, iouType segm: AP@[.5:.95], AP@0.5, AP@0.75 of the masks the server answers (score "
    "threshold 0.05), each digit's truth its ink at the box's threshold"
)


def mask_targets(canvases: Canvases, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(each object's mask at stride 2 ``[B, M, H / 2, W / 2]``, 1 inside its box at stride 2, else 0)."""
    assert canvases.masks is not None
    masks = torch.from_numpy(canvases.masks).to(device).float()
    b, m, h, w = masks.shape
    small = (F.avg_pool2d(masks.view(b * m, 1, h, w), PROTO_STRIDE) >= 0.5).float().view(b, m, h // 2, w // 2)
    boxes = torch.from_numpy(canvases.boxes).to(device) / PROTO_STRIDE
    ys = torch.arange(h // 2, device=device, dtype=torch.float32) + 0.5
    xs = torch.arange(w // 2, device=device, dtype=torch.float32) + 0.5
    inside_x = (xs >= boxes[..., 0:1]) & (xs <= boxes[..., 2:3])  # [B, M, w]
    inside_y = (ys >= boxes[..., 1:2]) & (ys <= boxes[..., 3:4])
    crop = (inside_y[..., :, None] & inside_x[..., None, :]).float()
    return small, crop


def mask_loss(
    coefficients: torch.Tensor, protos: torch.Tensor, index: torch.Tensor, present: torch.Tensor,
    masks: torch.Tensor, crop: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """The cropped cross-entropy of the objects' masks: ``coefficients`` ``[B, P, h, w]`` at their centre cells
    (``index`` ``[B, M]``, flattened; ``present`` the real objects) times ``protos`` ``[B, P, h2, w2]``."""
    p = coefficients.shape[1]
    picked = coefficients.flatten(2).gather(2, index.unsqueeze(1).expand(-1, p, -1)).transpose(1, 2)  # [B, M, P]
    logits = torch.bmm(picked, protos.flatten(2)).view_as(masks)
    weight = crop * present[..., None, None]
    loss = F.binary_cross_entropy_with_logits(logits, masks, reduction="none")
    return (loss * weight).sum() / weight.sum().clamp(min=1)


def truth_coco(canvases: Canvases, labels: tuple[str, ...]) -> dict[str, Any]:
    """The canvases' objects as a COCO annotations document (each digit's mask as compressed RLE)."""
    from pycocotools import mask as coco_mask

    assert canvases.masks is not None
    images: list[dict[str, Any]] = []
    annotations: list[dict[str, Any]] = []
    size = canvases.images.shape[1]
    for i in range(len(canvases)):
        images.append({"id": i + 1, "width": size, "height": size, "file_name": f"{i}.png"})
        for slot in np.flatnonzero(canvases.labels[i] >= 0):
            rle = coco_mask.encode(np.asfortranarray(canvases.masks[i, slot].astype(np.uint8)))
            x1, y1, x2, y2 = canvases.boxes[i, slot].tolist()
            annotations.append({
                "id": len(annotations) + 1, "image_id": i + 1, "category_id": int(canvases.labels[i, slot]),
                "segmentation": {"size": rle["size"], "counts": rle["counts"].decode()}, "iscrowd": 0,
                "area": float(canvases.masks[i, slot].sum()), "bbox": [x1, y1, x2 - x1, y2 - y1],
            })  # fmt: skip
    categories = [{"id": c, "name": label} for c, label in enumerate(labels)]
    return {"images": images, "annotations": annotations, "categories": categories}


def segm_ap(truth: dict[str, Any], found: list[dict[str, Any]]) -> tuple[float, float, float]:
    """(mask AP@[.5:.95], AP@0.5, AP@0.75) of ``found`` (COCO results) against ``truth``, by ``COCOeval``."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    if not found:
        return 0.0, 0.0, 0.0
    with contextlib.redirect_stdout(io.StringIO()):  # COCO prints its progress
        gt = COCO()
        gt.dataset = truth
        gt.createIndex()
        evaluation = COCOeval(gt, gt.loadRes(found), iouType="segm")
        evaluation.evaluate()
        evaluation.accumulate()
        evaluation.summarize()
    return float(evaluation.stats[0]), float(evaluation.stats[1]), float(evaluation.stats[2])


def served_results(outputs: tuple[np.ndarray, np.ndarray], spec: Any, first_id: int) -> list[dict[str, Any]]:
    """What the server answers for a batch of canvases (``service.core.tasks.Segment`` with the model's default
    options but a 0.05 score threshold, as COCO's evaluation counts the low-scored too), as COCO results."""
    import msgspec

    from service.core.status import InferResult
    from service.core.tasks import Segment, Want

    task = Segment(spec)
    options = msgspec.structs.replace(task.default, score_threshold=0.05)
    head, protos = outputs
    post = task.postprocess(
        InferResult({"output0": head, "output1": protos}, [None] * len(head)), Want(options=options)
    )
    found = []
    for i, rows in enumerate(post.predictions):
        for r in rows:
            x1, y1, x2, y2 = (float(v) for v in r["box"])  # type: ignore[attr-defined]
            found.append({"image_id": first_id + i, "category_id": r["index"], "segmentation": r["mask"],
                          "bbox": [x1, y1, x2 - x1, y2 - y1], "score": r["score"]})  # fmt: skip
    return found


@torch.inference_mode()
def evaluate_masks(
    network: torch.nn.Module, normalize: torch.nn.Module, spec: Any, canvases: Canvases, device: torch.device,
    batch: int = 200,
) -> tuple[float, float, float]:  # fmt: skip
    """(mask AP@[.5:.95], AP@0.5, AP@0.75) of ``network``'s masks on ``canvases``, as the server answers them."""
    network.eval()
    found: list[dict[str, Any]] = []
    for i in range(0, len(canvases), batch):
        grey = torch.from_numpy(canvases.images[i : i + batch]).to(device)
        head, protos = network(normalize(grey.unsqueeze(1).expand(-1, 3, -1, -1)))  # as the server sends it
        found += served_results((head.float().cpu().numpy(), protos.float().cpu().numpy()), spec, i + 1)
    return segm_ap(truth_coco(canvases, spec.labels), found)
