"""``CompressorConformance``: the behaviour every compressor must show (``erdma_core.sdk.Compressor``), checked
without a network against numpy. A compressor plugin's tests do

    from erdma_core.testing.compressor_conformance import CompressorConformance

    class TestInt8(CompressorConformance):
        compressor = "int8"
        tolerance = 0.01           # lossy: the relative L2 error one encode may leave on float data

Each test makes the compressor as a job would: its registered factory, given the job's config with
``compression.name`` selecting it and ``settings`` over its options' defaults. The receiver's copy is made
from a config that selects nothing, as a rank whose own config differs.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from ..compression import Compressor, Encoded, Site
from ..protocol import dtypes as dt
from ..protocol.limits import encoded_limit

FLOATS = ("float16", "bfloat16", "float32", "float64")
DTYPES = (*FLOATS, "int8", "uint8", "int32", "int64")
SIZES = (1, 7, 4096, 100_003)
MAX_META = 1 << 16


def make(name: str, settings: dict[str, Any] | None = None, *, selected: bool = True) -> Compressor:
    """The compressor ``name`` as a rank's job makes it: its registered factory, its options' defaults with
    ``settings`` over them, the job's config selecting it (``selected``) or not (a rank that only decodes)."""
    from ..api.join import load_config
    from ..plugins.manager import components

    comps = components()
    prefix = f"compression.{name}."
    config = load_config({"compression.name": name if selected else "none",
                          **{prefix + k: v for k, v in (settings or {}).items()}}, comps)
    return comps.create("compressor", name, config, config.section(f"compression.{name}"))  # type: ignore[no-any-return]


def sample(dtype: str, n: int, seed: int = 0) -> np.ndarray:
    """``n`` elements of eRDMA dtype ``dtype`` in its storage (bfloat16 as uint16 bits): gradient-like normal
    values for floats, the whole range for integers."""
    rng = np.random.default_rng(seed)
    if dtype in FLOATS:
        x = (rng.standard_normal(n) * 0.01).astype(np.float32)
        if dtype == "bfloat16":
            return (x.view(np.uint32) >> 16).astype(np.uint16)
        return x.astype(dt.storage(dtype))
    info = np.iinfo(dt.storage(dtype))
    return rng.integers(info.min, info.max, n, dtype=dt.storage(dtype), endpoint=True)


