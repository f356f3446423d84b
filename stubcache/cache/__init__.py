"""``get_or_build`` as named steps (``core.CacheCore``), and the miss hint."""
