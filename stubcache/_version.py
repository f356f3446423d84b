"""The package version, in one place: ``pyproject.toml`` reads it (setuptools ``attr:``, parsed
without importing), ``stubcache.__version__`` re-exports it and manifests record it."""

__version__ = "0.1.0"
