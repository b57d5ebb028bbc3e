"""Prompt files: every malformed line is named with its file and line number."""

import pytest
import torch
from transformers import BatchEncoding

from moe_spec.errors import InputError
from moe_spec.experiments.prompt_file import Prompt, in_class_turns, load_prompts


@pytest.mark.parametrize("line, message", [
    ('{"prompt_ids": [1, 2], "class": null}', r"p.jsonl:1: `class` must be a non-empty string, got None"),
    ('{"prompt_ids": [1, 2], "class": 3}', r"p.jsonl:1: `class` must be a non-empty string, got 3"),
    ('{"prompt_ids": [1, 2], "class": ""}', r"p.jsonl:1: `class` must be a non-empty string"),
    ('{"prompt_ids": [1, -2]}', r"p.jsonl:1: `prompt_ids` must be token ids >= 0, got -2"),
    ('{"prompt_ids": [1, 2.5]}', r"p.jsonl:1: `prompt_ids` must be a non-empty list of integers"),
    ('{"prompt_ids": [1, true]}', r"p.jsonl:1: `prompt_ids` must be a non-empty list of integers"),
    ('{"prompt_ids": [1, NaN]}', r"p.jsonl:1: `prompt_ids` must be a non-empty list of integers"),
    ('{"prompt_ids": []}', r"p.jsonl:1: `prompt_ids` must be a non-empty list of integers"),
    ('{"prompt": ""}', r"p.jsonl:1: `prompt` must be a non-empty string"),
    ('{"prompt": 5}', r"p.jsonl:1: `prompt` must be a non-empty string"),
    ('{"prompt": "a", "prompt_ids": [1]}', r"p.jsonl:1: give exactly one of"),
    ('[1, 2]', r"p.jsonl:1: expected a JSON object"),
    ('{"prompt": "a"', r"p.jsonl:1: not JSON"),
])
def test_a_malformed_line_is_named(tmp_path, line, message):
    path = tmp_path / "p.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(InputError, match=message):
        load_prompts(path)


def test_unreadable_files_and_bad_limits_are_named(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt": "caf\xe9"}\n')
    with pytest.raises(InputError, match=r"p.jsonl is not UTF-8 text"):
        load_prompts(path)
    path.write_text('{"prompt_ids": [1]}\n')
    for limit in (0, -1, 1.5, True, "2"):
        with pytest.raises(InputError, match=r"limit_per_class must be an integer >= 1 or None"):
            load_prompts(path, limit)
    with pytest.raises(InputError, match="no prompt file at"):
        load_prompts(tmp_path)
    path.write_text("\n\n")
    with pytest.raises(InputError, match="holds no prompts"):
        load_prompts(path)


class NothingTokenizer:
    """Encodes every text to no tokens (as a tokenizer with a strict normaliser can); the embedded
    one always yields at least one token for a non-empty text."""

    def __call__(self, text, return_tensors=None):
        return BatchEncoding({"input_ids": torch.zeros(1, 0, dtype=torch.long)})


def test_a_text_prompt_that_tokenizes_to_nothing_is_named():
    with pytest.raises(InputError, match=r"the 'code' prompt '\\u200b' tokenizes to nothing"):
        Prompt("code", text="\u200b").input_ids(NothingTokenizer())


def test_classes_take_turns_so_a_leading_cut_holds_each_alike():
    # written class by class, as the shipped prompt files are: a, a, a, b, b, c
    prompts = [Prompt(name, ids=(i,)) for i, name in enumerate("aaabbc")]
    turns = in_class_turns(prompts)
    assert [p.ids[0] for p in turns] == [0, 3, 5, 1, 4, 2]
    assert sorted(turns, key=lambda p: p.ids) == prompts  # a reordering: nothing lost, nothing repeated
    assert {p.prompt_class for p in turns[:3]} == {"a", "b", "c"}
    assert in_class_turns([]) == []


def test_the_profile_reads_its_prompts_in_class_turns(tmp_path):
    from moe_spec.cli.profile import read_prompts

    path = tmp_path / "p.jsonl"
    path.write_text("".join(f'{{"class": "{name}", "prompt_ids": [{i + 1}]}}\n' for i, name in enumerate("xxyyzz")))
    assert [int(ids[0]) for ids in read_prompts(path, None, 100)] == [1, 3, 5, 2, 4, 6]
