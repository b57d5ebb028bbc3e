"""The routing recorder sees each router's top-k choice, changes nothing, and always cleans up."""

import pytest
import torch

from moe_spec.core.routing import Routing, RoutingRecorder, find_routers
from moe_spec.testing.tiny_models import tiny_model

from moe_spec.testing.helpers import MOE_ARCHITECTURES

TOKENS = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]])


def _selection_scores(router, logits):
    """The scores each architecture's router takes its top-k over."""
    bias = getattr(router, "e_score_correction_bias", None)
    if bias is not None:  # DeepSeek-V3: sigmoid scores plus the balancing bias
        return logits.float().sigmoid() + bias
    return logits.float()


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_recorded_experts_are_the_routers_topk(arch):
    model = tiny_model(arch)
    routers = find_routers(model)
    assert routers, "an MoE model has routers"
    logits_seen = {}
    handles = [
        r.module.register_forward_hook(lambda m, i, o, layer=r.layer: logits_seen.__setitem__(layer, o[0].detach()))
        for r in routers
    ]
    try:
        with torch.no_grad(), RoutingRecorder(model) as recorder:
            model(TOKENS)
    finally:
        for h in handles:
            h.remove()
    routing = recorder.routing()
    assert routing.experts.shape == (len(routers), TOKENS.numel(), routers[0].top_k)
    for index, router in enumerate(routers):
        scores = _selection_scores(router.module, logits_seen[router.layer])
        expected = torch.topk(scores, router.top_k, dim=-1).indices.sort(-1).values
        assert torch.equal(routing.experts[index].sort(-1).values, expected)


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_recording_does_not_change_logits(arch):
    model = tiny_model(arch)
    with torch.no_grad():
        plain = model(TOKENS).logits
        with RoutingRecorder(model):
            recorded = model(TOKENS).logits
    assert torch.equal(plain, recorded)


def test_hooks_are_removed_after_the_context_and_after_an_exception():
    model = tiny_model("qwen3_moe")
    routers = find_routers(model)
    with RoutingRecorder(model):
        assert all(len(r.module._forward_hooks) == 1 for r in routers)
    assert all(len(r.module._forward_hooks) == 0 for r in routers)
    with pytest.raises(IndexError):
        with RoutingRecorder(model):
            model(torch.tensor([[10_000]]))  # outside the vocabulary: the forward raises
    assert all(len(r.module._forward_hooks) == 0 for r in routers)


def test_unique_experts_and_activation_agree():
    model = tiny_model("olmoe")
    with torch.no_grad(), RoutingRecorder(model) as recorder:
        model(TOKENS)
    routing = recorder.routing()
    assert routing.unique_per_layer() == routing.activation().sum(1).tolist()
    one = Routing(routing.layers, routing.num_experts, routing.experts[:, :1])  # the first token alone
    assert all(u == model.config.num_experts_per_tok for u in one.unique_per_layer())


def test_dense_model_has_empty_routing():
    model = tiny_model("llama")
    with torch.no_grad(), RoutingRecorder(model) as recorder:
        model(TOKENS)
    assert recorder.routing().unique_per_layer() == []
