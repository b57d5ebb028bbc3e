"""Profiling a target on this machine: routing statistics, expert prediction, acceptance
calibration, verify latency, and the `moe-spec profile` command that assembles a `Profile`."""
