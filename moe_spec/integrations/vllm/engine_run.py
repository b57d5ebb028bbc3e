"""Run vLLM offline on token-id prompts and report outputs, speculation metrics and times as JSON.

Runs *inside vLLM's own environment* (`make vllm-env` makes `.venv-vllm`; moe_spec is importable there
through `PYTHONPATH`), which is why it imports nothing from moe_spec:

    .venv-vllm/bin/python moe_spec/integrations/vllm/engine_run.py JOB.json RESULT.json

JOB.json: {"model": folder, "dtype": "float32", "prompts": [[ids], ...], "max_tokens": N,
           "max_model_len": 512, "runs": [{"name": ..., "speculative_config": {...} or null,
           "batch_size": B (requests submitted together; default all), "repeats": R}, ...]}
(a run may give "batch_sizes": [B, ...] instead: one engine decodes at each, one result per size)

Each run starts one engine (`LLM`, in a process of its own, the engine core inside it:
`VLLM_ENABLE_V1_MULTIPROCESSING=0` starts in a few seconds), decodes every prompt greedily for exactly `max_tokens` tokens (EOS ignored) in batches of
`batch_size`, and records per prompt the new token ids, and for the run the spec-decode counters vLLM
keeps (`vllm:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens`,
`..._num_accepted_tokens_per_pos`), the wall time of each repeat and the engine steps a pass took. Environment the engine needs on a
CPU: HF_HUB_OFFLINE=1, VLLM_CPU_KVCACHE_SPACE, VLLM_CPU_OMP_THREADS_BIND=nobind (set here if absent).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def _environment() -> None:
    for key, value in (("HF_HUB_OFFLINE", "1"), ("VLLM_CPU_KVCACHE_SPACE", "1"),
                       ("VLLM_CPU_OMP_THREADS_BIND", "nobind"), ("VLLM_ENABLE_V1_MULTIPROCESSING", "0")):
        os.environ.setdefault(key, value)


def _counters(llm) -> dict:
    found = {}
    for metric in llm.get_metrics():
        if metric.name in SPEC_COUNTERS:
            found[metric.name.removeprefix("vllm:spec_decode_")] = int(metric.value)
        elif metric.name == PER_POSITION:
            found["num_accepted_tokens_per_pos"] = [int(v) for v in metric.values]
    return found


def _difference(after: dict, before: dict) -> dict:
    out = {}
    for key, value in after.items():
        if isinstance(value, list):
            old = before.get(key) or [0] * len(value)
            out[key] = [a - b for a, b in zip(value, old)]
        else:
            out[key] = value - before.get(key, 0)
    return out


def _accepted_per_step(completion) -> list[list[int]] | None:
    """[[drafted, accepted] per step that drafted] of one request (vLLM's detailed per-request metrics)."""
    metrics = getattr(completion, "spec_decode_metrics", None)
    if metrics is None:
        return None
    return [[int(d), int(a)] for d, a in zip(metrics.per_step_drafted, metrics.per_step_accepted)]


def _decode(llm, prompts, params, batch: int, repeats: int):
    """Every prompt decoded in batches of `batch`, `repeats` times: the last repeat's outputs and
    per-step acceptances, each repeat's wall seconds, and the engine steps one pass took (per batch,
    its longest request's: a prefill step and one step per verification, or one per token unspeculated)."""
    seconds = []
    for _ in range(repeats):
        outputs, steps, engine_steps = [], [], 0
        tick = time.perf_counter()
        for first in range(0, len(prompts), batch):
            done = llm.generate(prompts[first: first + batch], params, use_tqdm=False)
            outputs.extend(list(o.outputs[0].token_ids) for o in done)
            accepted = [_accepted_per_step(o.outputs[0]) for o in done]
            steps.extend(accepted)
            engine_steps += max(1 + len(a) if a is not None else len(o.outputs[0].token_ids)
                                for a, o in zip(accepted, done))
        seconds.append(time.perf_counter() - tick)
    return outputs, steps, seconds, engine_steps


def run_job(job: dict) -> dict:
    _environment()
    from vllm import LLM, SamplingParams, TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in job["prompts"]]
    params = SamplingParams(temperature=0.0, max_tokens=int(job["max_tokens"]), ignore_eos=True, detokenize=False)
    results = []
    for run in job["runs"]:
        started = time.perf_counter()
        kwargs = dict(model=job["model"], dtype=job.get("dtype", "float32"), skip_tokenizer_init=True,
                      max_model_len=int(job.get("max_model_len", 512)), enforce_eager=True, seed=0,
                      disable_log_stats=False, max_num_seqs=int(job.get("max_num_seqs", 256)))
        if run.get("speculative_config"):
            kwargs.update(speculative_config=run["speculative_config"], per_request_spec_decode_metrics="detailed")
        llm = LLM(**kwargs)
        start_s = time.perf_counter() - started
        before = _counters(llm)
        sizes = run.get("batch_sizes") or [run.get("batch_size") or len(prompts)]
        for size in sizes:  # several batch sizes share one engine (each a result of its own)
            batch = int(size)
            outputs, steps, seconds, engine_steps = _decode(llm, prompts, params, batch, int(run.get("repeats", 1)))
            after = _counters(llm)
            name = run["name"] if "batch_sizes" not in run else f"{run['name']}, B = {batch}"
            results.append({"name": name, "outputs": outputs, "accepted_per_step": steps, "seconds": seconds,
                            "engine_steps": engine_steps, "engine_start_s": start_s, "batch_size": batch,
                            "spec": _difference(after, before), "speculative_config": run.get("speculative_config")})
            before = after
    return {"runs": results}


