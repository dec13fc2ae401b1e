"""Camera and file sources the server pulls video from: URL policy, readers and the registry of running sources."""
