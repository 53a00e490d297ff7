"""What differs between the supported vLLM releases (foursight.quant_methods.vllm_compat), checked on the CPU build
(0.32) with 0.26's differences reproduced: 0.26's abstract ``trainer_send_weights`` and its version-less RL routes."""

from __future__ import annotations

from abc import abstractmethod

import pytest

pytest.importorskip("vllm")

from foursight.quant_methods.vllm_compat import TESTED, check_version, native_weight_version, parse_version, vllm_version  # noqa: E402

pytestmark = pytest.mark.vllm


def test_versions_are_read_and_the_installed_one_is_tested():
    assert parse_version("0.26.0") == (0, 26) and parse_version("0.32.0+cpu") == (0, 32) and parse_version("0.33.1.dev4") == (0, 33)
    assert parse_version("unknown") is None
    assert vllm_version() in TESTED  # CI's CPU build
    assert check_version() is None and check_version((0, 26)) is None


def test_an_untested_version_warns_naming_the_tested_ones():
    w = check_version((0, 29))
    assert w and "0.29" in w and "0.26" in w and "0.32" in w


def test_native_weight_sync_needs_the_versioned_routes():
    assert native_weight_version((0, 32)) and native_weight_version((0, 33)) and not native_weight_version((0, 26))


def test_the_file_engine_builds_where_trainer_send_weights_is_abstract():
    """vLLM 0.26's base declares ``trainer_send_weights`` abstract; a backend without it cannot be instantiated there
    (``TypeError: Can't instantiate abstract class``). Reproduced on 0.32's base with 0.26's declaration added."""
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    from foursight.quant_methods.vllm_weight_transfer import FourSightFileEngine

    class Base026(WeightTransferEngine):  # 0.26's extra abstract method, on top of 0.32's base
        @staticmethod
        @abstractmethod
        def trainer_send_weights(iterator, trainer_args) -> None: ...

    class Engine026(FourSightFileEngine, Base026):
        pass

    assert not Engine026.__abstractmethods__, Engine026.__abstractmethods__
    with pytest.raises(NotImplementedError, match="safetensors file"):
        Engine026.trainer_send_weights(iter(()), {})
