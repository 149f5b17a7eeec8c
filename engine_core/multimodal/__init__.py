"""Images on the engine core's side: the encoder-output cache's account (encoder_cache.py) and
the encoder budget in the scheduler's passes (scheduling.py)."""
