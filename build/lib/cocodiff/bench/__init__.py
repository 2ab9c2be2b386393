"""Benchmarks: commands that print one table and write their figures as JSON."""
