"""The on-disk layout: entries, manifests, trust, locks and atomic writes, mapped-library checks,
per-process event files."""
