"""Every environment variable SneppX sets or reads, each named once: the operator's pods, the launcher's agents and
workers, and the settings a user may give.

Who sets each: the operator, in every rank's first container (operator/sneppx_operator/builders.rank_env); the
ElasticTrainer for the agents it starts, an agent for its workers; or the user.
"""

from __future__ import annotations

# ---- set by the operator in every rank pod (read by the agent in operator mode, and by the training script) ----
ENV_NAMESPACE = "SNEPPX_NAMESPACE"
ENV_OBJECT = "SNEPPX_RENDEZVOUS_OBJECT"  # the job's rendezvous ConfigMap; set means "operator mode"
ENV_HANG_TIMEOUT = "SNEPPX_HANG_TIMEOUT_SECONDS"
ENV_MIN_NODES = "SNEPPX_MIN_NODES"
ENV_MAX_NODES = "SNEPPX_MAX_NODES"
ENV_RENDEZVOUS_TIMEOUT = "SNEPPX_RENDEZVOUS_TIMEOUT_SECONDS"  # elastic.rendezvousTimeoutSeconds: join_timeout
ENV_LAST_CALL = "SNEPPX_LAST_CALL_SECONDS"  # elastic.joinTimeoutSeconds: the rendezvous' last_call
ENV_POD_NAME = "SNEPPX_POD_NAME"  # the agent's id in the rendezvous and in job/hung/<pod>
ENV_NODE_NAME = "SNEPPX_NODE_NAME"  # the Kubernetes node (downward API): a snapshot's copies go to other nodes
ENV_PROCS_PER_NODE = "SNEPPX_PROCS_PER_NODE"  # workers per pod
ENV_CHECKPOINT_URI = "SNEPPX_CHECKPOINT_URI"
ENV_SAVE_EVERY = "SNEPPX_SAVE_EVERY_N_STEPS"
ENV_MAX_TO_KEEP = "SNEPPX_MAX_TO_KEEP"
ENV_VALIDATION = "SNEPPX_CHECKPOINT_VALIDATION"
ENV_SNAPSHOT_EVERY = "SNEPPX_SNAPSHOT_EVERY_N_STEPS"  # peer-memory snapshots (0: off)
ENV_SNAPSHOT_REPLICAS = "SNEPPX_SNAPSHOT_REPLICAS"

# ---- set by the operator, or by whoever starts a process outside it -------------------------------------------
ENV_JOB = "SNEPPX_JOB"  # the job's name: the agents' run id, and the job id in each heartbeat datagram
ENV_HOST = "SNEPPX_HOST"  # where this node's agent and workers listen (a pod's IP, from the downward API)
ENV_GENERATION = "SNEPPX_GENERATION"  # the membership generation a process starts in
ENV_ROLLBACK_DEPTH = "SNEPPX_ROLLBACK_DEPTH"  # how many older steps a restore may fall back over
ENV_HEARTBEAT_KEY_FILE = "SNEPPX_HEARTBEAT_KEY_FILE"  # the job's key, raw bytes in a file (the mounted Secret)
ENV_HEARTBEAT_KEY = "SNEPPX_HEARTBEAT_KEY"  # the job's key in hex, when no file is given
ENV_HEARTBEAT_BIND = "SNEPPX_HEARTBEAT_BIND"

# ---- set by the ElasticTrainer for its agents, and by an agent for its workers ----------------------------------
ENV_ROLE = "SNEPPX_ELASTIC_ROLE"  # "agent" or "worker"; unset in the process the user starts
ENV_RUN_ID = "SNEPPX_RUN_ID"
ENV_AGENT_ID = "SNEPPX_AGENT_ID"
ENV_EVENTS = "SNEPPX_EVENTS_FILE"
ENV_RESULT = "SNEPPX_RESULT_FILE"
ENV_LAUNCHER_PID = "SNEPPX_LAUNCHER_PID"  # an agent stops when this process (its launcher) is gone
ENV_CONTROL_FD = "SNEPPX_CONTROL_FD"  # a worker's end of its control channel to the agent
ENV_LOCAL_RANK = "SNEPPX_LOCAL_RANK"

# ---- settings a user may give --------------------------------------------------------------------------------------
ENV_HOST_KEY = "SNEPPX_HOST_KEY"  # ranks with the same value (and boot, /dev/shm, PID namespace) share memory
ENV_WRITE_MODE = "SNEPPX_WRITE_MODE"  # direct | buffered | auto
ENV_KEY_PASSWORD = "SNEPPX_KEY_PASSWORD"  # the password of an encrypted signing key (sneppx sign)
ENV_CUDART = "SNEPPX_CUDART"  # a CUDA runtime library to load instead of the one found
ENV_NCCL = "SNEPPX_NCCL"  # an NCCL library to load instead of the one found
ENV_RESYNC_SECONDS = "SNEPPX_RESYNC_SECONDS"  # the operator's periodic re-reconcile of every job
