"""The unified token-budget scheduler: planning a step, its wire diff, applying results, the
waiting queues, invariants and the per-step trace with its replay."""
