"""``stubcache.load_inline``: the drop-in's front, a warm call served by the compact hit path.

An engine calls ``load_inline`` once per stub at start-up, right after ``import torch``; on a
warm host every such call is a hit, and the modules a hit imports are most of its cost. So the
call first asks :mod:`stubcache.hit` for the record the full drop-in left for the very same
call (see there for what a record is and every check a hit through it makes), and only if there
is none, or the call is one the record cannot answer (a Python module, CUDA, include paths,
``verbose``, a setting to check, a second version of a name in this process), runs the full
drop-in, :func:`stubcache.dropin.compat.load_inline_recording`, which leaves the record for the next process.

"""

from __future__ import annotations

import os
import time

from .. import hit

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (hit path)
if TYPE_CHECKING:
    from typing import Any, Sequence

# load_inline's parameters that become spec fields, in stubcache.key.FIELDS' order (the name
# aside): a call is these values, frozen, as stubcache.dropin.compat forms it from FIELDS
# (tests/test_hitpath_imports.py checks that the two agree).
FORWARDED = ("cpp_sources", "cuda_sources", "functions", "extra_cflags", "extra_cuda_cflags", "extra_ldflags",
             "extra_include_paths", "with_cuda", "is_python_module", "with_pytorch_error_handling",
             "no_implicit_headers")

def load_inline(
    name: str,
    cpp_sources: str | Sequence[str],
    cuda_sources: str | Sequence[str] | None = None,
    sycl_sources: str | Sequence[str] | None = None,
    functions: Sequence[str] | dict[str, str] | str | None = None,
    extra_cflags: Sequence[str] | None = None,
    extra_cuda_cflags: Sequence[str] | None = None,
    extra_sycl_cflags: Sequence[str] | None = None,
    extra_ldflags: Sequence[str] | None = None,
    extra_include_paths: Sequence[str] | None = None,
    build_directory: str | None = None,
    verbose: bool = False,
    with_cuda: bool | None = None,
    with_sycl: bool | None = None,
    is_python_module: bool = True,
    with_pytorch_error_handling: bool = True,
    keep_intermediates: bool = True,
    use_pch: bool = False,
    no_implicit_headers: bool = False,
    gil_not_used: bool = False,
) -> Any:
    """Drop-in for ``torch.utils.cpp_extension.load_inline``: same parameters, same results
    (the module for ``is_python_module=True``, the library path otherwise), but content-addressed
    and safe for concurrent processes.

    As torch does, a second call in one process with the same ``name`` and different inputs loads
    the new code as module ``name_v1`` (then ``name_v2``, ...); ``verbose=True`` shows torch's build
    output (commands and compiler output, live, on stdout); a failed build raises
    :class:`stubcache.BuildError`, a ``RuntimeError`` with torch's message shape.

    With a ``build_directory``, the library is also at ``<build_directory>/<name>.so`` when this
    returns, and that file is the one loaded (a later ``dlopen`` of that path gets the same
    handle, as with torch); the build itself happens in a private staging directory, never there
    (see :mod:`stubcache.dropin.builddir` for the checks on the directory). ``keep_intermediates`` and
    ``use_pch`` are accepted and ignored; flags are split into words as torch's build file does,
    but never seen by a shell; ``functions`` may also be a tuple. SYCL and ``gil_not_used`` are not
    supported (:class:`stubcache.UnsupportedError`, a ``ValueError``; a patched torch hands such
    calls to torch).
    """
    args = locals()
    digest = None
    turn = None
    since = None
    if (is_python_module is False and not verbose and cuda_sources is None and functions is None
            and not extra_include_paths and sycl_sources is None and extra_sycl_cflags is None
            and with_sycl is None and with_cuda is not True and gil_not_used is False and type(name) is str
            and name.isascii() and name.isidentifier()
            and cpp_sources and (build_directory is None or type(build_directory) is str)
            and hit.quick_settings()):
        call = tuple([hit.frozen(args[f]) for f in FORWARDED])
        known = hit.versions.get(name)
        root = hit.default_root()
        if (known is None or known == (0, call)) and root is not None:
            digest = hit.request_digest("load_inline", (name, call))
            found = hit.find(root, digest) if digest is not None else None
            if found is None and digest is not None:
                # No record: one process at a time serves this call and leaves the record; the
                # others wait for it and take that (see StubCache.load).
                since = time.time()
                from . import requestlock

                turn = requestlock.request_turn(root, digest)
                if turn == requestlock.WAITED:
                    turn = None
                    found = hit.find(root, digest)
            if found is not None:
                result = _load(found, build_directory, name)
                if result is not None:
                    if turn is not None:
                        os.close(turn)
                    with hit.versions_lock:
                        hit.versions.setdefault(name, (0, call))
                    return result
    try:
        from ..dropin import compat

        return compat.load_inline_recording(digest, args, since)
    finally:
        if turn is not None:
            os.close(turn)  # the record is there (or cannot be): the next process's turn


def _load(found: hit.Hit, build_directory: str | None, name: str) -> str | None:
    if build_directory is not None:
        return hit.load_placed(found, build_directory, name)
    if hit.load(found) is None:
        return None
    return hit.REAL_PATHS[found.path]  # the real path it was loaded (and checked) by


setattr(load_inline, hit.DROPIN_MARK, True)
