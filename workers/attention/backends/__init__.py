"""Attention backends, one per file; workers/attention/__init__.py imports only the chosen one."""
