"""Speculative decoding's scheduler side: n-gram draft proposals."""