def launch(job: dict, python: str, pythonpath: str, env: dict | None = None, timeout: float | None = None) -> dict:
    """Run `job` from moe_spec's side: this script under vLLM's environment's `python`, moe_spec
    importable through `pythonpath`, `env` added to the environment; returns the result document.
    Raises RuntimeError with the end of vLLM's stderr when a run fails."""
    with tempfile.TemporaryDirectory() as work:
        job_file, result_file = os.path.join(work, "job.json"), os.path.join(work, "result.json")
        with open(job_file, "w") as file:
            json.dump(job, file)
        done = subprocess.run([python, os.path.abspath(__file__), job_file, result_file],
                              env={**os.environ, "PYTHONPATH": pythonpath, **(env or {})},
                              capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"vLLM failed to run (exit {done.returncode}): {done.stderr[-4000:]}")
        with open(result_file) as file:
            return json.load(file)


def main(argv: list[str]) -> int:
    """JOB.json RESULT.json: every run, each in a process of its own (an engine started after others in
    one process can fail to register vLLM's CPU kernels, and a proposer's imports stay out of the next
    run); `--run I JOB.json RESULT.json` runs run I in this process."""
    single = None
    if len(argv) == 4 and argv[0] == "--run":
        single, argv = int(argv[1]), argv[2:]
    if len(argv) != 2:
        print("usage: python engine_run.py [--run I] JOB.json RESULT.json", file=sys.stderr)
        return 2
    with open(argv[0]) as file:
        job = json.load(file)
    if single is not None:
        result = run_job({**job, "runs": [job["runs"][single]]})
    else:
        runs = []
        for index in range(len(job["runs"])):
            part = f"{argv[1]}.{index}"
            done = subprocess.run([sys.executable, __file__, "--run", str(index), argv[0], part])
            if done.returncode != 0:
                print(f"engine_run: run {index} ({job['runs'][index]['name']}) failed", file=sys.stderr)
                return done.returncode
            with open(part) as file:
                runs.extend(json.load(file)["runs"])
            os.remove(part)
        result = {"runs": runs}
    with open(argv[1], "w") as file:
        json.dump(result, file)
    return 0


if __name__ == "__main__":  # vLLM spawns processes: the engine must start under this guard
    sys.exit(main(sys.argv[1:]))
