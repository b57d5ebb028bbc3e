"""`moe-spec bench`: decoding methods side by side on the same target, head and prompts.

`methods` names the methods, `prompts` reads and builds prompt sets, `runner` runs them
interleaved in one process, `report` aggregates and prints, `command` is the CLI.
"""
