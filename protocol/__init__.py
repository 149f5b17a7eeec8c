"""Messages, codec and ZeroMQ transport shared by the frontend, engine core and workers.

Nothing here imports torch: the engine core and the frontend depend on this package only.
"""
