"""What admin commands run: the scans, plans and reports behind ``stubcache`` CLI commands
(``stubcache.cli`` parses and prints)."""
