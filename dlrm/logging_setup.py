"""One loguru format for every command-line entry point (train.py, preprocess, synthetic, merge)."""

from __future__ import annotations

import sys

from loguru import logger


def configure_logging(level: str = "INFO") -> None:
    """Send loguru's records to stderr as `HH:MM:SS LEVEL message`, replacing its default sink."""
    logger.remove()
    logger.add(sys.stderr, level=level, format="<green>{time:HH:mm:ss}</green> <level>{level: <7}</level> {message}")
