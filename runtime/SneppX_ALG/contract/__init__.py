"""What the operator, the launcher, the agents and the workers agree on across a process boundary. Pure: names,
values and codecs only (no I/O), importing nothing of the runtime but its errors, so each side imports it without
the rest.

    env.py          every SNEPPX_* environment variable the operator sets and the pods read
    backoff.py      the restart delay both the operator and the in-pod fault tolerance use
    record.py       compare-and-swap records: the RecordStore Protocol, key rules and the JSON value codec
    job_object.py   the job's rendezvous ConfigMap: its name, layout and the records operator and agents exchange
"""
