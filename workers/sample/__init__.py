"""Turning logits into tokens: the sampler, and verification of speculative drafts."""
