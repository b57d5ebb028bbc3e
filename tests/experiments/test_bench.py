"""`moe-spec bench` end to end on a tiny random MoE; the method registry; the prompt sets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_spec.core.drafting import EAGLE2_BUDGET
from moe_spec.policy.registry import METHODS, STATIC_GRID, build_controller, expand_methods, parse_methods
from moe_spec.experiments.prompt_sets import CLASSES, MAX_TOKENS, MIN_TOKENS, build_prompt_sets
from moe_spec.experiments.prompt_file import load_prompts
from moe_spec.experiments.runner import method_order
from moe_spec.cli.main import main
from moe_spec.errors import InputError
from moe_spec.testing.tiny_models import tiny_model

from moe_spec.testing.helpers import PLAIN_PROMPT, REPETITIVE_PROMPT

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "bench"
KEYS = {"tokens_per_s", "speedup_vs_ar", "mean_accept_len", "verify_ms", "draft_ms", "unique_experts_per_layer",
        "expert_loads_per_token"}
METHOD_NAMES = ["ar", "eagle2", "static:4"]


@pytest.fixture(scope="module")
def bench_report(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench")
    tiny_model("deepseek_v3").save_pretrained(folder / "model")
    prompts = folder / "prompts.jsonl"
    lines = [
        {"class": "copy", "prompt_ids": REPETITIVE_PROMPT},
        {"class": "plain", "prompt_ids": PLAIN_PROMPT},
        {"class": "copy", "prompt_ids": [40, 41, 42, 43] * 4 + [40]},
    ]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = folder / "out.json"
    argv = ["bench", "--model", str(folder / "model"), "--drafter", "lookup", "--prompts", str(prompts),
            "--methods", ",".join(METHOD_NAMES), "--max-new-tokens", "12", "--warmup-tokens", "2",
            "--no-progress", "--json", str(out)]
    assert main(argv) == 0
    return json.loads(out.read_text())


def test_report_has_every_figure_per_method_and_per_class(bench_report):
    assert list(bench_report["methods"]) == METHOD_NAMES
    for figures in bench_report["methods"].values():
        assert KEYS <= set(figures)
    assert set(bench_report["per_class"]) == {"copy", "plain"}
    for table in bench_report["per_class"].values():
        assert list(table) == METHOD_NAMES and all(KEYS <= set(f) for f in table.values())
    config = bench_report["config"]
    for key in ("model", "drafter", "methods", "prompts_file", "max_new_tokens", "temperature", "seed", "threads",
                "versions", "machine"):
        assert key in config
    assert config["versions"]["torch"] and config["versions"]["transformers"]


def test_ar_is_the_unit_of_speed_and_accepts_one_token_per_step(bench_report):
    for table in [bench_report["methods"], *bench_report["per_class"].values()]:
        assert table["ar"]["speedup_vs_ar"] == 1.0
        assert table["ar"]["mean_accept_len"] == 1.0
        assert table["ar"]["expert_loads_per_token"] > 0
        assert all(isinstance(f["speedup_vs_ar"], float) for f in table.values()), "every method gets a ratio to ar"


def test_every_method_decodes_exactly_like_ar_under_greedy(bench_report):
    assert len(bench_report["per_prompt"]) == 3
    for prompt in bench_report["per_prompt"]:
        reference = prompt["methods"]["ar"]["new_ids"]
        assert len(reference) == prompt["methods"]["ar"]["new_tokens"] > 0
        for name in METHOD_NAMES:
            assert prompt["methods"][name]["new_ids"] == reference, (prompt["index"], name)


def test_a_report_without_offload_has_no_read_columns_and_zero_reads(bench_report):
    from moe_spec.experiments.report import format_report, summary_line

    assert "offload" not in bench_report["config"]
    assert "miss/tok" not in format_report(bench_report) and "offload" not in summary_line(bench_report)
    for figures in bench_report["methods"].values():
        assert figures["misses_per_token"] == 0 and figures["mb_read_per_token"] == 0 and figures["hit_rate"] is None


def test_offloaded_reads_are_totals_over_the_steps_per_token_produced():
    from moe_spec.core.stats import GenerationStats, StepStats
    from moe_spec.experiments.report import aggregate

    def step(produced, hits, misses, wait_ms):
        return StepStats(tree_size=2, accepted_length=produced, verify_ms=1.0, draft_ms=0.5,
                         unique_experts_per_layer=(2, 2), expert_hits=hits, expert_misses=misses,
                         bytes_read=misses * 2**20, fetch_wait_ms=wait_ms)

    first = GenerationStats(new_tokens=3, total_ms=10.0, steps=[step(1, 3, 1, 1.0), step(2, 0, 4, 3.0)])
    second = GenerationStats(new_tokens=1, total_ms=5.0, steps=[step(1, 4, 0, 0.0)])
    figures = aggregate([first, second])
    assert figures["misses_per_token"] == 5 / 4 and figures["mb_read_per_token"] == 5 / 4
    assert figures["hit_rate"] == round(7 / 12, 4) and figures["fetch_wait_ms"] == round(4 / 3, 4)
    reference = aggregate([GenerationStats(new_tokens=4, total_ms=5.0)])  # a loop without step statistics
    assert reference["misses_per_token"] is None and reference["hit_rate"] is None


def test_drafting_helps_on_the_repetitive_prompt(bench_report):
    copy = bench_report["per_class"]["copy"]
    assert copy["eagle2"]["mean_accept_len"] > 1.0


def test_unknown_method_is_a_clear_error(capsys):
    with pytest.raises(InputError, match="unknown method 'medusa'; known methods: ar, eagle2, static"):
        parse_methods("ar,medusa")
    code = main(["bench", "--prompts", "nothing.jsonl", "--methods", "ar,nope", "--drafter", "lookup"])
    assert code == 2
    assert "unknown method 'nope'" in capsys.readouterr().err


def test_method_arguments_are_checked():
    assert parse_methods("ar, eagle2,static:16") == ["ar", "eagle2", "static:16"]
    with pytest.raises(InputError, match="more than once"):
        parse_methods("ar,ar")
    with pytest.raises(InputError, match="static:16"):
        parse_methods("ar,static:x")
    with pytest.raises(InputError, match="takes no argument"):
        parse_methods("ar:3")
    with pytest.raises(InputError, match="not a method one run can use"):
        build_controller("static-best", profile=lambda: None)


def test_registry_builds_controllers_with_the_published_budgets():
    def no_profile():
        raise AssertionError("only methods that price nodes read the profile")

    assert build_controller("ar", no_profile) is None
    assert build_controller("eagle2", no_profile).budget == EAGLE2_BUDGET
    assert build_controller("static:16", no_profile).budget == EAGLE2_BUDGET.with_nodes(16)
    chain = build_controller("chain:3", no_profile).budget
    assert (chain.max_nodes, chain.max_depth, chain.branching) == (3, 3, 1)
    assert expand_methods(["ar", "static-best", "static:8"]) == ["ar", *[f"static:{n}" for n in STATIC_GRID]]
    assert set(METHODS) == {"ar", "eagle2", "static", "chain", "truncate", "moe-aware", "moe-aware-noexperts", "moe-aware-noresidency",
                            "moe-aware-unbounded", "moe-aware-unadjusted", "moe-aware-tilted", "moe-aware-request",
                            "moe-aware-nooverflow", "moe-aware-profilefetch"}


def test_method_order_rotates_per_prompt():
    assert [method_order("abc", i) for i in range(4)] == [list("abc"), list("bca"), list("cab"), list("abc")]


def test_prompt_file_errors_name_the_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt_ids": [1, 2]}\n{"class": "x"}\n')
    with pytest.raises(InputError, match=r"p.jsonl:2: give exactly one of"):
        load_prompts(path)
    path.write_text('{"prompt_ids": [1, 2], "class": "a"}\n{"prompt_ids": [3], "class": "a"}\n{"prompt": "x"}\n')
    assert [p.prompt_class for p in load_prompts(path, limit_per_class=1)] == ["a", "all"]


def test_shipped_prompt_sets_hold_every_class():
    heldout = load_prompts(CONFIGS / "heldout.jsonl")
    smoke = load_prompts(CONFIGS / "smoke.jsonl")
    for prompts, per_class in ((heldout, 8), (smoke, 2)):
        assert [p.prompt_class for p in prompts] == [c for c in CLASSES for _ in range(per_class)]
        assert all(MIN_TOKENS <= p.meta["n_tokens"] <= MAX_TOKENS for p in prompts)
    assert smoke == load_prompts(CONFIGS / "heldout.jsonl", limit_per_class=2)


@pytest.fixture(scope="module")
def small_tokenizer():
    from moe_spec.training.corpus import load_corpus
    from moe_spec.training.tokenizer_training import train_tokenizer

    return train_tokenizer([f.text for f in load_corpus().train_files[:12]], vocab_size=320)


def test_built_prompt_sets_have_the_class_shapes_and_are_prefix_stable(small_tokenizer):
    prompts = build_prompt_sets(small_tokenizer, per_class=2, seed=0)
    assert [p.prompt_class for p in prompts] == [c for c in CLASSES for _ in range(2)]
    for p in prompts:
        assert MIN_TOKENS <= p.meta["n_tokens"] <= MAX_TOKENS
    code, prose, copy = prompts[0], prompts[2], prompts[4]
    assert code.text.endswith("\n") or code.text.rsplit("\n", 1)[-1].isspace()  # cut at a line start
    last_line = prose.text.rstrip().splitlines()[-1].strip()
    assert last_line.startswith("#") or '"""' in prose.text or "'''" in prose.text
    repeated = copy.text.rstrip().splitlines()[-1]
    assert copy.text.count(repeated) >= 2  # the last line was seen before: a copy
    assert build_prompt_sets(small_tokenizer, per_class=1, seed=0, classes=("code", "copy")) == [code, copy]


