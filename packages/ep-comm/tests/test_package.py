import importlib.metadata
import subprocess
import sys

import ep_comm

SIBLINGS = {"ref_server", "overlap_sched", "mla_kernels"}


def test_version_is_the_installed_one():
    assert ep_comm.__version__ == importlib.metadata.version("ep-comm")


def test_imports_alone():
    loaded = "sorted(m for m in sys.modules if m.split('.')[0] in SIBLINGS)"
    probe = f"import sys, ep_comm; SIBLINGS = {SIBLINGS}; print({loaded})"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
