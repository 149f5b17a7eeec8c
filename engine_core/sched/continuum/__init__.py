"""The continuum scheduling policy: a finished agent turn's KV stays pinned across the tool
call that follows it (TTL learned from observed gaps), and waiting requests are ordered by
their job's first arrival (program-level FCFS)."""
