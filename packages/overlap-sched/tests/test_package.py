import importlib.metadata
import subprocess
import sys

import overlap_sched

SIBLINGS = {"ep_comm", "ref_server", "mla_kernels"}


def test_version_is_the_installed_one():
    assert overlap_sched.__version__ == importlib.metadata.version("overlap-sched")


def test_imports_alone():
    loaded = "sorted(m for m in sys.modules if m.split('.')[0] in SIBLINGS)"
    probe = f"import sys, overlap_sched; SIBLINGS = {SIBLINGS}; print({loaded})"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
