"""``visionserve tune``: the server finds its own best settings for a p99 target on the machine it runs on.

Four phases, a module each: :mod:`~service.tune.measure` (the model in-process: every runtime and precision per
batch size and thread count, and the decode cost), :mod:`~service.tune.model` and :mod:`~service.tune.rank` (a
queueing simulation predicts each configuration's capacity at the target; a coordinate search ranks them),
:mod:`~service.tune.verify` (the best few served for real and loaded with the load tester's p99 search), and
:mod:`~service.tune.report` (JSON, Markdown, a plot, and the winning ``config.toml``). It stands on top, beside
the command line: it drives the engine's runtimes in-process, the load tester, and ``serve`` as a subprocess.

Kept light: the command line imports :mod:`service.tune.commands` to build its parser.
"""
