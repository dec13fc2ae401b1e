"""The load generator: talks HTTP to a server, reports latency and throughput, draws the curves."""
