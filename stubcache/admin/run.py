"""``stubcache run -- COMMAND...``: run a command with torch's loaders patched in every Python
process it starts, without changing its code (see ``stubcache/dropin/boot/sitecustomize.py``)."""

from __future__ import annotations

import os

from ..edge.settings import PATCH_TORCH
BOOT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dropin", "boot")


def run_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The variables ``stubcache run`` adds: the start-up hook's directory first on
    ``PYTHONPATH`` and ``STUBCACHE_PATCH_TORCH=1``. Python processes without them pay nothing."""
    environ = dict(os.environ if environ is None else environ)
    parts = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != BOOT_DIR]
    return {"PYTHONPATH": os.pathsep.join([BOOT_DIR, *parts]), PATCH_TORCH: "1"}


def exec_command(command: list[str]) -> None:
    """Replace this process with ``command`` under the hook (never returns on success)."""
    env = dict(os.environ)
    env.update(run_environment(env))
    os.execvpe(command[0], command, env)
