"""erdma-dpdk's shim, built with AddressSanitizer and UBSan (``build.py``), fed malformed frames:

    LD_PRELOAD=$(cc -print-file-name=libasan.so) python dpdk_frames.py BUILT CORPUS [--mutations N] [--seed S]

An endpoint of rank 0 with a link to rank 1 on a DPDK pcap port (``net_pcap``): what it receives is a pcap
file of the corpus's frames (``corpus/dpdk.txt``, each with the link's job, nonce and ranks filled in, then as
it is) and ``N`` mutations of each, between data of its own it sends to rank 1; it reads what lands. Every
frame goes through ``receive`` (the checks of ``struct wire``, ACKs and SACK bitmaps, the reordering window,
the copy out). DPDK's own memory (the mbufs) is not the sanitizers' to watch (DPDK is not built with them):
what they see is the shim's own memory and arithmetic.

A sanitizer that finds a fault stops the process with its report: exit status not 0. Prints one line of
counts at the end."""

from __future__ import annotations

import random
import struct
import tempfile
import time
from pathlib import Path

from mutate import arguments, corpus, load, mutations

ETHER_TYPE, MAGIC, VERSION = 0x88B5, 0x4544, 1
JOB, NONCE, PEER_NONCE = 0x5EED, 0x1111, 0x2222
# struct wire (erdma_dpdk/shim.c), packed: MACs, ether type (big-endian), then host order (little-endian here)
HEAD = struct.Struct("<6s6s")
BODY = struct.Struct("<HBBIIHHIIQIHH")


def frame(*, type_: int, psn: int = 0, ack: int = 0, sack: int = 0, window: int = 64, payload: bytes = b"",
          length: int | None = None, job: int = JOB, nonce: int = PEER_NONCE, src: int = 1, dst: int = 0) -> bytes:
    """A frame from rank ``src`` to rank ``dst`` as erdma-dpdk's wire has it."""
    n = len(payload) if length is None else length
    return (HEAD.pack(b"\x02\x00\x00\x00\x00\x00", b"\x02\x00\x00\x00\x00\x01") + struct.pack(">H", ETHER_TYPE)
            + BODY.pack(MAGIC, VERSION, type_, job, nonce, src, dst, psn, ack, sack, window, n, 0) + payload)


def pcap(frames: list[bytes], path: Path) -> None:
    out = [struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 65535, 1)]
    for i, data in enumerate(frames):
        data = data[:65535]
        out.append(struct.pack("<IIII", i // 1000000, i % 1000000, len(data), len(data)) + data)
    path.write_bytes(b"".join(out))



def main() -> None:
    args = arguments()
    load(args.built, "erdma_dpdk._shim")
    from erdma_dpdk import eal
    from erdma_dpdk._shim import ffi, lib

    rng = random.Random(args.seed)
    seeds = corpus(args.corpus / "dpdk.txt")
    frames = []
    for seed in seeds:
        frames.append(seed)
        frames += mutations(rng, seed, seeds, args.mutations)
    # the same frames again with their header's fields rewritten where a mutation had left them alone, so that
    # they pass the shim's first checks (job, nonce, ranks) and reach the link's own handling
    for data in list(frames):
        if len(data) >= 14 + BODY.size:
            fields = list(BODY.unpack_from(data, 14))
            fields[0:2], fields[3:7] = [MAGIC, VERSION], [JOB, PEER_NONCE, 1, 0]
            frames.append(data[:14] + BODY.pack(*fields) + data[14 + BODY.size:])
    eal.start(256)
    ep = lib.eds_ep_new(b"sanitize", 0, JOB, NONCE, 1500, 2048, 64, 256, 2, 1, 1000, 100000, 1000, 60000, 0, 1000)
    assert ep != ffi.NULL, eal.error()
    with tempfile.TemporaryDirectory() as tmp:
        rx = Path(tmp) / "rx.pcap"
        pcap(frames, rx)
        port = lib.eds_add_port(ep, b"net_pcap_sanitize", f"rx_pcap={rx},tx_pcap=/dev/null".encode(), 0)
        assert port == 0, eal.error()
        assert lib.eds_add_link(ep, 1, 0, b"\x02\x00\x00\x00\x00\x01", PEER_NONCE) == 0, eal.error()
        payload = bytes(rng.getrandbits(8) for _ in range(1 << 16))
        buf = ffi.from_buffer(payload)
        out = ffi.new("unsigned char[]", 1 << 20)
        info = ffi.new("eds_link_info *")
        read = sent = 0
        end = time.monotonic() + 60
        while time.monotonic() < end:
            if sent < 64:
                lib.eds_send(ep, 1, b"h" * 16, 16, buf, len(payload), ffi.NULL, 0, sent, 0)
                sent += 1
            lib.eds_progress(ep, 1000)
            while (n := lib.eds_read(ep, 1, out, 1 << 20, 0)) > 0:
                read += n
            lib.eds_link_info_get(ep, 1, info)
            if info.received_packets + info.foreign >= len(frames) or info.dead:
                break
        lib.eds_link_info_get(ep, 1, info)
        state = f"dead: {ffi.string(info.why).decode()}" if info.dead else "up"
        print(f"sanitize: dpdk: frames {len(frames)}, taken by the link {info.received_packets}, foreign "
              f"{info.foreign}, bytes read {read}, sends {sent}, link {state}", flush=True)
        lib.eds_ep_free(ep)


if __name__ == "__main__":
    main()
