"""Proving membership of the job and the integrity of what arrives: the challenge-response on the job's
secret (``auth``), the frame seal (``integrity``), the bounds on handshakes under way (``admission``) and the
thread that runs many handshakes at once (``gate``). The transports and the discovery store both stand on it."""
