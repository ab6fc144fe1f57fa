"""Benchmarks: prompt sets and side-by-side measurement of decoding methods."""