def _tiny_bench(tmp_path, rows: list[tuple[str, list[int]]], runs: dict[int, list[str]]) -> dict[int, dict]:
    """Bench ar and static:4 with the lookup drafter on a tiny Qwen3-MoE over `rows` (class, prompt
    ids), once per entry of `runs` (name -> extra arguments); returns each run's JSON report."""
    model_dir = tmp_path / "model"
    tiny_model("qwen3_moe").save_pretrained(model_dir)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"class": c, "prompt_ids": p}) + "\n" for c, p in rows))
    reports = {}
    for name, extra in runs.items():
        out = tmp_path / f"{name}.json"
        assert main(["bench", "--model", str(model_dir), "--drafter", "lookup", "--prompts", str(prompts),
                     "--methods", "ar,static:4", "--no-progress", "--json", str(out), *extra]) == 0
        reports[name] = json.loads(out.read_text())
    return reports


def test_batched_bench_keeps_outputs_and_classes(tmp_path):
    """--batch-size 2: prompts of a class decode together; greedy outputs equal the unbatched ones."""
    rows = [("a", [5, 6, 7, 5, 6, 7, 5]), ("a", [9, 8, 7]), ("b", [11, 12, 13, 11, 12]), ("a", [4, 4, 4, 4])]
    reports = _tiny_bench(tmp_path, rows, {b: ["--max-new-tokens", "10", "--batch-size", str(b)] for b in (1, 2)})
    assert reports[2]["config"]["batch_size"] == 2
    assert reports[2]["per_prompt"][0]["methods"]["ar"]["batch"] == [0, 1]
    assert reports[2]["per_prompt"][2]["methods"]["ar"]["batch"] == [2]
    for p1, p2 in zip(reports[1]["per_prompt"], reports[2]["per_prompt"]):
        for method in ("ar", "static:4"):
            assert p1["methods"][method]["new_ids"] == p2["methods"][method]["new_ids"]


