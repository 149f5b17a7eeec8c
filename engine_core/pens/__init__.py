"""Holding pens: where the engine core keeps a request that must wait for something outside the
scheduler (every rank's compiled grammar, every rank's copy of an adapter, a peer engine's lease
messages) before it may be scheduled. They share one interface (base.py), so the core's loop,
idle wait, abort, counts, census and shutdown go over a list of pens and name no feature; which
pens are in the list is decided once at start-up (setup.py)."""
