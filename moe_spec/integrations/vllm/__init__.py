"""moe_spec in vLLM: the export of a head and an MoE-aware speculation schedule (`export`), and a
proposer for vLLM's `custom_class` method (`proposer`). vLLM itself runs in its own environment
(`make vllm-env`); nothing here imports it."""
