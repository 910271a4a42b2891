"""Keep the stand-in pynvml honest: the installed nvidia-ml-py is the reference.

Whatever the stand-in offers under pynvml's name must exist in pynvml with the
same value, signature, structure fields or exception class, and where both can
run here (no driver) they must fail the same way.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from types import ModuleType

import pynvml as real
import pytest

from tests.stand_ins import NVML_MACHINE
from tests.stand_ins import pynvml as standin


def _own_public_names() -> list[str]:
    names = []
    for name, value in vars(standin).items():
        if name.startswith("_") or name == "annotations" or isinstance(value, ModuleType):
            continue  # private, the __future__ import, or an imported module
        defined_here = getattr(value, "__module__", standin.__name__) == standin.__name__
        if defined_here or not callable(value):
            names.append(name)
    return sorted(names)


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Both modules as in a new process on a machine without libnvidia-ml."""
    monkeypatch.delenv(NVML_MACHINE, raising=False)
    standin._standin_reset()
    yield
    standin._standin_reset()


def test_the_stand_in_offers_only_what_pynvml_has() -> None:
    names = _own_public_names()
    assert "nvmlDeviceGetProcessUtilization" in names
    assert "NVMLError_GpuIsLost" in names
    assert [n for n in names if not hasattr(real, n)] == []


def test_constants_have_pynvml_values() -> None:
    for name in _own_public_names():
        value = getattr(standin, name)
        if isinstance(value, int | str):
            assert getattr(real, name) == value, name
    for name in ("NVML_VALUE_NOT_AVAILABLE_ulonglong", "NVML_VALUE_NOT_AVAILABLE_uint"):
        assert getattr(standin, name).value == getattr(real, name).value
    assert standin._STANDIN_ENVIRONMENT == NVML_MACHINE


def test_functions_have_pynvml_signatures() -> None:
    for name in _own_public_names():
        value = getattr(standin, name)
        if inspect.isfunction(value):
            ours = list(inspect.signature(value).parameters)
            theirs = list(inspect.signature(getattr(real, name)).parameters)
            assert ours == theirs, name


@pytest.mark.parametrize(
    "name",
    [
        "c_nvmlMemory_t",
        "c_nvmlMemory_v2_t",
        "c_nvmlProcessInfo_v2_t",
        "c_nvmlProcessInfo_v3_t",
        "c_nvmlProcessInfo_t",
        "c_nvmlProcessUtilizationSample_t",
    ],
)
def test_structures_have_pynvml_fields(name: str) -> None:
    assert getattr(standin, name)._fields_ == getattr(real, name)._fields_


def test_every_error_code_has_pynvml_exception_class(fresh: None) -> None:
    codes = sorted(real.NVMLError._valClassMapping)
    assert sorted(standin.NVMLError._valClassMapping) == codes
    for code in [*codes, standin.NVML_SUCCESS, 12345]:
        ours, theirs = standin.NVMLError(code), real.NVMLError(code)
        assert type(ours).__name__ == type(theirs).__name__
        assert ours.value == theirs.value == code
        assert str(ours) == str(theirs)
        assert isinstance(ours, standin.NVMLError)
    for code in codes:
        subclass = standin.nvmlExceptionClass(code)
        assert subclass.__name__ == real.nvmlExceptionClass(code).__name__
        assert subclass().value == code
        assert issubclass(subclass, standin.NVMLError)
        assert getattr(standin, subclass.__name__) is subclass
    with pytest.raises(ValueError, match="not valid"):
        standin.nvmlExceptionClass(12345)


def test_without_a_library_both_fail_alike(fresh: None) -> None:
    try:
        real.nvmlInit()
    except real.NVMLError_LibraryNotFound:
        pass
    else:
        real.nvmlShutdown()
        pytest.skip("this machine has libnvidia-ml.so.1")
    with pytest.raises(standin.NVMLError_LibraryNotFound):
        standin.nvmlInit()
    for module in (real, standin):
        with pytest.raises(module.NVMLError_Uninitialized):
            module.nvmlDeviceGetCount()
        with pytest.raises(module.NVMLError_Uninitialized):
            module.nvmlShutdown()
