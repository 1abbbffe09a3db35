"""Benchmarks of dmattn-ops against SDPA and FlexAttention (issue 5)."""
