"""Lazy access to the ``stubcache`` logger: ``logging`` costs milliseconds to import, and the hit
path logs nothing, so it is imported only when something is logged."""

from __future__ import annotations


def logger():
    import logging

    return logging.getLogger("stubcache")


def warning(msg: str, *args: object) -> None:
    from .progress import clear_lines

    clear_lines()  # a status line on the terminal would run into the message
    logger().warning(msg, *args)


def info(msg: str, *args: object) -> None:
    logger().info(msg, *args)
