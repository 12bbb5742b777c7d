"""Elastic training: node agents that agree on membership generations through the shared store (rendezvous),
who is alive (heartbeat, wire), when to go on (fault_tolerance) and what a node may do next (lifecycle), with no
single point of failure (protocols in docs/ELASTIC.md); the ranks of a generation compute together over
`SneppX_ALG.collectives`, a package of its own below this one. On top, the ElasticTrainer (trainer) starts a node agent per node (agent), which
runs the node's worker processes (worker) over a control channel (control). The public names are re-exported by `SneppX_ALG`; import the modules here by name.
"""
