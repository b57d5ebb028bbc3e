"""moe_spec against the real vLLM engine (its CPU build, in its own venv: `make vllm-env`).

One tiny float32 Qwen3-MoE target (4 layers, head_dim 32, the smallest vLLM's CPU attention takes) is
built here; an EAGLE-3 head is trained for it by `train_draft` for a few dozen steps; `moe-spec profile`
profiles the pair and `moe-spec export-vllm` exports the head with its schedule, and the lookup drafter
with moe_spec's own proposer. One script then starts each engine in turn (`engine_run.py`, a few seconds
each) and the tests compare what vLLM did with what moe_spec does:

- vLLM's greedy output equals transformers' (float32), and every speculative method's equals it;
- vLLM's accepted tokens per chain position with the exported head equal moe_spec's own chain
  drafting with that head on the same prompts (the parity that shows the head means the same there);
- the exported schedule's K for the batch size is what vLLM drafted;
- the proposer's chain lengths are what moe_spec's batch controller chooses for what it saw;
- a schedule priced by vLLM's own step times (`--engine-costs measure`) is the one its fit prices.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from moe_spec.cli.main import main
from moe_spec.drafters.eagle import EagleDrafter
from moe_spec.integrations.vllm.export import EngineMeasure
from moe_spec.integrations.vllm.proposer import MoeSpecProposer
from moe_spec.integrations.vllm.step_costs import EngineCosts, fit
from moe_spec.measure.chain_reach import chain_counts
from moe_spec.policy.batch_chains import batch_chain_lengths
from moe_spec.policy.engine_schedule import schedule, vllm_ranges
from moe_spec.profile.artifact import Profile
from moe_spec.testing.vllm_world import build_world

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
ENGINE_RUN = ROOT / "moe_spec" / "integrations" / "vllm" / "engine_run.py"
NEW_TOKENS = 24
K = 3


def _vllm_python() -> Path:
    if not VLLM_PYTHON.is_file():
        pytest.fail(f"vLLM's environment is missing ({VLLM_PYTHON}): `make vllm-env` makes it (`make test` does too)")
    return VLLM_PYTHON


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The target, head and exports on disk, and one engine run of every configuration."""
    python = _vllm_python()
    root = tmp_path_factory.mktemp("vllm")
    # the schedule priced by vLLM's own step times: one engine per K in 0..2, each timing B = 1 and 6
    world = build_world(root, python, prompts=6, max_k=K, max_batch=8, new_tokens=NEW_TOKENS, engine_max_k=2,
                        engine_batch_sizes="1,6")
    model, target, prompts = world["model"], world["target"], world["prompts"]
    prompt_file, profile = root / "prompts.jsonl", root / "profile.json"
    exported = json.loads((root / "export" / "speculative_config.json").read_text())
    job = {"model": str(root / "target"), "dtype": "float32", "prompts": [p.tolist() for p in prompts],
           "max_tokens": NEW_TOKENS, "max_model_len": 256, "runs": [
               {"name": "plain"},
               {"name": "eagle3, K fixed, alone", "batch_size": 1, "speculative_config": {
                   "method": "eagle3", "model": str(root / "export" / "head"), "num_speculative_tokens": K}},
               {"name": "eagle3, exported schedule, B = 1", "batch_size": 1, "speculative_config": exported},
               {"name": "eagle3, exported schedule, B = 6", "batch_size": 6, "speculative_config": exported},
               {"name": "ngram, exported schedule", "speculative_config": json.loads(
                   (root / "export_lookup" / "speculative_config.json").read_text())},
               {"name": "moe_spec proposer", "speculative_config": json.loads(
                   (root / "export_lookup" / "proposer_config.json").read_text())},
           ]}
    (root / "job.json").write_text(json.dumps(job))
    log = root / "proposer_log.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MOE_SPEC_PROPOSER": str(root / "export_lookup" / "proposer.json"),
           "MOE_SPEC_PROPOSER_LOG": str(log)}
    done = subprocess.run([str(python), str(ENGINE_RUN), str(root / "job.json"), str(root / "result.json")],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"vLLM run failed:\n{done.stderr[-4000:]}"
    runs = {run["name"]: run for run in json.loads((root / "result.json").read_text())["runs"]}
    return dict(root=root, model=model, target=target, prompts=prompts, runs=runs, exported=exported, log=log,
                schedule=json.loads((root / "export" / "schedule.json").read_text()), profile=profile,
                prompt_file=prompt_file)


def test_vllm_greedy_equals_transformers(world):
    for prompt, output in zip(world["prompts"], world["runs"]["plain"]["outputs"]):
        reference = world["model"].generate(prompt[None], do_sample=False, max_new_tokens=NEW_TOKENS,
                                            min_new_tokens=NEW_TOKENS, eos_token_id=[], pad_token_id=0)
        assert output == reference[0, len(prompt):].tolist()


def test_every_speculative_method_is_lossless_in_vllm(world):
    plain = world["runs"]["plain"]["outputs"]
    for name, run in world["runs"].items():
        assert run["outputs"] == plain, name
        if name != "plain":
            assert run["spec"]["num_drafts"] > 0, f"{name} never drafted"


def test_vllm_accepts_per_position_what_moe_spec_accepts_with_the_same_head(world):
    """Step by step, per request: vLLM's (drafted, accepted) with the exported head equal moe_spec's own
    chain drafting with that head. Near the end moe_spec cuts a chain to the tokens left where vLLM
    drafts all K (and counts what it accepts past max_tokens): those last steps are left out."""
    drafter = EagleDrafter.from_pretrained(world["root"] / "export" / "head", world["target"])
    ours = chain_counts(world["target"], drafter, world["prompts"], K, max_new_tokens=NEW_TOKENS)
    theirs = world["runs"]["eagle3, K fixed, alone"]["accepted_per_step"]
    compared = [0] * K
    for our_steps, their_steps in zip(ours.per_prompt, theirs):
        full = [list(step) for step in our_steps if step[0] == K]
        assert our_steps[:len(full)] == tuple(map(tuple, full)), "a cut chain before the end"
        assert their_steps[:len(full)] == full
        assert len(their_steps) - len(full) <= K  # vLLM's full-length steps where moe_spec's were cut
        for _, accepted in full:
            for position in range(accepted):
                compared[position] += 1
    assert compared[0] > 0 and compared[1] > 0, "too few drafts accepted to compare anything"
    assert sum(len(s) for s in theirs) == world["runs"]["eagle3, K fixed, alone"]["spec"]["num_drafts"]


def _scheduled_k(exported: dict, batch: int) -> int:
    return next(k for start, end, k in exported["num_speculative_tokens_per_batch_size"] if start <= batch <= end)


@pytest.mark.parametrize("batch", [1, 6])
def test_vllm_drafts_the_exported_schedules_k(world, batch):
    run = world["runs"][f"eagle3, exported schedule, B = {batch}"]
    k = _scheduled_k(world["exported"], batch)
    spec = run["spec"]
    if k == 0:
        assert spec.get("num_draft_tokens", 0) == 0
    else:
        assert spec["num_draft_tokens"] == k * spec["num_drafts"]


def test_the_proposers_lengths_are_the_batch_controllers(world):
    """Every step's lengths are `batch_chain_lengths` of what the proposer saw (its chains' reach and each
    layer's expert share read from the gates), and vLLM verified exactly those drafts."""
    proposer = MoeSpecProposer(config=json.loads((world["root"] / "export_lookup" / "proposer.json").read_text()))
    steps = [json.loads(line) for line in world["log"].read_text().splitlines()]
    assert len(steps) >= NEW_TOKENS // (K + 1)
    for step in steps:
        cost = replace(proposer.cost, new_expert_share=np.array(step["share"]))
        assert step["lengths"] == batch_chain_lengths(step["reach"], cost)
    assert len({tuple(step["share"]) for step in steps}) > 1, "the gates' routing never reached the controller"
    verified = world["runs"]["moe_spec proposer"]["spec"]["num_draft_tokens"]
    assert 0 < verified <= sum(sum(s["lengths"]) for s in steps)  # vLLM trims drafts past max_tokens, never adds


def test_the_schedule_can_be_priced_by_vllms_own_step_costs(world, tmp_path):
    """`--engine-costs measure` timed every K at every batch size in the engine, fitted the step price
    to it (non-negative least squares), and chose each batch size's K under that price; the file it
    wrote prices a later export the same way without starting vLLM."""
    out = world["root"] / "export_engine"
    costs = EngineCosts.from_dict(json.loads((out / "engine_costs.json").read_text()))
    report = json.loads((out / "schedule.json").read_text())
    assert report["priced_by"] == "vllm step costs"
    measured = {(s.rows, s.length): s for s in costs.samples}
    assert set(measured) == {(rows, k) for rows in (1, 6) for k in (0, 1, 2)}
    for rows in (1, 6):  # unspeculated, every pass takes one step a token; speculating, no more
        assert measured[rows, 0].steps == (6 // rows) * EngineMeasure.max_tokens
        assert all(measured[rows, k].steps <= measured[rows, 0].steps for k in (1, 2))
    assert all(measured[1, k].steps < measured[1, 0].steps for k in (1, 2)), "no draft accepted in 6 requests"
    profile = Profile.load(world["profile"], world["target"])
    assert fit(profile, costs.samples).coefficients == pytest.approx(costs.coefficients)
    reach = report["chain_acceptance"]["reach"]
    expected = vllm_ranges(schedule(profile, reach, 8, costs.step_cost(profile)))
    config = json.loads((out / "speculative_config.json").read_text())
    assert config["num_speculative_tokens_per_batch_size"] == expected
    again = tmp_path / "again"
    assert main(["export-vllm", "--model", str(world["root"] / "target"), "--drafter", str(world["root"] / "head"),
                 "--profile", str(world["profile"]), "--prompts", str(world["prompt_file"]), "--out", str(again),
                 "--max-k", "2", "--max-batch", "8", "--max-new-tokens", str(NEW_TOKENS),
                 "--engine-costs", str(out / "engine_costs.json")]) == 0
    assert json.loads((again / "speculative_config.json").read_text())["num_speculative_tokens_per_batch_size"] == expected
