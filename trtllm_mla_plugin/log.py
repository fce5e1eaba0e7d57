"""Logger names under vLLM's ``vllm`` logger tree, so plugin messages reach the engine's log
with vLLM's handler, format and level (vLLM configures only its own tree). Importing this
imports nothing from vLLM: the ops layer must run where vLLM is absent."""

from __future__ import annotations

import logging


def logger_name(module: str) -> str:
    """``vllm.plugins.<module>``."""
    return f"vllm.plugins.{module}"


def get_logger(module: str) -> logging.Logger:
    """A plain logger in vLLM's tree (the vLLM glue uses ``vllm.logger.init_logger`` with
    ``logger_name`` for vLLM's ``*_once`` methods)."""
    return logging.getLogger(logger_name(module))
