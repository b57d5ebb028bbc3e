"""`moe-spec soak` with a tiny N on the embedded pair, and the soak's figures able to catch a leak."""

from __future__ import annotations

import json
import mmap

import torch

from moe_spec.cli.main import main
from moe_spec.core.drafting import TreeBudget
from moe_spec.core.target import TargetModel
from moe_spec.drafters.lookup import LookupDrafter
from moe_spec.experiments.soak import SoakSettings, registered_hooks, rss_bytes, run_soak, schedule
from moe_spec.policy.registry import Method, runnable_names
from moe_spec.policy.static import StaticController
from moe_spec.testing.helpers import PLAIN_PROMPT, REPETITIVE_PROMPT
from moe_spec.testing.tiny_models import tiny_model


def test_soak_command_reports_memory_hooks_speed_and_a_long_generation(tmp_path, capsys):
    out = tmp_path / "soak.json"
    code = main(["soak", "--generations", "6", "--window", "3", "--new-tokens", "2-6", "--prompt-tokens", "4-16",
                 "--batch-sizes", "1,2", "--temperatures", "0,1", "--long-positions", "48", "--threads", "1",
                 "--no-progress", "--json", str(out)])
    assert code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    line = json.loads(lines[-1])
    assert any(text.startswith("hooks start / end") for text in lines[:-1]), "a human summary comes first"
    assert line["command"] == "soak" and line["generations"] == 6
    assert line["hooks_start"] == line["hooks_end"]
    assert line["greedy_mismatches"] == 0
    assert line["long_positions"] == 48
    body = json.loads(out.read_text())
    assert body["rss_start_bytes"] > 0 and body["rss_end_bytes"] > 0
    assert body["first_window"]["tokens"] > 0 and body["last_window"]["tokens"] > 0
    assert body["greedy_repeats_checked"] == 3
    assert set(body["per_method"]) <= set(runnable_names())
    assert body["long"]["cache_bytes_per_position"] > 0
    assert "--generations 6" in body["command"]


def test_any_window_of_the_schedule_runs_the_same_jobs():
    settings = SoakSettings(generations=25, window=7, batch_sizes=(1, 3), temperatures=(0.0, 0.5))
    block = schedule(settings, ["ar", "eagle2"], pool=5)
    assert len(block) == 7 and {job.method for job in block} == {"ar", "eagle2"}
    windows = [sorted(map(repr, (block[i % 7] for i in range(start, start + 7)))) for start in range(0, 19)]
    assert all(window == windows[0] for window in windows)


class _LeakyController(StaticController):
    """A controller that forgets to remove a hook it puts on the target at every `begin`."""

    def __init__(self, model):
        super().__init__(TreeBudget(4, 3, 2))
        self.model = model

    def begin(self, *args, **kwargs):
        self.model.lm_head.register_forward_hook(lambda module, inputs, output: None)
        return super().begin(*args, **kwargs)


def test_soak_counts_a_hook_leaked_per_generation():
    model = tiny_model("qwen3_moe")
    target = TargetModel(model)
    leaky = Method("leaky", LookupDrafter(), _LeakyController(model))
    settings = SoakSettings(generations=6, window=3, new_tokens=(3, 5), prompt_tokens=(4, 10), batch_sizes=(1,),
                            temperatures=(0.0,))
    pool = [torch.tensor(REPETITIVE_PROMPT), torch.tensor(PLAIN_PROMPT)]
    result = run_soak(target, [leaky], pool, settings, progress=False)
    assert result.hooks_end - result.hooks_start == 6, "one leaked hook per generation"
    assert registered_hooks(model) >= 6


def test_rss_reads_memory_the_process_touches():
    # fresh anonymous pages: a tensor could reuse heap memory an earlier test freed but the
    # allocator kept resident, and then resident memory would not move (it did not, once)
    size = 64 * 2 ** 20
    with mmap.mmap(-1, size) as block:
        before = rss_bytes()
        for offset in range(0, size, mmap.PAGESIZE):
            block[offset] = 1  # touch every page
        assert rss_bytes() - before > 32 * 2 ** 20
