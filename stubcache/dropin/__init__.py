"""torch's ``load_inline``/``load`` on top of the cache, the library placed in a caller's
``build_directory``, ``patch_torch()`` and the start-up hook of ``stubcache run``."""
