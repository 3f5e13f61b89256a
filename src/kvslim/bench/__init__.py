"""Benchmark harness behind ``kvslim bench`` (measurements, not tests)."""
