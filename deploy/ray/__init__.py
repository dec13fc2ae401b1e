"""Ray Serve deployment of visionserve: each replica runs ``visionserve serve`` as a child process on a free
127.0.0.1 port and forwards Ray's HTTP traffic to it.

Start it with ``serve run deploy/ray/serve.yaml`` (see docs/deploy.md).
"""

from __future__ import annotations

from deploy.ray.app import VisionServe, build_app
from deploy.ray.child import ReplicaOptions, ServerProcess

__all__ = ["ReplicaOptions", "ServerProcess", "VisionServe", "build_app"]
