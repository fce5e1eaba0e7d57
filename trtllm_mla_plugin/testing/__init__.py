"""Helpers for tests, the demo and examples (need ``transformers``; never used by the
backend itself)."""
