"""Upstream designs that ``sparse-mla bench`` times beside ours (not library code)."""
