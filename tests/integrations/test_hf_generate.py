"""`model.generate(..., custom_generate=speculative_generate)` is a drop-in for transformers users."""

import pytest
import torch
from transformers.generation import GenerateDecoderOnlyOutput

from moe_spec import InputError, LookupDrafter, SpecDecoder, TreeBudget
from moe_spec.policy.static import StaticController
from moe_spec.integrations.hf_generate import speculative_generate
from moe_spec.testing.tiny_models import tiny_model

from moe_spec.testing.helpers import PLAIN_PROMPT, REPETITIVE_PROMPT, hf_greedy


class RecordingStreamer:
    def __init__(self):
        self.puts: list[list[int]] = []
        self.ended = False

    def put(self, value: torch.Tensor) -> None:
        assert not self.ended
        self.puts.append(value.flatten().tolist())

    def end(self) -> None:
        self.ended = True


@pytest.mark.parametrize("prompt", [REPETITIVE_PROMPT, PLAIN_PROMPT])
def test_greedy_drop_in_equals_spec_decoder_and_plain_generate(any_model, prompt):
    ids = torch.tensor([prompt])
    drop_in = any_model.generate(ids, custom_generate=speculative_generate, drafter=LookupDrafter(), max_new_tokens=20)
    engine = SpecDecoder(any_model, drafter=LookupDrafter()).generate(ids, max_new_tokens=20).sequences
    assert torch.equal(drop_in, engine)
    assert torch.equal(drop_in, hf_greedy(any_model, prompt, 20))


def test_controller_and_return_dict_are_honoured(moe_model):
    ids = torch.tensor([REPETITIVE_PROMPT])
    out = moe_model.generate(ids, custom_generate=speculative_generate, drafter=LookupDrafter(),
                             controller=StaticController(TreeBudget(4, 8, 4)), max_new_tokens=16,
                             do_sample=False, return_dict_in_generate=True)
    assert isinstance(out, GenerateDecoderOnlyOutput)
    assert torch.equal(out.sequences, hf_greedy(moe_model, REPETITIVE_PROMPT, 16))


def test_left_padded_prompt_keeps_its_padding_and_decodes_like_generate():
    model = tiny_model("qwen3_moe")
    ids = torch.tensor([[0, 0, 0] + PLAIN_PROMPT])
    mask = torch.tensor([[0, 0, 0] + [1] * len(PLAIN_PROMPT)])
    drop_in = model.generate(ids, attention_mask=mask, custom_generate=speculative_generate, drafter=LookupDrafter(),
                             max_new_tokens=12, pad_token_id=0)
    plain = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12, pad_token_id=0)
    assert torch.equal(drop_in, plain)


def test_sampling_with_a_seed_is_reproducible_and_stays_in_vocabulary():
    model = tiny_model("mixtral")
    ids = torch.tensor([REPETITIVE_PROMPT])
    outputs = []
    for _ in range(2):
        torch.manual_seed(123)
        outputs.append(model.generate(ids, custom_generate=speculative_generate, drafter=LookupDrafter(), do_sample=True,
                                      temperature=0.9, top_k=20, top_p=0.9, max_new_tokens=16))
    assert torch.equal(outputs[0], outputs[1])
    new = outputs[0][0, len(REPETITIVE_PROMPT):]
    assert 1 <= new.numel() <= 16 and int(new.min()) >= 0 and int(new.max()) < 96
    explicit = [model.generate(ids, custom_generate=speculative_generate, drafter=LookupDrafter(), do_sample=True,
                               generator=torch.Generator().manual_seed(7), max_new_tokens=16) for _ in range(2)]
    assert torch.equal(explicit[0], explicit[1])



