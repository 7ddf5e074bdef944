"""Load-testing clients that pin what specdecode's own environment cannot hold, each in a virtual environment of its
own, so that the test suite can point them at `specdecode serve` (``tests/test_load_clients.py``).

    python tools/client_venvs.py setup guidellm     # once: guidellm 0.8.1 in its venv
    python tools/client_venvs.py setup aiperf       # once: aiperf 0.13 in its venv

The venvs live under ``~/.cache/specdecode/`` (``SPECDECODE_CLIENT_VENVS`` moves them); a test whose venv is absent
skips, naming this command.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(os.environ.get("SPECDECODE_CLIENT_VENVS", Path.home() / ".cache" / "specdecode"))
#: Each client's pinned distribution.
PACKAGES = {"guidellm": "guidellm==0.8.1", "aiperf": "aiperf==0.13.0"}


def venv(client: str) -> Path:
    return ROOT / f"{client}-venv"


def executable(client: str) -> Path:
    """The client's command in its venv (it may be absent)."""
    return venv(client) / "bin" / client


def setup(client: str) -> int:
    python = venv(client) / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv(client))], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", PACKAGES[client]], check=True)
    print(f"{client} is ready in {venv(client)}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    install = commands.add_parser("setup", help="create a client's venv and install it")
    install.add_argument("client", choices=sorted(PACKAGES))
    args = parser.parse_args()
    return setup(args.client)


if __name__ == "__main__":
    sys.exit(main())
