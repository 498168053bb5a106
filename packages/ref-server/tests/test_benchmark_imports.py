"""Every name a benchmark script imports from the project's packages exists: the scripts run only
on the GPU, so a module moved or renamed would otherwise break them unnoticed."""

import ast
import importlib
from pathlib import Path

import pytest

PACKAGES = Path(__file__).resolve().parents[2]
PROJECT_MODULES = {"ref_server", "mla_kernels", "ep_comm", "overlap_sched"}
SCRIPTS = sorted(PACKAGES.glob("*/benchmarks/*.py"))


def project_imports(script: Path) -> list[tuple[str, str]]:
    tree = ast.parse(script.read_text(), str(script))
    return [
        (node.module, alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        and node.level == 0
        and node.module.split(".")[0] in PROJECT_MODULES
        for alias in node.names
    ]


def test_there_are_scripts_to_check():
    assert len(SCRIPTS) >= 10
    assert any(project_imports(script) for script in SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.parent.name}/{p.name}")
def test_project_imports_resolve(script):
    for module_name, name in project_imports(script):
        module = importlib.import_module(module_name)
        if not hasattr(module, name):
            importlib.import_module(f"{module_name}.{name}")  # a submodule; raises if absent
