"""Kernels written for this plugin (imported lazily by the routes that launch them)."""
