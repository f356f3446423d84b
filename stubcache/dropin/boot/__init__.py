"""The start-up hook of ``stubcache run`` (its ``sitecustomize.py``); nothing here is imported."""
