"""Elastic training: node agents that agree on membership generations through the shared store (rendezvous),
who is alive (heartbeat, wire), when to go on (fault_tolerance), what a node may do next (lifecycle), and how the
ranks of a generation find each other and compute together (store, collectives), with no single point of failure
(protocols in docs/ELASTIC.md). On top, the ElasticTrainer (trainer) starts a node agent per node (agent), which
runs the node's worker processes (worker) over a control channel (control). The public names are re-exported by `SneppX_ALG`; import the modules here by name.
"""
