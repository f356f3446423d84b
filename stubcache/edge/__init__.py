"""The OS edge: every filesystem call under a root, paths as the kernel reads them, logging, the
status line, settings, errors, numbers read from files. Imports nothing else of stubcache."""
