"""The parts of ``scripts/rollout_bench.py`` that are not its orchestration: candidate versions derived from a served
ONNX version folder, each disagreeing with it by a known amount, and the held-out digits that measure it
(:mod:`rollout.candidates`)."""
