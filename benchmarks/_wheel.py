"""The checkout installed as users install it: a wheel in a scratch virtual environment.

The fresh-process scenarios time whole interpreter starts, so how stubcache is installed matters:
an editable install (``pip install -e``) adds setuptools' import finder to every start of that
Python, the floor's included (about 11 ms here), which both inflates the floor and hides the
package's own import cost. So those scenarios run their children in a venv made here, without
the system site-packages, holding only the wheel built from this checkout (``--no-deps``) and
what a hit of a header-free stub imports; torch is not installed there (a direct-path hit must
not need it). Building the wheel needs setuptools (the build backend) and no network.

If the venv cannot be made, :func:`wheel_env` returns the running interpreter with this checkout
on ``PYTHONPATH`` and says so in ``note``; the scenarios print that note with their results.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from _common import PY, REPO

# What a hit or a direct build imports besides the standard library: platformdirs when
# STUBCACHE_DIR is unset, filelock for a miss's build lock.
HIT_DEPS = ("platformdirs", "filelock")


@dataclass(frozen=True)
class WheelEnv:
    python: str  # the interpreter the fresh-process children run
    wheel: bool  # True: a wheel in a scratch venv; False: the fallback (this Python, PYTHONPATH)
    note: str  # how it was made, or why the fallback was used
    cwd: str | None  # where its children run: `python -c` puts the working directory first on sys.path

    @property
    def label(self) -> str:
        return "wheel install" if self.wheel else "editable/PYTHONPATH (fallback)"


def _run(cmd: list[str], **kw) -> None:
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300, **kw)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])}... failed ({proc.returncode}): {proc.stdout.strip()[-800:]}")


def _version(pkg: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(pkg)
    except PackageNotFoundError:
        return None


def make_wheel_env(work: Path, tree: Path = REPO, torch: bool = False) -> WheelEnv:
    """Build the wheel of ``tree`` (default: this checkout) and install it into ``work/venv``
    (see the module docstring). ``torch=True`` makes an engine's environment instead: the venv
    sees this Python's site-packages (torch, ninja, filelock, ...), and the wheel, installed in
    the venv's own site-packages, comes first on ``sys.path`` (an editable install's finder, if
    any, is consulted only after the path)."""
    src = work / "src"
    src.mkdir(parents=True)
    # A copy of what the wheel is built from, so building leaves no build/ or egg-info in the tree.
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (tree / name).exists():
            shutil.copy2(tree / name, src / name)
    for pkg in ("stubcache", "kvarena"):
        shutil.copytree(tree / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))
    dist = work / "dist"
    _run([PY, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(dist),
          str(src)])
    wheels = glob.glob(str(dist / "stubcache-*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one stubcache wheel in {dist}, found {wheels}")
    venv = work / "venv"
    _run([PY, "-m", "venv", "--without-pip", *(["--system-site-packages"] if torch else []), str(venv)])
    vpy = str(venv / "bin" / "python")
    # pip --python installs into the venv without putting pip there; installing compiles bytecode.
    # Without PYTHONPATH: pip would count a checkout on it as "already installed" and skip the wheel.
    _run([PY, "-m", "pip", "--python", vpy, "install", "-q", "--no-deps", "--no-index", wheels[0]],
         env=clean_env({}))
    deps = []
    for dep in () if torch else HIT_DEPS:
        ver = _version(dep)
        _run([PY, "-m", "pip", "--python", vpy, "install", "-q", "--no-deps", f"{dep}=={ver}" if ver else dep])
        deps.append(f"{dep} {ver or ''}".strip())
    # The children must import the wheel, never the checkout or the editable install.
    probe = subprocess.run([vpy, "-c", "import stubcache, sys; print(stubcache.__file__); "
                            "print((not TORCH and any('__editable__' in p for p in sys.path)) or 'torch' in sys.modules)"
                            .replace("TORCH", str(torch))],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=clean_env({}),
                           cwd=str(venv))
    where = probe.stdout.split()
    if probe.returncode != 0 or not where or not where[0].startswith(str(venv)) or where[-1] != "False":
        raise RuntimeError(f"the venv does not import the wheel: {probe.stdout.strip()[-400:]}")
    if torch:
        return WheelEnv(vpy, True, f"wheel {Path(wheels[0]).name} (pip wheel --no-deps --no-build-isolation) in a "
                                   f"venv with this Python's site-packages (torch {_version('torch')})", str(venv))
    return WheelEnv(vpy, True, f"wheel {Path(wheels[0]).name} (pip wheel --no-deps --no-build-isolation) in a "
                               f"venv without system site-packages, plus {', '.join(deps)}; no torch", str(venv))


def wheel_env(work: Path, torch: bool = False) -> WheelEnv:
    """A :class:`WheelEnv`, or the fallback with the reason in ``note``."""
    try:
        return make_wheel_env(work, torch=torch)
    except Exception as exc:  # noqa: BLE001 - any failure means: fall back, and say why
        return WheelEnv(PY, False, f"FALLBACK: could not make a wheel venv ({exc}); these children ran "
                                   "this Python with the checkout on PYTHONPATH (editable set-up: the "
                                   "setuptools finder, if installed, adds to every start, floor included)", None)


def clean_env(extra: dict) -> dict:
    """Environment for a child of the wheel venv: no PYTHONPATH (it would shadow the wheel),
    bytecode caches used, no stray stubcache knobs."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE", "PYTHONHOME", "STUBCACHE_DIR",
                        "STUBCACHE_REQUIRE_HIT", "STUBCACHE_LOCK_TIMEOUT", "TORCH_EXTENSIONS_DIR")
           and not k.startswith("STUBCACHE_REMOTE")}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def child_env_for(env: WheelEnv, **extra: str) -> dict:
    """The environment for a fresh-process child of ``env`` (the fallback keeps PYTHONPATH)."""
    if env.wheel:
        return clean_env(extra)
    from _common import child_env

    return child_env(**extra)


if __name__ == "__main__":  # python benchmarks/_wheel.py DIR: make the venv and print what it is
    import tempfile

    sys.exit(print(wheel_env(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp()))))
