"""Loggers under vLLM's ``vllm`` logger, so plugin messages appear in the engine's log with
vLLM's format and level (vLLM configures only its own logger tree)."""

from __future__ import annotations

import logging


def get_logger(name: str) -> logging.Logger:
    """Logger ``vllm.plugins.<name>``; uses vLLM's ``init_logger`` when vLLM is present."""
    full = f"vllm.plugins.{name}"
    try:
        from vllm.logger import init_logger
    except ImportError:
        return logging.getLogger(full)
    return init_logger(full)
