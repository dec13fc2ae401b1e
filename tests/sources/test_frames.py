"""A video frame to a model's input through FFmpeg's scaler (service/frontend/sources/frames.py): the geometry and
Transform of the PIL path exactly, the pixels within a filter's difference of it."""

from __future__ import annotations

from pathlib import Path

import av
import msgspec
import numpy as np
import pytest

from service.core.preprocess import prepare
from service.core.spec import load_spec
from service.frontend.sources.frames import frame_input
from tests.sources.video import write_mp4

ROOT = Path(__file__).resolve().parents[2]
DETECTOR = load_spec(ROOT / "examples" / "model_repository" / "digits-detect" / "1" / "spec.json")


@pytest.mark.parametrize(
    "spec",
    [
        DETECTOR,  # letterbox, RGB
        msgspec.structs.replace(DETECTOR, resize="stretch"),
        msgspec.structs.replace(DETECTOR, resize="shorter", resize_size=110),  # shorter side, then a centre crop
        msgspec.structs.replace(
            DETECTOR, input=msgspec.structs.replace(DETECTOR.input, channels=1), mean=(0.0,), std=(1.0,)
        ),  # grey
    ],
    ids=["letterbox", "stretch", "crop", "grey"],
)
def test_a_frame_becomes_the_same_input_as_through_pil(spec: object, tmp_path: Path) -> None:
    clip = write_mp4(tmp_path / "clip.mp4", frames=5, width=320, height=200)
    with av.open(str(clip)) as container:
        frames = list(container.decode(container.streams.video[0]))
    for frame in frames:
        fast, transform = frame_input(frame, spec)  # type: ignore[arg-type]
        slow, expected = prepare(frame.to_image(), spec)  # type: ignore[arg-type]
        assert fast.shape == slow.shape and fast.dtype == np.uint8
        assert transform == expected
        difference = np.abs(fast.astype(np.int16) - slow.astype(np.int16))
        # Filters differ at sharp edges (and chroma is upsampled its own way): close on average, nearly everywhere.
        assert difference.mean() < 4.0 and np.mean(difference <= 16) >= 0.95, (difference.mean(), difference.max())
