"""SneppX benchmarks: one module per area, each printing side-by-side ratios measured in the same run."""
