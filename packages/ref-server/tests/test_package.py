import importlib.metadata
import subprocess
import sys
from pathlib import Path

import ref_server


def test_version_is_the_installed_one():
    assert ref_server.__version__ == importlib.metadata.version("ref-server")


def test_console_script_is_installed():
    script = Path(sys.executable).with_name("ref-server")
    result = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"ref-server {ref_server.__version__}"
