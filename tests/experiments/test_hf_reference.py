"""transformers' own decoding as bench reference methods: identical greedy output, counted mismatches,
speedups against `hf-greedy`, sampling settings passed through."""

from __future__ import annotations

import json

import pytest
import torch

from moe_spec.cli.main import main
from moe_spec.core.engine import SpecDecoder
from moe_spec.core.stats import GenerationStats
from moe_spec.core.target import TargetModel
from moe_spec.errors import InputError
from moe_spec.experiments.hf_reference import REFERENCES
from moe_spec.experiments.report import compare
from moe_spec.experiments.runner import Run, left_pad
from moe_spec.policy.registry import parse_methods
from moe_spec.testing.helpers import PLAIN_PROMPT, REPETITIVE_PROMPT, hf_greedy
from moe_spec.testing.tiny_models import tiny_model

METHODS = ["ar", "hf-greedy", "static:4", "hf-prompt-lookup"]


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3_moe")


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """A greedy bench of two moe_spec methods and both references: the report and the final JSON line."""
    folder = tmp_path_factory.mktemp("bench_hf")
    tiny_model("deepseek_v3").save_pretrained(folder / "model")
    prompts = folder / "prompts.jsonl"
    rows = [{"class": "copy", "prompt_ids": REPETITIVE_PROMPT}, {"class": "plain", "prompt_ids": PLAIN_PROMPT}]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = folder / "out.json"
    return folder, prompts, out


def _run_bench(bench, capsys, *extra: str) -> tuple[dict, dict]:
    folder, prompts, out = bench
    argv = ["bench", "--model", str(folder / "model"), "--drafter", "lookup", "--prompts", str(prompts),
            "--methods", ",".join(METHODS), "--max-new-tokens", "12", "--warmup-tokens", "2", "--no-progress",
            "--json", str(out), *extra]
    capsys.readouterr()
    assert main(argv) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    return json.loads(out.read_text()), line


def test_references_run_interleaved_and_decode_exactly_like_ours_at_greedy(bench, capsys):
    report, line = _run_bench(bench, capsys, "--repeats", "2")
    assert list(report["methods"]) == METHODS
    for table in [report["methods"], *report["per_class"].values()]:
        assert table["hf-greedy"]["speedup_vs_hf_greedy"] == 1.0
        assert all(isinstance(f["speedup_vs_hf_greedy"], float) for f in table.values())
        assert all(f["mismatches"] == 0 for f in table.values()), table
    for prompt in report["per_prompt"]:
        outputs = {m: prompt["methods"][m]["new_ids"] for m in METHODS}
        assert len(set(map(tuple, outputs.values()))) == 1 and outputs["ar"], outputs
    # every figure is over both passes: references were timed like the others
    assert report["methods"]["hf-greedy"]["repeats"] == 2 and report["methods"]["hf-greedy"]["new_tokens"] > 0
    # the final JSON line carries the second ratio, overall and per class
    assert line["methods"]["ar"]["speedup_vs_hf_greedy"] == report["methods"]["ar"]["speedup_vs_hf_greedy"]
    assert set(line["per_class_speedup_vs_hf_greedy"]) == {"copy", "plain"}


def test_references_have_no_step_statistics_but_ours_keep_theirs(bench, capsys):
    report, _ = _run_bench(bench, capsys)
    for name in REFERENCES:
        figures = report["methods"][name]
        # timed like ours: its ratio to ar is the ratio of the two rates the report gives
        assert figures["speedup_vs_ar"] == pytest.approx(
            figures["tokens_per_s"] / report["methods"]["ar"]["tokens_per_s"], rel=1e-3)
        assert figures["mean_accept_len"] is None and figures["verify_ms"] is None and figures["steps"] is None
    assert report["methods"]["ar"]["mean_accept_len"] == 1.0 and report["methods"]["ar"]["steps"] > 0