@pytest.mark.slow
def test_sampled_drop_in_tokens_follow_the_targets_own_law():
    """Tokens 2 and 3 sampled through the drop-in (EAGLE trees, transformers' generation config: T = 1,
    top-k 50 > the vocabulary, no EOS) against the exact joint law from a plain softmax of the model's logits;
    a drop-in that only reproduced itself would pass the test above and fail this one."""
    from moe_spec.drafters.eagle import EagleDrafter
    from moe_spec.core.target import TargetModel
    from moe_spec.testing.helpers import assert_follows, law_after_the_first_token, random_eagle_head

    vocab, prompt = 6, [1, 4, 2, 5]
    model = tiny_model("qwen3_moe", vocab_size=vocab, seed=4)
    target = TargetModel(model)
    drafter = EagleDrafter(random_eagle_head(target, draft_vocab=vocab), target, TreeBudget(8, 2, 3))

    def probs(tokens):
        return model(torch.tensor([prompt + tokens])).logits[0, -1].double().softmax(-1)

    exact = law_after_the_first_token(probs, vocab, 3)  # [V, V]
    counts = torch.zeros(vocab, vocab)
    generator = torch.Generator().manual_seed(21)
    ids = torch.tensor([prompt])
    for _ in range(1500):
        out = model.generate(ids, custom_generate=speculative_generate, drafter=drafter, method="static:8",
                             do_sample=True, temperature=1.0, max_new_tokens=3, eos_token_id=None,
                             generator=generator)
        _, x2, x3 = out[0, len(prompt):].tolist()
        counts[x2, x3] += 1
    assert_follows(counts, exact.float())

def test_moe_streamer_gets_the_prompt_once_then_every_new_token_then_end():
    model = tiny_model("olmoe")
    streamer = RecordingStreamer()
    ids = torch.tensor([REPETITIVE_PROMPT])
    out = model.generate(ids, custom_generate=speculative_generate, drafter=LookupDrafter(), max_new_tokens=20,
                         moe_streamer=streamer)
    assert streamer.puts[0] == REPETITIVE_PROMPT
    assert [t for put in streamer.puts[1:] for t in put] == out[0, len(REPETITIVE_PROMPT):].tolist()
    assert len(streamer.puts) > 2 and streamer.ended


def test_generates_own_streamer_never_reaches_a_callable_so_moe_streamer_is_needed():
    """transformers 5.23 sends `streamer=` the prompt and keeps it from a callable `custom_generate`
    (the documented reason for `moe_streamer`); if this starts failing, transformers forwards it now."""
    model = tiny_model("qwen3_moe")
    streamer = RecordingStreamer()
    model.generate(torch.tensor([PLAIN_PROMPT]), custom_generate=speculative_generate, drafter=LookupDrafter(),
                   max_new_tokens=4, streamer=streamer)
    assert streamer.puts == [PLAIN_PROMPT] and not streamer.ended


@pytest.mark.parametrize("method", ["ar", "eagle2", "static:4"])
def test_a_method_by_name_decodes_like_generate(moe_model, method):
    ids = torch.tensor([REPETITIVE_PROMPT])
    out = moe_model.generate(ids, custom_generate=speculative_generate, drafter=LookupDrafter(), method=method,
                             max_new_tokens=12)
    assert torch.equal(out, hf_greedy(moe_model, REPETITIVE_PROMPT, 12))


@pytest.mark.parametrize("settings, message", [
    ({"method": "moe-aware"}, "needs a profile of the target; pass profile="),
    ({"method": "eagle2", "drafter": None}, "needs a drafter; pass drafter="),
    ({"method": "static-best"}, "not a method one run can use"),
    ({"method": "medusa"}, "unknown method 'medusa'"),
    ({"method": "eagle2", "controller": StaticController(TreeBudget(4, 8, 4))}, "method= or controller=, not both"),
    ({"profile": "p.json", "drafter": None}, "profile= is read by method= only"),
])
def test_bad_method_requests_are_refused_naming_the_parameter(settings, message):
    model = tiny_model("qwen3_moe")
    with pytest.raises(InputError, match=message):
        model.generate(torch.tensor([PLAIN_PROMPT]), custom_generate=speculative_generate,
                       **{"drafter": LookupDrafter(), **settings}, max_new_tokens=4)


