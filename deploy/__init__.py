"""visionserve on cluster engines people already run: Ray Serve (``deploy/ray``) and KServe (``deploy/kserve``).

Every replica is the real server, started through its command line and spoken to over HTTP: nothing here reaches
into the server's rooms (``tests/deploy/test_layers.py`` holds the rule).
"""