def test_a_differing_output_is_counted_against_hf_greedy_not_raised():
    def run(method: str, ids: tuple[int, ...], repeat: int = 0) -> Run:
        stats = GenerationStats(new_tokens=len(ids), total_ms=10.0, new_tokens_per_row=[len(ids)])
        return Run((0,), method, stats, (ids,), repeat)

    runs = [run("hf-greedy", (1, 2, 3)), run("ar", (1, 2, 3)), run("static:4", (1, 2, 4)),
            run("hf-greedy", (1, 2, 3), 1), run("ar", (1, 2, 3), 1), run("static:4", (1, 2, 3), 1)]
    table = compare(runs, ["hf-greedy", "ar", "static:4"])
    assert {m: f["mismatches"] for m, f in table.items()} == {"hf-greedy": 0, "ar": 0, "static:4": 1}
    # without hf-greedy the reference is ar; when sampling nothing is counted
    assert compare([r for r in runs if r.method != "hf-greedy"], ["ar", "static:4"])["static:4"]["mismatches"] == 1
    sampled = [Run(r.prompt_indices, r.method, r.stats, r.new_ids, r.repeat, greedy=False) for r in runs]
    assert compare(sampled, ["hf-greedy", "ar", "static:4"])["static:4"]["mismatches"] is None


def test_hf_greedy_on_a_left_padded_batch_equals_spec_decoder(model):
    target = TargetModel(model)
    ids, mask = left_pad([torch.tensor([PLAIN_PROMPT]), torch.tensor([REPETITIVE_PROMPT])], pad=0)
    ours = SpecDecoder(target).generate(ids, attention_mask=mask, max_new_tokens=10)
    theirs = REFERENCES["hf-greedy"].decoder(target).generate(ids, attention_mask=mask, max_new_tokens=10)
    assert torch.equal(theirs.sequences, ours.sequences)
    assert theirs.stats.new_tokens_per_row == ours.stats.new_tokens_per_row
    alone = hf_greedy(model, PLAIN_PROMPT, 10)
    assert theirs.sequences[0, ids.shape[1]:].tolist() == alone[0, len(PLAIN_PROMPT):].tolist()


def test_sampled_reference_passes_the_sampling_settings_and_is_seeded_by_the_generator(model):
    decoder = REFERENCES["hf-greedy"].decoder(TargetModel(model))
    ids = torch.tensor([PLAIN_PROMPT])

    def sampled(seed: int, **settings):
        return decoder.generate(ids, max_new_tokens=12, generator=torch.Generator().manual_seed(seed),
                                **settings).sequences

    state = torch.get_rng_state()
    assert torch.equal(sampled(1, temperature=1.0), sampled(1, temperature=1.0))
    assert torch.equal(torch.get_rng_state(), state), "the global RNG is restored"
    draws = {tuple(sampled(seed, temperature=2.0)[0].tolist()) for seed in range(4)}
    assert len(draws) > 1, "temperature 2 on a random model should not be deterministic"
    greedy = decoder.generate(ids, max_new_tokens=12).sequences
    assert all(torch.equal(sampled(seed, temperature=2.0, top_k=1), greedy) for seed in range(3)), "top_k reaches generate"


def test_prompt_lookup_reference_refuses_a_batch_and_bench_names_the_references(model):
    ids, mask = left_pad([torch.tensor([PLAIN_PROMPT]), torch.tensor([REPETITIVE_PROMPT])], pad=0)
    with pytest.raises(InputError, match="batch size 1"):
        REFERENCES["hf-prompt-lookup"].decoder(TargetModel(model)).generate(ids, attention_mask=mask)
    assert parse_methods("ar,hf-greedy", references=REFERENCES) == ["ar", "hf-greedy"]
    with pytest.raises(InputError, match="unknown method 'hf-greedy'"):
        parse_methods("ar,hf-greedy")  # only a caller that runs references accepts them
    with pytest.raises(InputError, match="more than once"):
        parse_methods("hf-greedy,hf-greedy", references=REFERENCES)
