"""The parts of ``scripts/gpu_speed.py`` that are not its steps: LitServe's app (:mod:`gpuspeed.litserve_app`), the
load tester's engine against a plain route (:mod:`gpuspeed.drive`), the servers pinned to their cores and their CPU
use (:mod:`gpuspeed.servers`), and the report (:mod:`gpuspeed.report`)."""
