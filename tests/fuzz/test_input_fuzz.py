"""Seeded fuzzing of `SpecDecoder.generate` and the drop-in: every combination decodes correctly or
is refused with an `InputError` naming a bad parameter (see `moe_spec.testing.input_fuzz`)."""

import pytest
import torch

from moe_spec import SpecDecoder
from moe_spec.testing.input_fuzz import DropInFuzz, EngineFuzz, engine_decoders, summary
from moe_spec.testing.tiny_models import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3_moe")


def test_every_generate_combination_decodes_correctly_or_is_refused_naming_a_bad_parameter(model):
    outcome = EngineFuzz(model, engine_decoders(model), seed=0).run(1200)
    print(summary(outcome))  # pytest -s shows the count and the distinct messages
    assert not outcome.failures, summary(outcome)
    assert outcome.cases == 1200
    assert outcome.decoded >= 150 and sum(outcome.refused.values()) >= 600, "both outcomes are exercised"
    assert len(outcome.refused) >= 40, "many distinct problems are named"


def test_every_drop_in_combination_decodes_correctly_or_is_refused_naming_a_bad_parameter(model):
    outcome = DropInFuzz(model, seed=0).run(400)
    print(summary(outcome))
    assert not outcome.failures, summary(outcome)
    assert outcome.decoded >= 100 and sum(outcome.refused.values()) >= 100


class SilentDecoder:
    """Checks nothing: decodes one fixed good request whatever it is handed."""

    def __init__(self, model):
        self.decoder = SpecDecoder(model)

    def generate(self, **request):
        return self.decoder.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=1)


class WrongDecoder:
    """Validates as the real one does, then returns one token too many per row (a silently wrong result)."""

    def __init__(self, model):
        self.decoder = SpecDecoder(model)

    def generate(self, **request):
        result = self.decoder.generate(**request)
        extra = torch.full((result.sequences.shape[0], 1), 9)
        result.sequences = torch.cat([result.sequences, extra], dim=1)
        result.stats.new_tokens_per_row = [n + 1 for n in result.stats.new_tokens_per_row]
        return result


@pytest.mark.parametrize("decoder, expected", [(SilentDecoder, "decoded despite bad"), (WrongDecoder, "new tokens for")])
def test_the_fuzz_fails_a_decoder_that_checks_nothing_or_decodes_wrongly(model, decoder, expected):
    outcome = EngineFuzz(model, {"under test": decoder(model)}, seed=1).run(60)
    assert outcome.failures and any(expected in f for f in outcome.failures), summary(outcome)


def test_the_fuzz_counts_an_exception_of_another_type_as_a_failure(model):
    class Crashing:
        def generate(self, **request):
            raise RuntimeError("slice indices must be integers")

    outcome = EngineFuzz(model, {"crashing": Crashing()}, seed=2).run(20)
    assert len(outcome.failures) == 20 and all(f.startswith("RuntimeError") for f in outcome.failures)
