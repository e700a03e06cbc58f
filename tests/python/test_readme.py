"""The README's Python example runs as written (on a free port)."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

from conftest import subprocess_env

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_readme_python_example_runs(library):
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README.md has no python example"
    code = blocks[0].replace("14579", str(_free_port()))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=subprocess_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert "'available': ['t1']" in done.stdout, done.stdout