@pytest.mark.parametrize("settings, message", [
    ({"repetition_penalty": 1.3}, "RepetitionPenaltyLogitsProcessor"),
    ({"num_beams": 2}, "beam"),
    ({"return_dict_in_generate": True, "output_scores": True}, "output_scores"),
])
def test_settings_it_cannot_honour_are_refused(settings, message):
    model = tiny_model("qwen3_moe")
    with pytest.raises(InputError, match=message):
        model.generate(torch.tensor([PLAIN_PROMPT]), custom_generate=speculative_generate, drafter=LookupDrafter(),
                       max_new_tokens=4, **settings)


def test_a_left_padded_batch_decodes_each_row_as_alone_and_pads_finished_rows():
    model = tiny_model("mixtral")
    rows = [REPETITIVE_PROMPT, PLAIN_PROMPT[:4], [7, 7, 7]]
    width = max(len(r) for r in rows)
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    alone = [hf_greedy(model, r, 16)[0, len(r):].tolist() for r in rows]
    eos = alone[1][2]  # row 1 stops at its third token
    out = model.generate(ids, attention_mask=mask, custom_generate=speculative_generate, drafter=LookupDrafter(),
                         max_new_tokens=16, eos_token_id=eos, pad_token_id=5)
    assert torch.equal(out[:, :width], ids)
    for row, expected in enumerate(alone):
        expected = expected[: expected.index(eos) + 1] if eos in expected else expected
        got = out[row, width:].tolist()
        assert got[: len(expected)] == expected and all(t == 5 for t in got[len(expected):]), row


def test_a_streamer_with_a_batch_is_refused():
    model = tiny_model("qwen3_moe")
    with pytest.raises(InputError, match="single prompt"):
        model.generate(torch.tensor([PLAIN_PROMPT, PLAIN_PROMPT]), custom_generate=speculative_generate,
                       drafter=LookupDrafter(), max_new_tokens=4, moe_streamer=RecordingStreamer())


def test_moe_aware_by_name_on_the_embedded_pair_reads_the_profile_and_decodes_like_generate():
    from moe_spec.loading import load_target
    from moe_spec.measure.store import DEFAULT_PROFILE

    model = load_target()
    ids = torch.tensor([REPETITIVE_PROMPT])
    out = model.generate(ids, custom_generate=speculative_generate, drafter="default", method="moe-aware",
                         profile=DEFAULT_PROFILE, max_new_tokens=12)
    assert torch.equal(out, hf_greedy(model, REPETITIVE_PROMPT, 12))


@pytest.mark.parametrize("settings, message", [
    ({"max_new_tokens": 2.5}, r"max_new_tokens must be an integer, got 2.5 \(float\)"),  # decoded 2 tokens before
    ({"max_new_tokens": True}, r"max_new_tokens must be an integer, got True \(bool\)"),  # decoded 1 token before
    ({"do_sample": "yes"}, r"do_sample must be True or False, got 'yes'"),
    ({"do_sample": True, "top_p": float("nan")}, r"top_p must be a number in \(0, 1\], got nan"),
    ({"do_sample": True, "temperature": 1e-10}, r"temperature must be 0 \(greedy\) or at least 1e-06"),
    ({"eos_token_id": 2.5}, r"eos_token_id must be integer token ids, got 2.5"),  # was truncated to 2
    ({"eos_token_id": 500}, r"eos_token_id \[500\] outside the target vocabulary"),
    ({"pad_token_id": -5}, r"pad_token_id must be a non-negative integer token id, got -5"),
    ({"generator": "x"}, r"generator must be a torch.Generator or None, got 'x'"),
    ({"attention_mask": torch.tensor([[2] + [1] * 9])}, r"attention_mask must hold only 0 and 1, got \[2\]"),
    ({"attention_mask": torch.tensor([[0.0] + [1.0] * 9])}, r"attention_mask must be an integer or bool tensor"),
    ({"attention_mask": torch.ones(1, 9, dtype=torch.long)}, r"attention_mask has 9 columns, input_ids 10"),
    ({"drafter": 3}, r"drafter= must be a Drafter .* got int"),
    ({"controller": "static"}, r"controller= must be a moe_spec Controller .* got str"),
    ({"method": 3}, r"method= must be a method name .* got int"),
    ({"method": "ar", "profile": 3}, r"profile= must be a Profile, the path of a profile JSON, or None; got int"),
    ({"observer": object()}, r"observer= must be a DecodeObserver .* got object"),
    ({"moe_streamer": 3}, r"streamer must have put\(tokens\) and end\(\) methods"),
])
def test_a_bad_value_is_refused_by_name(settings, message):
    model = tiny_model("qwen3_moe")
    kwargs = {"drafter": LookupDrafter(), "max_new_tokens": 4, **settings}
    with pytest.raises(InputError, match=message):
        model.generate(torch.tensor([PLAIN_PROMPT]), custom_generate=speculative_generate, **kwargs)


