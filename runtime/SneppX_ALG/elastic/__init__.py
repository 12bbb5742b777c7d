"""Elastic training: the pieces that let a job's ranks find each other, compute together, notice failures and
re-form at another size. Each concept is its own module (collectives and their store so far); import the
module you need, e.g. `from SneppX_ALG.elastic import collectives`.
"""
