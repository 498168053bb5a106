"""Sessions for every package: `nox -l` lists them, `nox -s tests` runs the CPU tests."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import nox
from packaging.requirements import Requirement

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10; nox depends on tomli there
    import tomli as tomllib

ROOT = Path(__file__).parent
PACKAGES = ["mla-kernels", "ep-comm", "overlap-sched", "ref-server"]
# The CPU build that our machines keep on local disk; an unpinned torch pulls a multi-GB CUDA build.
CPU_TORCH = "torch==2.13.0"

nox.options.sessions = ["lint", "tests"]


def package_dir(package: str) -> Path:
    return ROOT / "packages" / package


def pyproject(package: str) -> dict:
    return tomllib.loads((package_dir(package) / "pyproject.toml").read_text())


def with_local_dependencies(package: str) -> list[str]:
    """The package and the packages of this repository it depends on, dependencies first."""
    names = []
    for requirement in pyproject(package)["project"]["dependencies"]:
        name = Requirement(requirement).name
        if name in PACKAGES:
            names += [dep for dep in with_local_dependencies(name) if dep not in names]
    return [*names, package]


@nox.session(reuse_venv=True)
@nox.parametrize("package", PACKAGES)
def tests(session: nox.Session, package: str) -> None:
    """CPU tests of one package, in an environment holding only it and its dependencies."""
    editable = [
        arg for name in with_local_dependencies(package) for arg in ("-e", package_dir(name))
    ]
    test_group = nox.project.dependency_groups(pyproject(package), "test")
    session.install(CPU_TORCH, *map(str, editable), *test_group)
    tests = str(package_dir(package) / "tests")
    session.run("pytest", "-m", "not gpu", "--durations=10", tests, *session.posargs)


@nox.session(venv_backend="none")
@nox.parametrize("package", PACKAGES)
def gpu(session: nox.Session, package: str) -> None:
    """GPU tests and benchmarks of one package, with the interpreter that runs nox."""
    python = sys.executable
    probe = "import torch; print(torch.cuda.is_available())"
    answer = session.run(python, "-c", probe, silent=True, success_codes=[0, 1]).strip()
    if answer != "True":
        reason = answer.splitlines()[-1] if answer else "no answer"
        session.skip(f"{python} has no CUDA torch ({reason}); run on a GPU machine")
    tests_dir = package_dir(package) / "tests"
    if not any("pytest.mark.gpu" in path.read_text() for path in tests_dir.rglob("test_*.py")):
        session.skip(f"{package} has no gpu-marked tests")
    source_dirs = [str(package_dir(name) / "src") for name in with_local_dependencies(package)]
    env = {"PYTHONPATH": os.pathsep.join([*source_dirs, os.environ.get("PYTHONPATH", "")])}
    session.run(python, "-m", "pytest", "-m", "gpu", str(tests_dir), *session.posargs, env=env)
    for benchmark in sorted((package_dir(package) / "benchmarks").glob("*.py")):
        session.run(python, str(benchmark), env=env)


@nox.session(reuse_venv=True)
def lint(session: nox.Session) -> None:
    """ruff: formatting and lint, over the whole repository."""
    session.install("ruff")
    session.run("ruff", "format", "--check", ".")
    session.run("ruff", "check", ".")


@nox.session
@nox.parametrize("package", PACKAGES)
def build(session: nox.Session, package: str) -> None:
    """Wheels into dist/, then install the package's wheel alone in a fresh venv and import it."""
    session.install("build")
    dist = ROOT / "dist"
    for name in with_local_dependencies(package):
        session.run(
            "python", "-m", "build", "--wheel", "--outdir", str(dist), str(package_dir(name))
        )
    venv = Path(session.create_tmp()) / "alone"
    session.run("python", "-m", "venv", "--clear", str(venv))
    # By name, so pip takes the newest wheel in dist/ (no package of ours is on PyPI).
    session.run(
        str(venv / "bin" / "pip"), "install", "-q", CPU_TORCH, "--find-links", str(dist), package,
        external=True,
    )  # fmt: skip
    module = package.replace("-", "_")
    probe = f"import {module}; print({module}.__name__, {module}.__version__)"
    session.run(str(venv / "bin" / "python"), "-c", probe, external=True)
    shutil.rmtree(venv)  # a torch install each: four of them filled a small CI disk


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: the deployment on loopback with the tiny model, requests, what it measured.

    A router, a prefill and a decode instance as processes; arguments after `--` go to
    `ref-server demo`."""
    session.install(
        CPU_TORCH, *(str(package_dir(name)) for name in with_local_dependencies("ref-server"))
    )
    session.run("ref-server", "demo", *session.posargs)


@nox.session
def protos(session: nox.Session) -> None:
    """Regenerate ref-server's gRPC code from packages/ref-server/proto."""
    session.install("grpcio-tools==1.66.2")
    package = package_dir("ref-server")
    session.run(
        "python", "-m", "grpc_tools.protoc", f"-I{package / 'proto'}",
        f"--python_out={package / 'src'}", f"--grpc_python_out={package / 'src'}",
        f"--pyi_out={package / 'src'}", str(package / "proto/ref_server/v1/serving.proto"),
    )  # fmt: skip
