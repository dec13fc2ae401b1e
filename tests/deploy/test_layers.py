"""deploy/ stands outside the server: it may import service.core and the launcher (the one way to start
``visionserve serve`` as a subprocess and wait for it) at most, and reaches the server only through its command line
and HTTP, so the server's rooms can change shape without breaking a deployment."""

from __future__ import annotations

from tests.deploy.conftest import ROOT
from tests.test_layers import imports, reaches


def test_deploy_imports_no_server_room_and_no_model_code() -> None:
    modules = sorted((ROOT / "deploy").rglob("*.py"))
    assert modules, "deploy/ has no modules: the layout changed, update this test"
    forbidden = ("service.frontend", "service.engine", "service.transport", "service.runtime", "service.supervisor",
                 "service.cli", "service.commands", "models", "export", "loadtest", "torch", "torchvision")  # fmt: skip
    for path in modules:
        bad = reaches(imports(path), *forbidden)
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"
        # `import service` alone would reach the package root, which is the server's top: only service.core.
        assert "service" not in imports(path), f"{path.relative_to(ROOT)} imports service"
