"""What the whole suite shares.

``cuda_library`` is the stand-in ``libcuda.so.1`` (``tests/stand_ins``), compiled
once per session rather than once per test.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.stand_ins.cudadouble import NoCompiler, build_library


@pytest.fixture(scope="session")
def cuda_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stand-in libcuda.so.1, built once (skips without a C compiler)."""
    try:
        return build_library(tmp_path_factory.mktemp("cudadouble"))
    except NoCompiler as err:
        pytest.skip(str(err))
