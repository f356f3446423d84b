"""What a warm hit runs: the fronts of ``StubCache.load`` and ``stubcache.load_inline`` and the
compact hit path. Imports only the OS edge (and, on a miss, hands the call to the full path)."""
