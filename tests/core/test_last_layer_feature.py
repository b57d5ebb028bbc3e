"""Feature id N (the last layer of an N-layer target) is that layer's output before the final norm,
as vLLM and speculators read it; transformers' own `hidden_states[N]` is after the norm. A head that
fuses it drafts over the same states in the engine loop, in training and in the test helpers, and
decoding with it stays lossless on every architecture."""

import pytest
import torch

from moe_spec import SpecDecoder
from moe_spec.core.target import TargetModel
from moe_spec.errors import MoeSpecError
from moe_spec.drafters.eagle import EagleDrafter
from moe_spec.testing.helpers import ALL_ARCHITECTURES, PLAIN_PROMPT, REPETITIVE_PROMPT, hf_greedy, random_eagle_head, target_features
from moe_spec.testing.tiny_models import tiny_model
from moe_spec.training.train_draft import target_pass


def _last_layer_output(model, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([1, T, D] the last decoder layer's output, [1, T, D] transformers' hidden_states[N])."""
    seen = []
    hook = model.get_decoder().layers[-1].register_forward_hook(
        lambda module, args, out: seen.append(out[0] if isinstance(out, tuple) else out))
    try:
        out = model(tokens, output_hidden_states=True)
    finally:
        hook.remove()
    return seen[0], out.hidden_states[-1]


@pytest.mark.parametrize("arch", ALL_ARCHITECTURES)
def test_id_n_is_the_last_layer_output_before_the_norm(arch):
    model = tiny_model(arch)
    n = int(model.config.get_text_config(decoder=True).num_hidden_layers)
    target = TargetModel(model, feature_layers=(0, n))
    tokens = torch.tensor([PLAIN_PROMPT])
    before_norm, after_norm = _last_layer_output(model, tokens)
    assert not torch.allclose(before_norm, after_norm), "the final norm changes the state"
    helper = target_features(target, tokens[0])  # [T, S, D]
    torch.testing.assert_close(helper[:, 1], before_norm[0])
    features, _ = target_pass(target, tokens)  # [1, T, S, D]
    torch.testing.assert_close(features[0, :, 1], before_norm[0])
    cache = target.new_cache()
    t = tokens.shape[1]
    out = target.forward_tree(cache, tokens, torch.ones(1, t, t, dtype=torch.bool).tril(), torch.arange(t)[None])
    torch.testing.assert_close(out.features[0, :, 1], before_norm[0])
    torch.testing.assert_close(out.features[0, :, 0], model.get_input_embeddings()(tokens)[0])


@pytest.mark.parametrize("arch", ALL_ARCHITECTURES)
def test_a_head_fusing_the_last_layer_is_lossless(arch):
    model = tiny_model(arch)
    target = TargetModel(model)
    n = target.num_layers
    target.feature_layers = tuple(sorted({max(n - 2, 0), n - 1, n}))
    head = random_eagle_head(target)
    assert head.config.feature_layers_for(n)[-1] == n
    decoder = SpecDecoder(model, drafter=EagleDrafter(head, target))
    for prompt in (REPETITIVE_PROMPT, PLAIN_PROMPT):
        result = decoder.generate(torch.tensor([prompt]), max_new_tokens=16)
        assert torch.equal(result.sequences, hf_greedy(model, prompt, 16)), arch


def test_the_decoder_reads_the_layers_its_drafter_fuses():
    model = tiny_model("qwen3_moe")
    target = TargetModel(model)
    target.feature_layers = (1, target.num_layers)
    drafter = EagleDrafter(random_eagle_head(target), target)
    assert SpecDecoder(model, drafter=drafter).target.feature_layers == drafter.feature_layers  # built from the model
    other = TargetModel(model)
    with pytest.raises(MoeSpecError, match="feature layers"):
        SpecDecoder(other, drafter=drafter)
