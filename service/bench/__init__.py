"""Benchmarks: the engine in-process and each served scenario (many models, rollouts, streams, a soak, A/B, front
ends, the transport, training), ``visionserve bench SCENARIO``, on one kit (:mod:`service.bench.kit`)."""
