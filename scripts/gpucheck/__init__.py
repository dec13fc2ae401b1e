"""What ``scripts/gpu_check.py`` and ``scripts/gpu_speed.py`` share: the step runner (:mod:`gpucheck.steps`), the
install step (:mod:`gpucheck.install`), what the GPU machine brings and what is carried to it as wheels
(:mod:`gpucheck.wheels`), running a command with its log (:mod:`gpucheck.proc`), and the report's parts
(:mod:`gpucheck.report`)."""
