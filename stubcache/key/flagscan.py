"""What the flags of a spec make the compiler and linker read: one scanner over every flag
list that reaches a compiler invocation.

On the direct path compile and link are one command, so an ``-I`` in ``extra_ldflags``
searches for headers and an ``-L`` in ``extra_cflags`` searches for libraries; on torch's path
``extra_ldflags`` reach the link step only. Either way ``-march=native`` anywhere generates code
for this CPU. :func:`scan` reads any number of lists and says, for each flag that matters:

* ``search``: the flags that change the include search (``-I``, ``-iquote``, ``-isystem``,
  ``-idirafter``, ``--sysroot``, ``-nostdinc``, …) with their values, in order, to hand to the
  search-order probe;
* ``host_targets``: ``-march=native``/``-mtune=native``/``-mcpu=native`` (also through
  ``-Xcompiler``), as the driver takes them;
* ``tool_flags``: ``-fuse-ld=``, ``--ld-path=``, ``-B``: which programs the driver runs;
* ``files``: the files flags name (``@FILE``, ``-specs=``, ``-include``, ``-imacros``,
  ``-fplugin=``, linker scripts, ``-Wl,@FILE``, …), as written;
* ``lib_dirs``/``lib_names``: ``-L``/``-l`` given to the driver or to the linker through
  ``-Wl,``/``-Xlinker``, in order.

gcc's long spellings (``--prefix=DIR``, ``--library-directory=DIR``, ``--include-directory``,
``--plugin=FILE``, …) are read as their short forms (:func:`short_spellings`).

Pure: no file is opened (a hit builds specs, and so scans, without touching disk).
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (hit path)
if TYPE_CHECKING:
    from typing import Any, Iterable, Sequence

TOOL_FLAG_PREFIXES = ("-fuse-ld=", "--ld-path=", "-B")
# Include-search flags that take a value, joined (-Idir) or as the next word (-I dir).
SEARCH_WITH_VALUE = ("-I", "-iquote", "-isystem", "-idirafter", "-isysroot", "-iprefix", "-iwithprefix",
                     "-iwithprefixbefore", "--sysroot", "-imultilib")
SEARCH_ALONE = ("-nostdinc", "-nostdinc++", "-I-", "-nostdlibinc")
# Flags naming a file the compiler reads, joined by "=" or as the next word.
FILE_WITH_VALUE = ("-include", "-imacros", "-specs", "--specs", "-fplugin", "-fprofile-use", "-fprofile-sample-use",
                   "-fsanitize-blacklist", "-fsanitize-ignorelist", "-fcoverage-mapping-file")
# Linker options naming a file (given through -Wl, or -Xlinker).
LINKER_FILE_OPTIONS = ("-T", "--script", "--version-script", "--dynamic-list", "-dT", "--default-script",
                       "--retain-symbols-file")
HOST_TARGET_PREFIXES = ("-march=", "-mtune=", "-mcpu=")
# gcc's long spellings of flags scanned here (the Alias entries of its option files; clang takes
# most of them too): "--prefix=DIR" and "--prefix DIR" are "-B DIR", and so on. gcc reads any
# other "--name[=value]" as "-fname[=value]" ("--plugin=x.so" is "-fplugin=x.so") and
# "--machine-X", "--machine=X" as "-mX"; it takes no abbreviation of a long option.
LONG_ALIASES = {"--prefix": "-B", "--library-directory": "-L", "--include-directory": "-I",
                "--include-directory-after": "-idirafter", "--include-prefix": "-iprefix",
                "--include-with-prefix": "-iwithprefix", "--include-with-prefix-after": "-iwithprefix",
                "--include-with-prefix-before": "-iwithprefixbefore", "--imacros": "-imacros",
                "--include": "-include", "--for-linker": "-Xlinker", "--force-link": "-u"}
LONG_ALONE = {"--no-standard-includes": "-nostdinc", "--include-barrier": "-I-"}
_JOINED_SHORT = ("-B", "-L", "-I")  # "-BDIR"; the others take their value as the next word
# Flags whose value is the next word, whatever it looks like (`-Xassembler --prefix=x` hands the
# assembler that word): short_spellings leaves it as it is.
SEPARATE_VALUE = frozenset({"-Xlinker", "-Xassembler", "-Xpreprocessor", "-Xcompiler", "-o", "-MF", "-MT", "-MQ",
                            "-x", "--param", "-aux-info", "-dumpbase", "-dumpbase-ext", "-dumpdir", "-u", "-e",
                            "-T", "-z", "-I", "-L", "-l", "-B", "-D", "-U", "-A", "-include", "-imacros",
                            "-isystem", "-iquote", "-idirafter", "-iprefix", "-iwithprefix", "-iwithprefixbefore",
                            "-isysroot", "-imultilib", "-specs", "--specs", "--sysroot", "-Xclang"})


class FlagScan:
    """What :func:`scan` found (see the module docstring); every field a tuple, in flag order."""

    __slots__ = ("search", "host_targets", "tool_flags", "files", "lib_dirs", "lib_names")

    def __init__(self, search: tuple[Any, ...], host_targets: tuple[str, ...], tool_flags: tuple[str, ...], files: tuple[Any, ...], lib_dirs: tuple[Any, ...],
                 lib_names: tuple[Any, ...]) -> None:
        self.search = search
        self.host_targets = host_targets
        self.tool_flags = tool_flags
        self.files = files
        self.lib_dirs = lib_dirs
        self.lib_names = lib_names

    @property
    def reads_user_files(self) -> bool:
        """Whether the flags name include directories or files (their contents may change)."""
        return bool(self.search or self.files or self.lib_dirs)


def _linker_args(flag: str, nxt: str | None) -> tuple[list[str], int]:
    """The linker arguments a driver flag carries, and how many words it took."""
    if flag.startswith("-Wl,"):
        return flag.split(",")[1:], 1
    if flag == "-Xlinker" and nxt is not None:
        return [nxt], 2
    return [], 1


def short_spellings(flags: Iterable[str]) -> list[str]:
    """``flags`` with gcc's long spellings of the flags :func:`scan` reads rewritten to their
    short forms (see :data:`LONG_ALIASES`), every other flag as it is."""
    flags = list(flags)
    out: list[str] = []
    i, n = 0, len(flags)
    while i < n:
        f = flags[i]
        i += 1
        if f in SEPARATE_VALUE and i < n:
            out += [f, flags[i]]  # its value, not a flag
            i += 1
            continue
        if not f.startswith("--"):
            out.append(f)
            continue
        name, eq, value = f.partition("=")
        short = LONG_ALIASES.get(name)
        if short is not None and not eq and i < n:  # "--prefix DIR"
            value, eq = flags[i], "="
            i += 1
        if short is not None and eq:
            out += [short + value] if short in _JOINED_SHORT else [short, value]
        elif f in LONG_ALONE:
            out.append(LONG_ALONE[f])
        elif name.startswith("--machine-") or (name == "--machine" and eq):
            out.append("-m" + (f[len("--machine-"):] if name != "--machine" else value))
        elif eq and "-f" + name[2:] in FILE_WITH_VALUE:
            out.append("-f" + f[2:])
        else:
            out.append(f)
    return out


def option_values(words: Sequence[str], option: str) -> list[str]:
    """The values of a one-letter ``option`` (``-B``, ``-I``) among ``words``, given joined
    (``-BDIR``) or as the next word (``-B DIR``), in order."""
    values = []
    for i, w in enumerate(words):
        if w == option and i + 1 < len(words):
            values.append(words[i + 1])
        elif w.startswith(option) and len(w) > len(option):
            values.append(w[len(option):])
    return values


def scan(*lists: Iterable[str]) -> FlagScan:
    """Scan the flag lists (in command-line order) for everything :class:`FlagScan` holds."""
    flags = short_spellings(f for lst in lists for f in lst)
    search: list[str] = []
    host: list[str] = []
    tools: list[str] = []
    files: list[str] = []
    lib_dirs: list[str] = []
    lib_names: list[str] = []
    linker: list[str] = []  # the arguments that reach the linker itself, in order
    i, n = 0, len(flags)
    while i < n:
        f = flags[i]
        nxt = flags[i + 1] if i + 1 < n else None
        step = 1
        if f.startswith(TOOL_FLAG_PREFIXES):
            tools.append(f)
            if f == "-B" and nxt is not None:
                tools.append(nxt)
                step = 2
        elif f.startswith("@") and len(f) > 1:
            files.append(f[1:])
        elif f in SEARCH_ALONE:
            search.append(f)
        elif f in SEARCH_WITH_VALUE and nxt is not None:
            search += [f, nxt]
            step = 2
        elif f.startswith(SEARCH_WITH_VALUE) and not f.startswith(("-include", "-imacros")):
            search.append(f)
        elif f.startswith(("-Wl,", "-Xlinker")):
            args, step = _linker_args(f, nxt)
            linker += args
        elif f in ("-L", "-l") and nxt is not None:
            linker += [f, nxt]
            step = 2
        elif f.startswith(("-L", "-l")) and len(f) > 2:
            linker.append(f)
        else:
            name, eq, value = f.partition("=")
            if name in FILE_WITH_VALUE:
                if eq:
                    files.append(value)
                elif nxt is not None:
                    files.append(nxt)
                    step = 2
        target = f.split("=", 1)[1] if f.startswith("-Xcompiler=") else f
        for t in target.split(","):
            if t.startswith(HOST_TARGET_PREFIXES) and t.endswith("=native") and t not in host:
                host.append(t)
        i += step
    j, m = 0, len(linker)
    while j < m:
        a = linker[j]
        nxt = linker[j + 1] if j + 1 < m else None
        if a in ("-L", "-l", "--library-path", "--library") and nxt is not None:
            (lib_dirs if a in ("-L", "--library-path") else lib_names).append(nxt)
            j += 2
            continue
        if a.startswith("--library-path="):
            lib_dirs.append(a.split("=", 1)[1])
        elif a.startswith("--library="):
            lib_names.append(a.split("=", 1)[1])
        elif a.startswith("-L") and len(a) > 2:
            lib_dirs.append(a[2:])
        elif a.startswith("-l") and len(a) > 2:
            lib_names.append(a[2:])
        elif a.startswith("@") and len(a) > 1:
            files.append(a[1:])
        else:
            name, eq, value = a.partition("=")
            if name in LINKER_FILE_OPTIONS:
                if eq:
                    files.append(value)
                elif nxt is not None:
                    files.append(nxt)
                    j += 1
            elif a.startswith("-T") and len(a) > 2:
                files.append(a[2:])
        j += 1
    return FlagScan(tuple(search), tuple(host), tuple(tools), tuple(files), tuple(lib_dirs), tuple(lib_names))