def test_a_float_mask_of_ones_is_dropped_by_generate_and_decodes_as_no_mask():
    """transformers drops an all-ones mask before the drop-in sees it; nothing to refuse then."""
    model = tiny_model("qwen3_moe")
    ids = torch.tensor([PLAIN_PROMPT])
    out = model.generate(ids, attention_mask=torch.ones(1, 10), custom_generate=speculative_generate,
                         drafter=LookupDrafter(), max_new_tokens=6)
    assert torch.equal(out, hf_greedy(model, PLAIN_PROMPT, 6))


def test_a_drafter_alone_drafts_the_best_fixed_tree_with_a_hint_and_moe_aware_on_a_profile(tmp_path):
    """Without method= or controller=: moe-aware on profile=, else static:4 and a warning saying how to
    profile; both lossless."""
    from moe_spec.core.step_record import DecodeObserver
    from moe_spec.measure.latency import TimingConfig
    from moe_spec.measure.profiler import ProfileSettings, build_profile
    from moe_spec.core.target import TargetModel

    class Sizes(DecodeObserver):
        def __init__(self):
            self.verified = []

        def on_prefill(self, record):
            pass

        def on_step(self, record):
            self.verified.append(len(record.verified.trees[0]) - 1)

    model = tiny_model("qwen3_moe")
    ids = torch.tensor([REPETITIVE_PROMPT])
    sizes = Sizes()
    with pytest.warns(UserWarning, match="no profile= of this target, so drafting static:4"):
        out = model.generate(ids, custom_generate=speculative_generate, drafter=LookupDrafter(), observer=sizes,
                             max_new_tokens=12)
    assert torch.equal(out, hf_greedy(model, REPETITIVE_PROMPT, 12))
    assert sizes.verified and max(sizes.verified) <= 4 and max(sizes.verified) > 0
    settings = ProfileSettings(max_new_tokens=12, prefix_len=16, grid_tokens=(1, 4), grid_experts=(2, 4),
                               natural_trees=3, curve_sizes=(1, 2, 4), timing=TimingConfig(1, 0, 0))
    profile = build_profile(TargetModel(model), LookupDrafter(), [torch.tensor(REPETITIVE_PROMPT)], settings)
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="no profile=")
        priced = model.generate(ids, custom_generate=speculative_generate, drafter=LookupDrafter(), profile=profile,
                                max_new_tokens=12)
    assert torch.equal(priced, out)


def test_every_kind_of_drafter_is_named_in_the_drop_in(tmp_path):
    """drafter= takes the names the command line takes: the checkpoint's MTP layers, a draft model's folder."""
    from moe_spec.testing.tiny_models import tiny_mtp_checkpoint

    model = tiny_mtp_checkpoint("deepseek_v3", tmp_path / "target", 1)
    tiny_model("llama", seed=3, num_hidden_layers=1).save_pretrained(tmp_path / "draft_lm")
    ids = torch.tensor([REPETITIVE_PROMPT])
    for drafter in ("mtp", str(tmp_path / "draft_lm")):
        out = model.generate(ids, custom_generate=speculative_generate, drafter=drafter, method="static:4",
                             max_new_tokens=16)
        assert torch.equal(out, hf_greedy(model, REPETITIVE_PROMPT, 16)), drafter
