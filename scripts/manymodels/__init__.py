"""The parts of ``scripts/many_models_bench.py`` that are not its orchestration: building the model copies
(:mod:`manymodels.models`), reading a server's charged bytes and its engine's RSS while the traffic runs
(:mod:`manymodels.memory`), sending the traffic and replaying an ideal LRU on it (:mod:`manymodels.traffic`), the
cold-start measurements in process, served and in Triton (:mod:`manymodels.coldstart`), and every target's figures,
verdicts and printed report (:mod:`manymodels.judge`, :mod:`manymodels.report`)."""