def as_float(values: np.ndarray, dtype: str) -> np.ndarray:
    """Float64 values of elements in ``dtype``'s storage."""
    if dtype == "bfloat16":
        return (values.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return values.astype(np.float64)


def relative_error(got: np.ndarray, want: np.ndarray, dtype: str) -> float:
    a, b = as_float(got, dtype), as_float(want, dtype)
    return float(np.linalg.norm(a - b)) / max(float(np.linalg.norm(b)), 1e-30)


class CompressorConformance:
    compressor: ClassVar[str] = "none"
    #: options of ``[compression.<name>]`` over their defaults
    settings: ClassVar[dict[str, Any]] = {}
    #: dtypes the compressor must encode (not decline) at the sizes it is sent at
    encodes: ClassVar[tuple[str, ...]] = ("float32",)
    #: lossy: the relative L2 error one encode may leave on the sample's float data
    tolerance: ClassVar[float] = 0.0
    #: lossy with error feedback: what one encode lost reaches the receiver over the next steps
    feedback: ClassVar[bool] = True

    def made(self, selected: bool = True) -> Compressor:
        return make(self.compressor, self.settings, selected=selected)

    def _round_trip(self, comp: Compressor, data: np.ndarray, dtype: str, site: Site | None = None
                    ) -> tuple[Encoded | None, np.ndarray]:
        before = data.copy()
        enc = comp.encode(data, dtype, site)
        assert np.array_equal(data.view(np.uint8), before.view(np.uint8)), f"{self.compressor}: encode changed its input"
        out = np.full_like(data, 0x5A if data.dtype.kind in "iu" else 7)
        if enc is None:
            return None, data.copy()
        payload = memoryview(enc.payload).cast("B")
        assert isinstance(enc.meta, bytes) and len(enc.meta) <= MAX_META, (self.compressor, len(enc.meta))
        assert payload.nbytes <= encoded_limit(data.nbytes), (self.compressor, dtype, data.size, payload.nbytes)
        self.made(selected=False).decode(payload, enc.meta, dtype, out)
        return enc, out

    def test_it_is_registered_under_its_name_and_says_whether_it_is_lossy(self) -> None:
        comp = self.made()
        assert comp.name == self.compressor and isinstance(comp.lossy, bool)
        assert (self.tolerance > 0) == comp.lossy, "a lossy compressor states its tolerance; a lossless one none"

    def test_every_dtype_and_size_round_trips_within_its_bound(self) -> None:
        comp = self.made()
        for dtype in DTYPES:
            for n in SIZES:
                data = sample(dtype, n, seed=n)
                enc, out = self._round_trip(comp, data, dtype)
                if enc is None:
                    assert dtype not in self.encodes or n < 8, f"{self.compressor} declined {dtype} x {n}"
                    continue
                if comp.lossy and dtype in FLOATS:
                    err = relative_error(out, data, dtype)
                    assert err <= self.tolerance, (self.compressor, dtype, n, err)
                else:  # lossless, or integers: bit for bit
                    assert np.array_equal(out.view(np.uint8), data.view(np.uint8)), (self.compressor, dtype, n)

    def _float32(self, comp: Compressor, data: np.ndarray) -> Encoded | None:
        """``data`` encoded as float32 without a site; None (after checking it may) when the codec declines."""
        enc = comp.encode(data, "float32", None)
        assert enc is not None or "float32" not in self.encodes, f"{self.compressor} declined float32"
        return enc

    def test_the_receivers_copy_decodes_alike_whatever_its_config(self) -> None:
        sender, data = self.made(), sample("float32", 4096, seed=3)
        enc = self._float32(sender, data)
        if enc is None:
            return
        mine, theirs = np.empty_like(data), np.empty_like(data)
        sender.decode(memoryview(enc.payload).cast("B"), enc.meta, "float32", mine)
        self.made(selected=False).decode(memoryview(enc.payload).cast("B"), enc.meta, "float32", theirs)
        assert np.array_equal(mine.view(np.uint32), theirs.view(np.uint32))

    def test_non_finite_values_arrive_where_they_were_or_the_message_goes_raw(self) -> None:
        comp, data = self.made(), sample("float32", 4096, seed=5)
        data[[3, 100, 2000]] = [np.nan, np.inf, -np.inf]
        enc, out = self._round_trip(comp, data, "float32")
        if enc is None:
            return
        assert np.array_equal(np.isnan(out), np.isnan(data)) and np.array_equal(np.isposinf(out), np.isposinf(data))
        assert np.array_equal(np.isneginf(out), np.isneginf(data)), self.compressor
        finite = np.isfinite(data)
        if comp.lossy:
            assert relative_error(out[finite], data[finite], "float32") <= self.tolerance
        else:
            assert np.array_equal(out.view(np.uint32), data.view(np.uint32))

    def test_a_cut_or_grown_payload_is_refused_not_read_past(self) -> None:
        comp, data = self.made(), sample("float32", 4096, seed=7)
        enc = self._float32(comp, data)
        if enc is None:
            return
        payload = bytes(memoryview(enc.payload).cast("B"))
        for bad in (payload[:-1], payload + b"\0" * 8):
            out = np.empty_like(data)
            try:
                self.made(selected=False).decode(memoryview(bad), enc.meta, "float32", out)
            except Exception:  # the executor reports it as a ProtocolError naming the compressor and the peer
                continue
            raise AssertionError(f"{self.compressor} decoded a payload of {len(bad)} bytes (encoded: {len(payload)})")

    def test_without_a_site_it_keeps_nothing_between_encodes(self) -> None:
        comp, data = self.made(), sample("float32", 4096, seed=9)
        first, second = comp.encode(data, "float32", None), comp.encode(data, "float32", None)
        assert (first is None) == (second is None)
        if first is not None and second is not None:
            assert bytes(memoryview(first.payload).cast("B")) == bytes(memoryview(second.payload).cast("B"))
            assert first.meta == second.meta

    def test_error_feedback_delivers_over_steps_what_one_encode_lost(self) -> None:
        comp = self.made()
        if not (comp.lossy and self.feedback):
            return
        data, site, steps = sample("float32", 4096, seed=11), Site("conformance", "allreduce", "ring", 0, 0, 4096), 20
        total = np.zeros(data.size, np.float64)
        one_step = None
        for _ in range(steps):
            _, out = self._round_trip(comp, data, "float32", site)
            total += out
            if one_step is None:
                one_step = float(np.linalg.norm(out - data.astype(np.float64)))
        drift = float(np.linalg.norm(total / steps - data.astype(np.float64)))
        assert one_step is not None and drift <= 0.5 * one_step, (self.compressor, drift, one_step)
