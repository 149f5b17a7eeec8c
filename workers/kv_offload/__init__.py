"""A rank's side of the tiered KV cache: the host pool and the disk store, and the copies
between them and the device cache."""
