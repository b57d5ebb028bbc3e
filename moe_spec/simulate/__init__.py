"""`moe-spec simulate`: what each policy would gain on other hardware, replayed from recorded steps.

`trace` records EAGLE-2 steps during `moe-spec bench --trace` (every candidate node's target argmax
and routing, the measured times); `replay` re-chooses each step's verified subtree with each policy
under another cost model and prices it; `analytic_cost` builds cost models from model shapes and a
device's bandwidth; `command` is the CLI. Everything it prints or writes is labelled SIMULATION.
"""
