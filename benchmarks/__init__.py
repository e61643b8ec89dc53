"""Benchmarks of st_cached_losses against stock sentence-transformers (CSV + PNG under results/)."""
