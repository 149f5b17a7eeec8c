"""Structured outputs on the engine core's side: the gate that holds a constrained request until
every rank compiled its grammar and decides which compiled grammars the ranks keep, and its
holding pen."""
