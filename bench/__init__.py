"""Reproducible benchmarks: side-by-side ratios, JSON and PNG output."""
