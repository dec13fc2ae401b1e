"""``visionserve tune``: the server finds its own best settings for a p99 target on the machine it runs on (README,
"Tuning"). A module a phase: :mod:`~service.tune.measure`, :mod:`~service.tune.model` and :mod:`~service.tune.rank`,
:mod:`~service.tune.verify`, :mod:`~service.tune.report`. It stands on top, beside the command line, which imports
only :mod:`service.tune.commands` to build its parser.
"""
