"""numpy's BLAS kept to one thread while moe_spec decodes.

The step's small numpy products (the controller's expert prices, the head-routing predictor) run
between the target's forwards. numpy's bundled OpenBLAS starts a thread per core for them and
leaves those threads spinning after each call, on the very cores torch's own threads need for the
next forward: measured on a 2-core machine with the defaults a user gets, `moe-aware` at B = 4 ran
0.44x plain decoding, and 1.19x with OPENBLAS_NUM_THREADS=1. Each product is far too small to gain
from a second thread, so decoding holds numpy's BLAS to one thread and gives the setting back when
it returns; torch's threads (OpenMP, MKL inside torch) are not touched.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator


@functools.cache
def _numpy_blas():
    """threadpoolctl's handle on the BLAS libraries loaded in this process (numpy's OpenBLAS; torch
    brings none of its own on the CPU builds), found once: the scan reads every loaded library."""
    import numpy  # noqa: F401  loaded, so that its BLAS is found
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController().select(user_api="blas")


@contextlib.contextmanager
def single_threaded_blas() -> Iterator[None]:
    """Inside: every loaded BLAS library runs one thread; after: each as it was."""
    with _numpy_blas().limit(limits=1):
        yield
