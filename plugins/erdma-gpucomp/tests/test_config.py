"""Settings that cannot take effect are refused, naming the key; a codec only a GPU runs is refused on a
rank without one; a receiver never needs the sender's device."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make
from erdma_gpucomp import device

from erdma_core import load_config
from erdma_core.sdk import ConfigError

NO_GPU = not device.gpu_present()


@pytest.mark.skipif(not NO_GPU, reason="a GPU is present here")
@pytest.mark.parametrize("name", ["cascaded", "bitcomp", "ans", "gdeflate"])
def test_nvcomp_only_codecs_are_refused_without_a_gpu(name):
    with pytest.raises(ConfigError, match=rf"'compression\.{name}\.device'.*needs a CUDA GPU.*int8"):
        make(name)


@pytest.mark.skipif(not NO_GPU, reason="a GPU is present here")
@pytest.mark.parametrize("name", ["int8", "lz4"])
def test_device_cuda_is_refused_without_a_gpu(name):
    with pytest.raises(ConfigError, match=rf"'compression\.{name}\.device': value 'cuda' needs a CUDA GPU"):
        make(name, device="cuda")


@pytest.mark.skipif(not NO_GPU, reason="a GPU is present here")
def test_a_receiver_needs_no_gpu_until_a_gpu_only_payload_arrives():
    receiver = make("cascaded", sending=False)
    out = np.empty(10, np.float32)
    with pytest.raises(ValueError, match=r"nvcomp's Cascaded on a GPU.*no usable GPU"):
        receiver.decode(memoryview(b"\0" * 8), b"", "float32", out)
    assert make("int8", sending=False, device="cuda").device == "cpu"


def test_auto_is_the_cpu_without_a_gpu():
    assert make("int8").device == ("cuda" if not NO_GPU else "cpu")


def test_int4_refuses_an_odd_block():
    with pytest.raises(ConfigError, match=r"'compression\.int4\.block': value 33 is odd"):
        make("int4", block=33)


def test_bad_values_are_refused_by_the_config_pipeline(monkeypatch):
    monkeypatch.setenv("ERDMA_COMPRESSION", "int8")
    monkeypatch.setenv("ERDMA_COMPRESSION_INT8_BLOCK", "1")
    with pytest.raises(ConfigError, match=r"'compression\.int8\.block': value 1 is below the minimum 2"):
        load_config()
    monkeypatch.setenv("ERDMA_COMPRESSION_INT8_BLOCK", "64")
    monkeypatch.setenv("ERDMA_COMPRESSION_TOPK_FRACTION", "0.9")
    with pytest.raises(ConfigError, match=r"'compression\.topk\.fraction': value 0\.9 is above the maximum 0\.5"):
        load_config()
    monkeypatch.delenv("ERDMA_COMPRESSION_TOPK_FRACTION")
    monkeypatch.setenv("ERDMA_COMPRESSION_INT8_DEVICE", "tpu")
    with pytest.raises(ConfigError, match=r"'compression\.int8\.device': invalid value 'tpu'; valid choices: "
                                          r"auto, cpu, cuda"):
        load_config()


def test_compression_names_list_the_codecs(monkeypatch):
    monkeypatch.setenv("ERDMA_COMPRESSION", "int9")
    with pytest.raises(ConfigError, match=r"'compression\.name': invalid value 'int9'.*int8.*did you mean"):
        load_config()


def _report(queue) -> None:
    queue.put((device.gpu_present(), device.absent()))


def test_a_process_forked_after_cuda_ran_uses_no_gpu():
    """A CUDA context does not survive fork(): a child forked after its parent ran cupy says so and encodes on
    the CPU (``auto``), and ``cuda`` is refused there with the reason."""
    import multiprocessing as mp

    device._state["used"] = True
    try:
        ctx = mp.get_context("fork")
        queue = ctx.Queue()
        child = ctx.Process(target=_report, args=(queue,))
        child.start()
        present, why = queue.get(timeout=60)
        child.join(60)
    finally:
        device._state["used"] = False
    assert present is False
    assert why.startswith("this process was forked after its parent ran CUDA code; start ranks with erdma run")
