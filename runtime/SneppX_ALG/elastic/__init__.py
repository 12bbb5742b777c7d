"""Elastic training: who is alive (heartbeat), when to go on (fault_tolerance), what a node may do next
(lifecycle), and how the ranks of a generation find each other and compute together (store, collectives). The
public names are re-exported by `SneppX_ALG`; import the modules here by name.
"""
