"""Helpers shared by several test modules, one module per topic (no test module imports another)."""
