"""Which candidates a request drafts (top tokens or draws), chosen from what the profile measured,
and sampled trees never cut by a controller."""

import warnings
from dataclasses import replace

import pytest
import torch

from moe_spec import SpecDecoder, TreeBudget
from moe_spec.core.control import StepPlan
from moe_spec.core.forest import StepForest
from moe_spec.core.sampling import SamplingConfig
from moe_spec.core.target import TargetModel
from moe_spec.drafters.eagle import EagleDrafter
from moe_spec.errors import InputError, MoeSpecError
from moe_spec.loading import ASSETS
from moe_spec.policy.candidate_scheme import CandidateScheme, resolve_scheme
from moe_spec.policy.registry import build_controller, check_name, expand_methods
from moe_spec.policy.static import StaticController
from moe_spec.profile.artifact import Profile
from moe_spec.profile.calibration import AcceptanceCalibration, IsotonicMap
from moe_spec.profile.sampling_acceptance import SettingAcceptance
from moe_spec.testing.helpers import random_eagle_head
from moe_spec.testing.tiny_models import tiny_model


def calibration(level: float) -> AcceptanceCalibration:
    iso = IsotonicMap((0.0, 1.0), (level, level), 100)
    return AcceptanceCalibration((iso, iso), (iso, iso), 2)


def with_entries(profile: Profile) -> Profile:
    entries = (
        SettingAcceptance(1.0, 0, 1.0, False, 1.9, 100, 60, calibration(0.1)),
        SettingAcceptance(1.0, 0, 1.0, True, 3.1, 80, 60, calibration(0.3)),
        SettingAcceptance(0.3, 0, 1.0, False, 3.5, 70, 60, calibration(0.6)),
        SettingAcceptance(0.3, 0, 1.0, True, 3.2, 70, 60, calibration(0.5)),
    )
    return replace(profile, sampling_acceptance=entries)


@pytest.fixture(scope="module")
def shipped():
    return Profile.load(ASSETS / "default_profile.json")


def test_auto_takes_the_scheme_that_accepted_more_at_the_nearest_setting(shipped):
    profile = with_entries(shipped)
    assert resolve_scheme(CandidateScheme.AUTO, SamplingConfig(1.0), profile) is True
    assert resolve_scheme(CandidateScheme.AUTO, SamplingConfig(0.3), profile) is False
    with pytest.warns(UserWarning, match="nearest"):
        assert resolve_scheme(CandidateScheme.AUTO, SamplingConfig(0.9, top_p=0.95), profile) is True
    assert resolve_scheme(CandidateScheme.AUTO, SamplingConfig(0.0), profile) is False  # greedy: top tokens
    assert resolve_scheme(CandidateScheme.SAMPLED, SamplingConfig(0.3), profile) is True  # asked for: given


def test_a_profile_without_sampling_settings_keeps_top_tokens_and_says_so(shipped):
    profile = replace(shipped, sampling_acceptance=())
    with pytest.warns(UserWarning, match="measured no sampling setting"):
        assert resolve_scheme(CandidateScheme.AUTO, SamplingConfig(1.0), profile) is False


def test_controllers_price_with_the_calibration_of_the_request(shipped):
    profile = with_entries(shipped)
    controller = build_controller("moe-aware", lambda: profile)
    sizing = controller.sizing  # the cost model's sizing, which the bound's first step in a new regime runs
    budget = controller.begin(TreeBudget(), SamplingConfig(1.0))
    assert budget.sampled and sizing.calibration is profile.sampling_acceptance[1].calibration
    budget = controller.begin(TreeBudget(), SamplingConfig(0.3))
    assert not budget.sampled and sizing.calibration is profile.sampling_acceptance[2].calibration
    controller.begin(TreeBudget(), SamplingConfig(0.0))
    assert sizing.calibration is profile.calibration


def test_the_calibration_round_trips_through_a_saved_profile(tmp_path, shipped):
    profile = with_entries(shipped)
    profile.save(tmp_path / "p.json")
    loaded = Profile.load(tmp_path / "p.json")
    assert loaded.sampling_acceptance == profile.sampling_acceptance


def test_method_names_take_a_scheme_suffix():
    check_name("eagle2@sampled")
    check_name("static:4@top")
    assert expand_methods(["static-best@sampled"])[0] == "static:1@sampled"
    with pytest.raises(InputError, match="top' or 'sampled"):
        check_name("eagle2@random")
    with pytest.raises(InputError, match="drafts nothing"):
        check_name("ar@sampled")
    controller = build_controller("static:4@sampled", lambda: None)
    assert controller.begin(TreeBudget(), SamplingConfig(1.0)).sampled
    assert not controller.begin(TreeBudget(), SamplingConfig(0.0)).sampled


class CuttingController(StaticController):
    """Keeps only the root's first child: a cut of a sampled tree, which the engine must refuse."""

    def plan(self, candidates, draft_ms=0.0):
        return StepPlan(StepForest(tuple(t.subtree([0, 1]) if t.num_drafted > 1 else t for t in candidates)),
                        self._step_budget)


def test_a_controller_that_cuts_a_sampled_tree_is_refused():
    model = tiny_model("qwen3_moe", vocab_size=64, seed=4)
    target = TargetModel(model)
    drafter = EagleDrafter(random_eagle_head(target, draft_vocab=32), target)
    decoder = SpecDecoder(target, drafter, CuttingController(TreeBudget(6, 2, 3), CandidateScheme.SAMPLED))
    with pytest.raises(MoeSpecError, match="sampled candidate tree"):
        decoder.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=6, temperature=1.0,
                         generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # the same controller may cut top-token candidates: greedy decoding never samples them
        decoder.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=6)


def test_auto_without_a_profile_keeps_top_tokens_and_says_so():
    def missing():
        raise InputError("method 'eagle2' needs a profile of the target; pass --profile")

    controller = build_controller("eagle2", missing)
    with pytest.warns(UserWarning, match="no profile"):
        assert not controller.begin(TreeBudget(), SamplingConfig(1.0)).sampled
