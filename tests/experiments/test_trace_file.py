"""A trace from elsewhere: a malformed, truncated, foreign or inconsistent file is a TraceError
naming the file and line, never an exception from deep inside replay."""

import json
import os
from pathlib import Path

import pytest

from moe_spec.experiments.trace_file import TraceError, read_trace

SHIPPED = Path(__file__).parents[2] / "analysis" / "results" / "trace_cpu_greedy.jsonl"


@pytest.fixture(scope="module")
def lines():
    return SHIPPED.read_text().splitlines()[:4]  # the header and three steps


def _write(tmp_path, header: dict, steps: list[dict]) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in [header, *steps]))
    return path


def _variant(tmp_path, lines, header=None, step=None) -> Path:
    head, steps = json.loads(lines[0]), [json.loads(line) for line in lines[1:]]
    if header is not None:
        header(head)
    if step is not None:
        step(steps[1])
    return _write(tmp_path, head, steps)


def test_the_shipped_trace_reads(tmp_path, lines):
    trace = read_trace(_variant(tmp_path, lines))
    assert len(trace.steps) == 3 and trace.greedy


@pytest.mark.parametrize("change, named", [
    (lambda s: s.update(accepted_path=[0, 99]), "accepted_path"),
    (lambda s: s.update(accepted_path=[1]), "accepted_path"),
    (lambda s: s.update(accepted_path=[]), "accepted_path"),
    (lambda s: s.update(bonus_token=10**6), "bonus_token.*vocabulary"),
    (lambda s: s.update(tokens=[-5] + s["tokens"][1:]), "tokens.*vocabulary"),
    (lambda s: s.update(argmax=s["argmax"][:-1]), "do not fit"),
    (lambda s: s.update(experts=[[[999] * 4] * len(s["tokens"])] * 8), "expert ids outside"),
    (lambda s: s.update(experts=s["experts"][:3]), "MoE layers"),
    (lambda s: s.update(parents=[0] * len(s["tokens"])), "root"),
    (lambda s: s.update(tokens="abc"), "malformed"),
    (lambda s: s.pop("verify_ms"), "KeyError"),
    (lambda s: s.update(prompt=-1), "prompt -1"),
    (lambda s: s.update(prefix_len=0), "prefix_len 0"),
])
def test_an_inconsistent_step_is_named_with_its_line(tmp_path, lines, change, named):
    path = _variant(tmp_path, lines, step=change)
    with pytest.raises(TraceError, match=named) as info:
        read_trace(path)
    assert f"{path}:3" in str(info.value)


@pytest.mark.parametrize("change, named", [
    (lambda h: h.update(target=[1, 2]), "target fingerprint is malformed"),
    (lambda h: h["target"].update(moe_layers="all"), "target fingerprint is malformed"),
    (lambda h: h["target"].update(num_experts=-1), "target fingerprint is malformed"),
    (lambda h: h.update(version=2), "trace version 2"),
    (lambda h: h.update(format="other"), "not a moe_spec trace header"),
])
def test_a_foreign_header_is_named(tmp_path, lines, change, named):
    with pytest.raises(TraceError, match=named):
        read_trace(_variant(tmp_path, lines, header=change))


def test_a_truncated_trace_names_its_last_line(tmp_path, lines):
    path = tmp_path / "t.jsonl"
    text = "\n".join(lines) + "\n"
    path.write_text(text[: len(text) - 200])
    with pytest.raises(TraceError, match=f"{path}:4: malformed step"):
        read_trace(path)


@pytest.mark.parametrize("content", [b"", os.urandom(2048), b'[1, 2, 3]\n', b'{"kind": "header"}\n{}\n'])
def test_random_or_foreign_bytes_are_named(tmp_path, content):
    path = tmp_path / "t.jsonl"
    path.write_bytes(content)
    with pytest.raises(TraceError, match=str(path)):
        read_trace(path)


def test_a_step_that_is_not_an_object_is_named(tmp_path, lines):
    path = tmp_path / "t.jsonl"
    path.write_text(lines[0] + "\n[1, 2]\n")
    with pytest.raises(TraceError, match=f"{path}:2"):
        read_trace(path)


def test_a_profile_named_outside_the_trace_folder_is_refused(tmp_path, lines):
    trace = read_trace(_variant(tmp_path, lines, header=lambda h: h.update(profile="../../etc/profile.json")))
    with pytest.raises(TraceError, match="not a file beside it"):
        trace.profile()
