"""Elastic training: node agents that agree on membership generations through the shared store, detect
failures, and re-form the job without a single point of failure (protocols in docs/ELASTIC.md)."""
