"""LoRA adapters on the engine core's side: the adapter registry (registry.py: content hashes,
PrepareLoRA, requests held until every rank has the adapter) and the device slots the scheduler
owns (slots.py: LRU over slots no running request uses, the per-step adapter budget)."""
