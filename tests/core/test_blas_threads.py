"""numpy's BLAS runs one thread while SpecDecoder decodes, and as many as before once it returns
(also when decoding fails); torch's threads are left alone."""

import pytest
import torch
from threadpoolctl import threadpool_info

from moe_spec import LookupDrafter, SpecDecoder
from moe_spec.testing.helpers import REPETITIVE_PROMPT
from moe_spec.testing.tiny_models import tiny_model


def _blas_threads() -> list[int]:
    return [info["num_threads"] for info in threadpool_info() if info["user_api"] == "blas"]


class _Watching(LookupDrafter):
    """The lookup drafter, noting numpy's BLAS threads and torch's each time it drafts."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def propose(self, root_token, budget, sampling):
        self.seen.append((_blas_threads(), torch.get_num_threads()))
        return super().propose(root_token, budget, sampling)


def test_numpy_blas_is_one_thread_inside_generate_and_restored_after():
    before, torch_threads = _blas_threads(), torch.get_num_threads()
    assert before, "numpy's BLAS is loaded"
    drafter = _Watching()
    SpecDecoder(tiny_model("qwen3_moe"), drafter=drafter).generate(torch.tensor([REPETITIVE_PROMPT]), max_new_tokens=8)
    assert drafter.seen and all(blas == [1] * len(before) and threads == torch_threads for blas, threads in drafter.seen)
    assert _blas_threads() == before and torch.get_num_threads() == torch_threads


def test_the_setting_comes_back_when_decoding_fails():
    before = _blas_threads()

    class Failing(LookupDrafter):
        def propose(self, root_token, budget, sampling):
            raise RuntimeError("drafter failed")

    with pytest.raises(RuntimeError, match="drafter failed"):
        SpecDecoder(tiny_model("qwen3_moe"), drafter=Failing()).generate(torch.tensor([REPETITIVE_PROMPT]),
                                                                         max_new_tokens=8)
    assert _blas_threads() == before
