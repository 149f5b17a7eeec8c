"""Small shared test helpers (tiny HF checkpoints, attention metadata builders)."""
