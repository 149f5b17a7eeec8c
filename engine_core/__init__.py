"""The scheduler side of the engine: requests, queues, KV-cache accounting and the Scheduler.

Pure Python: nothing here imports torch (the engine core process must start fast and small).
"""
