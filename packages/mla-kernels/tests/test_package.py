import importlib.metadata
import subprocess
import sys

import mla_kernels

SIBLINGS = {"ep_comm", "overlap_sched", "ref_server"}


def test_version_is_the_installed_one():
    assert mla_kernels.__version__ == importlib.metadata.version("mla-kernels")


def test_imports_alone():
    loaded = "sorted(m for m in sys.modules if m.split('.')[0] in SIBLINGS)"
    probe = f"import sys, mla_kernels; SIBLINGS = {SIBLINGS}; print({loaded})"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
