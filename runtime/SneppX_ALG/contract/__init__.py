"""What the operator, the launcher, the agents and the workers agree on across a process boundary. Pure: names and
values only, importing nothing of the runtime, so each side imports it without the rest."""
