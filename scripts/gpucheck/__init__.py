"""The parts of ``scripts/gpu_check.py`` that are not its steps: what the GPU machine brings and what is carried to
it as wheels (:mod:`gpucheck.wheels`), and the report for people (:mod:`gpucheck.report`)."""