def test_repeated_passes_add_up_and_keep_one_entry_per_prompt(tmp_path):
    rows = [("a", [5, 6, 7, 5, 6, 7, 5]), ("a", [9, 8, 7])]
    reports = _tiny_bench(tmp_path, rows, {r: ["--max-new-tokens", "8", "--repeats", str(r)] for r in (1, 3)})
    once, thrice = reports[1]["methods"]["static:4"], reports[3]["methods"]["static:4"]
    assert thrice["steps"] == 3 * once["steps"] and thrice["new_tokens"] == 3 * once["new_tokens"]
    assert thrice["prompts"] == once["prompts"] == 2 and (once["repeats"], thrice["repeats"]) == (1, 3)
    assert reports[3]["config"]["repeats"] == 3
    assert len(reports[3]["per_prompt"]) == 2
    assert [p["methods"]["static:4"]["new_ids"] for p in reports[3]["per_prompt"]] == [
        p["methods"]["static:4"]["new_ids"] for p in reports[1]["per_prompt"]]
    with pytest.raises(SystemExit) as refused:  # argparse refuses --repeats 0 while parsing (exit status 2)
        main(["bench", "--model", str(tmp_path / "model"), "--prompts", str(tmp_path / "p.jsonl"), "--repeats", "0",
              "--no-progress"])
    assert refused.value.code == 2


def test_a_foreign_corpus_holds_out_every_parsable_non_test_file(tmp_path):
    from moe_spec.experiments.prompt_sets import foreign_corpus

    package = tmp_path / "pkg"
    (package / "tests").mkdir(parents=True)
    (package / "core.py").write_text("def f():\n    return 1\n")
    (package / "broken.py").write_text("def f(:\n")
    (package / "tests" / "test_core.py").write_text("def test_f():\n    pass\n")
    corpus = foreign_corpus([package])
    assert corpus.train_files == () and [f.path for f in corpus.heldout_files] == ["pkg/core.py"]
    with pytest.raises(ValueError, match="is not a folder"):
        foreign_corpus([tmp_path / "missing"])
